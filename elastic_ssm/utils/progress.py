"""What long work shows and leaves to read (DESIGN rule 9), torch-free: ``progress`` (the one tqdm bar), ``shown``,
``tuning_notice`` (a fresh machine's first CUDA prefill), ``format_table`` (the one text table) and ``pyplot`` /
``save_png`` (the plots); docs/architecture.md, ``utils/progress.py``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .environment import env_flag
from .files import atomic_writer

__all__ = ["format_table", "kernels_tuned", "progress", "pyplot", "save_png", "shown", "triton_cache_dir",
           "tuning_notice"]

log = logging.getLogger("elastic_ssm")
_CHECKED: list[bool] = []       # the first CUDA prefill of the process was looked at (the cache is read once)


def _disable(enabled: bool) -> bool | None:
    """tqdm's ``disable`` for ``enabled``: True (off), False (forced on) or None (on when stderr is a terminal)."""
    if not enabled:
        return True
    raw = os.environ.get("ELASTIC_SSM_PROGRESS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    return False if raw == "always" or env_flag("ELASTIC_SSM_PROGRESS") else True    # 1: always, 0: never


def shown(enabled: bool) -> bool:
    """Whether ``progress(..., enabled=enabled)`` would draw a bar, for tools that draw their own (the Rust
    tokenizers trainer): the same decision, ``--quiet`` and a stderr that is not a terminal both turn it off."""
    disable = _disable(enabled)
    return not disable if disable is not None else sys.stderr.isatty()


def progress(iterable: Iterable[Any] | None = None, desc: str = "", total: int | None = None,
             enabled: bool = False, unit: str = "it", **kw: Any) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one with ``.update``) on stderr; silent unless ``enabled``."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=_disable(enabled), file=sys.stderr,
                dynamic_ncols=True, leave=False, **kw)


def _cell(v: Any, width: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    s = str(v)
    return s[:width - 3] + "..." if width and len(s) > width else s


def format_table(rows: list[dict], columns: list[str], title: str | None = None) -> str:
    """Rows as a left/right aligned text table over ``columns`` (missing cells print '-'; a str cell as it is)."""
    head = list(columns)
    body = [[_cell(r.get(c), 80) for c in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [fmt(head), "-" * len(fmt(head)), *map(fmt, body)]
    return "\n".join(([title] if title else []) + lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not installed (extra ``plot``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(fig: Any, path: str | Path) -> None:
    """``fig`` written to ``path`` as a PNG atomically (an old figure stays whole until the new one is complete),
    then closed."""
    fig.tight_layout()
    with atomic_writer(path) as f:
        fig.savefig(f, format="png", dpi=120)
    pyplot().close(fig)


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels and autotuning results (``TRITON_CACHE_DIR``, else its default)."""
    env = os.environ.get("TRITON_CACHE_DIR", "").strip()
    return Path(env) if env else Path.home() / ".triton" / "cache"


#: the scan's fla output kernel, compiled once per machine: its files in Triton's cache (``<key>/<name>.cubin``, its
#: ``.json`` metadata...) say the first prefill ran here, also when every config came from the shipped files and
#: Triton timed nothing (then no ``*.autotune.json`` is written)
SCAN_KERNEL = "chunk_gla_fwd_kernel_o"


def kernels_tuned(cache: Path | None = None) -> bool:
    """Whether the Triton cache already holds autotuning results (``<cache>/<key>/*.autotune.json``) or the scan's
    compiled kernel (``<cache>/<key>/chunk_gla_fwd_kernel_o.*``)."""
    cache = triton_cache_dir() if cache is None else cache
    try:
        return any(True for _ in cache.glob("*/*.autotune.json")) or any(True for _ in cache.glob(f"*/{SCAN_KERNEL}.*"))
    except OSError:
        return False


@contextmanager
def tuning_notice(device: Any, every: float = 10.0, cache: Path | None = None):
    """Around the first CUDA prefill of a process: the lines of the module docstring on a cold machine, else
    nothing. ``device``: a ``torch.device`` (or anything with ``.type``)."""
    cache = triton_cache_dir() if cache is None else cache
    if getattr(device, "type", device) != "cuda" or _CHECKED:
        yield
        return
    _CHECKED.append(True)
    if kernels_tuned(cache):
        yield
        return
    shipped = os.environ.get("FLA_CONFIG_DIR", "").strip()     # fla configs for known shapes (ops/dispatch.py)
    where = f"; tuned configs of known shapes from {shipped}" if shipped else ""
    how_long = "those compile in seconds, a new shape tunes for about a minute" if shipped else "about a minute"
    log.warning("tuning kernels for this GPU (first run only, cached in %s%s): %s", cache, where, how_long)
    start, done = time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log.warning("still tuning kernels: %.0f s", time.monotonic() - start)

    ticker = threading.Thread(target=tick, name="elastic-ssm-tuning-notice", daemon=True)
    ticker.start()
    finished = False
    try:
        yield
        finished = True
    finally:
        done.set()
        ticker.join()
        if finished:
            log.warning("kernels tuned in %.0f s; later runs on this machine read them from %s",
                        time.monotonic() - start, cache)
        else:
            log.warning("kernel tuning stopped after %.0f s by an error", time.monotonic() - start)
