"""Serving every tier of one checkpoint, and choosing a tier for a budget (DESIGN: serving sits on top).

* ``select_tier`` (``select.py``; ``es.select_tier``): the best tier within latency / state / parameter budgets;
* ``calibrate.py``: writes ``tier_profile.json`` and ``tier_quality.json``;
* the server (``elastic-ssm serve``, the ``serve`` extra; docs/serving.md): ``slots.py`` (the slot pool),
  ``tokens.py`` (sampling, text), ``engine.py`` / ``remote.py`` (continuous batching), ``schema.py`` /
  ``protocol.py`` (the OpenAI bodies), ``guard.py`` / ``header_deadline.py`` (limits), ``metrics.py``, ``app.py``.

FastAPI, uvicorn, prometheus_client and ``schema.py`` are imported only through ``app.py`` and ``cli.py``'s ``serve``.
"""

from __future__ import annotations

from .select import read_profile, read_quality, select_tier

__all__ = ["select_tier", "read_profile", "read_quality"]
