"""The one progress bar of the library and the CLI (DESIGN rule 9: long work shows progress).

``progress(iterable, desc, total, enabled)`` wraps an iterable in a tqdm bar on stderr, so results printed on
stdout stay clean when piped. ``enabled=False`` (the library default) shows nothing; ``enabled=True`` (the CLI
without ``--quiet``) shows the bar when stderr is a terminal (tqdm's ``disable=None``). The environment variable
``ELASTIC_SSM_PROGRESS=always`` forces enabled bars on whatever stderr is (tests, logs that want them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["progress"]


def progress(iterable: Iterable[Any] | None = None, desc: str = "", total: int | None = None,
             enabled: bool = False, unit: str = "it", **kw: Any) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one with ``.update``) on stderr; silent unless ``enabled``."""
    from tqdm.auto import tqdm

    if not enabled:
        disable: bool | None = True
    else:
        disable = False if os.environ.get("ELASTIC_SSM_PROGRESS") == "always" else None
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=False, **kw)
