"""Serving every tier of one checkpoint (docs/serving.md), and ``select_tier``: the tier for a budget. FastAPI,
uvicorn and prometheus_client are imported only through ``app.py`` and ``cli.py``'s ``serve``."""

from __future__ import annotations

from .select import select_tier

__all__ = ["select_tier"]
