"""Serving every tier of one checkpoint, and choosing a tier for a budget (DESIGN: serving sits on top).

* ``select_tier`` (``select.py``; ``es.select_tier``): the best tier within latency / state / parameter
  budgets, from the config's exact counts, ``tier_profile.json`` and ``tier_quality.json``;
* ``calibrate.py``: writes ``tier_profile.json`` (``elastic-ssm calibrate``) and ``tier_quality.json``
  (``elastic-ssm eval``);
* the server (``elastic-ssm serve``, the ``serve`` extra): ``slots.py`` (one slot pool per tier: a fused
  decoder at a fixed batch whose rows are sequences, prefilled one row at a time), ``tokens.py`` (per-row
  sampling, detokenization, stop strings), ``engine.py`` (continuous batching thread), ``schema.py``
  (the request and response bodies, pydantic), ``protocol.py`` (the rules a schema cannot say, chat template),
  ``guard.py`` (key, limits), ``metrics.py`` (prometheus_client), ``app.py`` (FastAPI routes), ``cli.py``.
  docs/serving.md describes the whole.

FastAPI, uvicorn, prometheus_client and ``schema.py`` are imported only through ``app.py`` and ``cli.py``'s ``serve``.
"""

from __future__ import annotations

from .select import read_profile, read_quality, select_tier

__all__ = ["select_tier", "read_profile", "read_quality"]
