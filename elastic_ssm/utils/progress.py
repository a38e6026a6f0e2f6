"""The one progress bar of the library and the CLI (DESIGN rule 9): tqdm on stderr, silent unless ``enabled``, shown
on a terminal (``ELASTIC_SSM_PROGRESS=always`` forces it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["progress", "shown"]


def _disable(enabled: bool) -> bool | None:
    """tqdm's ``disable`` for ``enabled``: True (off), False (forced on) or None (on when stderr is a terminal)."""
    if not enabled:
        return True
    return False if os.environ.get("ELASTIC_SSM_PROGRESS") == "always" else None


def shown(enabled: bool) -> bool:
    """Whether ``progress(..., enabled=enabled)`` would draw a bar, for tools that draw their own (the Rust
    tokenizers trainer): the same decision, ``--quiet`` and a stderr that is not a terminal both turn it off."""
    disable = _disable(enabled)
    return not disable if disable is not None else sys.stderr.isatty()


def progress(iterable: Iterable[Any] | None = None, desc: str = "", total: int | None = None,
             enabled: bool = False, unit: str = "it", **kw: Any) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one with ``.update``) on stderr; silent unless ``enabled``."""
    from tqdm.auto import tqdm

    disable = _disable(enabled)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=False, **kw)
