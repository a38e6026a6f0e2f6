"""Backend selection: the spectral scan's ``"torch"`` (any device), ``"fla"`` (fla-core's Triton GLA kernels, CUDA)
or ``"naive"`` (the spec), and the decode kernels' ``"triton"`` or ``"torch"``. fla and triton are optional and
never imported at module import.

Kernel configs of fla's autotuned kernels shipped per GPU (``ops/fla_configs/<GPU>/``; issue 39: the first token on
a cold machine), which fla-core itself reads under ``FLA_CACHE_MODE=strict`` and ``FLA_CONFIG_DIR`` (exact autotuning
keys only; docs/performance.md, "Graphed compiled prefill"); ``python -m benchmarks.fla_configs`` builds the files
from Triton's on-disk autotuning results after a run."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import threading
from pathlib import Path

import torch

ENV_VAR = "ELASTIC_SSM_SCAN_BACKEND"
BACKENDS = ("auto", "torch", "fla", "naive")
_FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_logger = logging.getLogger("elastic_ssm")
_announced: set[tuple[str, str]] = set()
_FLA_OK: list[bool] = []  # memo of fla_available(): a plain global, so compiled code reads it as a constant
_FLA_LOCK = threading.Lock()   # one import of fla (or of triton, by _triton_key) at a time: a caller waits for it
_TRITON_KEYED: list[bool] = []  # hash_triton_key_in_background() started

SHIPPED = Path(__file__).with_name("fla_configs")


def gpu_dir_name(device_name: str) -> str:
    """A GPU's name as fla names its config folder (``"NVIDIA H200"`` -> ``"NVIDIA_H200"``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def shipped_dir(device_name: str, root: Path = SHIPPED) -> Path | None:
    """The shipped config folder of the GPU ``device_name``, or None when there is none."""
    d = root / gpu_dir_name(device_name)
    return d if d.is_dir() and any(d.glob("*.json")) else None


def use_shipped_configs(root: Path = SHIPPED) -> Path | None:
    """Before fla is imported, on CUDA: ``FLA_CONFIG_DIR`` = this GPU's shipped folder and ``FLA_CACHE_MODE=strict``
    (exact keys only). Nothing when the user set either variable, fla's cache module is already imported (it reads
    the mode once), CUDA is absent or nothing is shipped for this GPU. Returns the folder in use, or None."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ or "fla.ops.utils.cache" in sys.modules:
        return None
    if not torch.cuda.is_available():
        return None
    d = shipped_dir(torch.cuda.get_device_name(0), root)
    if d is not None:
        os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(d), "strict"
    return d


def persist_autotuning() -> None:
    """Before fla is imported: ``TRITON_CACHE_AUTOTUNING=1`` unless the user set it (autotuning results stay in
    Triton's disk cache) and fla pointed at the shipped configs (``use_shipped_configs``)."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    use_shipped_configs()


def import_leaf(package: str, leaf: str):
    """Import module ``leaf`` of ``package`` with ``package/__init__.py`` deferred (fla's imports every op family,
    ~240 modules and 2-4 s; docs/performance.md): the first attribute the package lacks runs that ``__init__`` in
    place (PEP 562 ``__getattr__``), so other users see it whole. A plain import when ``package`` is imported."""
    if package in sys.modules:
        return importlib.import_module(leaf)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return importlib.import_module(leaf)
    holder = importlib.util.module_from_spec(spec)

    def complete(attr: str):
        del holder.__dict__["__getattr__"]
        spec.loader.exec_module(holder)                   # the deferred __init__, into the same module object
        return holder.__dict__[attr] if attr in holder.__dict__ else getattr(holder, attr)

    holder.__getattr__ = complete
    sys.modules[package] = holder
    parent, _, name = package.rpartition(".")
    if parent:
        setattr(sys.modules[parent], name, holder)
    return importlib.import_module(leaf)


_PLAIN_AUTOTUNED = "fla.ops.common.chunk_h"   # the GLA chunk's state kernels, decorated with plain triton.autotune


@contextlib.contextmanager
def fla_configs_for_every_kernel():
    """While fla's kernel modules import, ``triton.autotune`` is fla's config-reading autotuner, so the chunk's
    plainly ``triton.autotune``'d state kernels (``fla/ops/common/chunk_h.py``) read the shipped configs too (else
    ~45 s of timing in the 1.5b's cold first prefill on an H200; docs/performance.md). Nothing when no config folder
    is set (``FLA_CONFIG_DIR``) or those kernels are already defined."""
    if not os.environ.get("FLA_CONFIG_DIR") or _PLAIN_AUTOTUNED in sys.modules:
        yield
        return
    try:
        cache = import_leaf("fla.ops", "fla.ops.utils.cache")
    except Exception:  # fla absent, or triton failing without a driver: the import that follows says so
        cache = None
    if cache is None or _PLAIN_AUTOTUNED in sys.modules or not hasattr(cache, "configure_fla_cache_autotune"):
        yield
        return
    cache.configure_fla_cache_autotune()
    try:
        yield
    finally:
        cache.restore_autotune_backend()


@contextlib.contextmanager
def fla_without_dynamo():
    """While fla's modules import, ``torch.compiler.disable`` of an ``fla.`` function defers fla's own: fla-core
    0.6.0 wraps its entry points at import, and that wrapper imports ``torch._dynamo`` (1-2 s, most of fla's import;
    docs/performance.md). Until something else imports ``torch._dynamo`` nothing can trace, so the function runs
    itself; after, fla's wrapper (built on first call). Our calls into fla sit in custom ops, which nothing traces."""
    real = torch.compiler.disable

    def disable(fn=None, recursive=True, *, reason=None):
        if fn is None or "torch._dynamo" in sys.modules or not str(getattr(fn, "__module__", None)).startswith("fla."):
            return real(fn, recursive, reason=reason)
        wrapped = functools.cache(lambda: real(fn, recursive, reason=reason))
        return functools.wraps(fn)(lambda *a, **k: (fn if "torch._dynamo" not in sys.modules else wrapped())(*a, **k))

    torch.compiler.disable = disable
    try:
        yield
    finally:
        torch.compiler.disable = real


def import_fla_chunk():
    """``fla.ops.gla.chunk``, imported the package's one way (``persist_autotuning``, ``import_leaf``,
    ``fla_configs_for_every_kernel``, ``fla_without_dynamo``). Raises what the import raises."""
    persist_autotuning()
    if (chunk := sys.modules.get("fla.ops.gla.chunk")) is not None:
        return chunk
    with fla_without_dynamo(), fla_configs_for_every_kernel():
        return import_leaf("fla.ops", "fla.ops.gla.chunk")


def fla_available() -> bool:
    """True when fla-core's GLA kernels (``fla.ops.gla.chunk``, with triton) import (checked once per process)."""
    if not _FLA_OK:
        with _FLA_LOCK:
            if not _FLA_OK:
                try:
                    import_fla_chunk()
                    _FLA_OK.append(True)
                except Exception:  # ImportError, or triton failing to initialise without a driver
                    _FLA_OK.append(False)
    return _FLA_OK[0]


def import_fla_in_background() -> None:
    """Import fla on a daemon thread while a CUDA model that scans with it loads, so the import overlaps the load
    (the first prefill's ``fla_available()`` waits for the rest); nothing when another backend is chosen, the check
    already ran or fla is not installed."""
    if _FLA_OK or _FLA_LOCK.locked() or os.environ.get(ENV_VAR, "").strip().lower() not in ("", "auto", "fla") \
            or importlib.util.find_spec("fla") is None:
        return
    threading.Thread(target=fla_available, name="elastic-ssm-import-fla", daemon=True).start()


@contextlib.contextmanager
def _compiles_wait_for(thread: threading.Thread, triton):
    """While the block runs, Triton's ``jit_cache_hook`` (called before each compile) makes a compile on another
    thread wait for ``thread``'s key: ``triton_key`` is an ``lru_cache``, so a second caller would hash it again."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    prev = getattr(rt, "jit_cache_hook", None)

    def hook(**kw):
        if threading.current_thread() is not thread:
            thread.join(30)
        return prev(**kw) if prev else None

    if rt is not None:
        rt.jit_cache_hook = hook
    try:
        yield
    finally:
        if rt is not None and rt.jit_cache_hook is hook:
            rt.jit_cache_hook = prev


def _triton_key(fla: bool) -> None:
    triton = None   # suppress: another Triton's layout (its first compile hashes the key); the lock: fla's import
    with contextlib.suppress(Exception), _FLA_LOCK:   # never beside this import of triton, the package whole first
        triton = importlib.import_module("triton")
    if fla:
        import_fla_in_background()         # triton is in: the rest of fla's import runs beside the hash
    if triton is not None:
        with _compiles_wait_for(threading.current_thread(), triton), contextlib.suppress(Exception):
            triton.runtime.cache.triton_key()


def hash_triton_key_in_background(fla: bool = False) -> None:
    """Once per process, on a daemon thread while a CUDA model loads: import triton, start fla's import (``fla``), then
    hash Triton's compile-cache key (sha256 of its ~400 MB library, 0.25-0.4 s; GIL-free) while compiles wait."""
    if _TRITON_KEYED or importlib.util.find_spec("triton") is None:
        return import_fla_in_background() if fla else None
    _TRITON_KEYED.append(True)
    threading.Thread(target=_triton_key, args=(fla,), name="elastic-ssm-triton-key", daemon=True).start()


def prepare_compile() -> None:
    """Run the fla check eagerly (on machines with CUDA) before ``torch.compile`` traces a scan: compiled code
    then reads the memo as a constant and tracing imports nothing."""
    if torch.cuda.is_available():
        fla_available()


def available_backends() -> list[str]:
    """Scan backends usable in this process: always "naive" and "torch"; "fla" when fla and CUDA work."""
    return ["naive", "torch", *(["fla"] if torch.cuda.is_available() and fla_available() else [])]


def resolve_backend(backend: str = "auto", tensor: torch.Tensor | None = None) -> str:
    """Resolve ``backend`` for inputs like ``tensor``: ``"torch"``, ``"fla"`` or ``"naive"``. ``"auto"`` is
    ``ELASTIC_SSM_SCAN_BACKEND`` (its ``"fla"`` means ``"torch"`` for non-CUDA tensors), else ``"fla"`` for CUDA
    tensors of a dtype fla takes when fla imports, else ``"torch"``. ValueError for an unknown name or ``"fla"``
    off CUDA, ImportError for ``"fla"`` without fla-core; logged once per (backend, device type)."""
    choice = backend
    if not isinstance(choice, str):
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = tensor.device.type if tensor is not None else "cpu"
    if choice.lower() == "auto":
        choice = os.environ.get(ENV_VAR, "").strip() or "auto"
        if choice.lower() == "fla" and device != "cuda":
            choice = "auto"  # the environment asks for the GPU path; CPU calls in the same process use torch
    choice = choice.lower()
    if choice not in BACKENDS:
        source = f"environment variable {ENV_VAR}" if backend.lower() == "auto" else "backend argument"
        raise ValueError(f"unknown spectral-scan backend {choice!r} from the {source}; expected one of {BACKENDS}")
    if choice == "auto":
        fla_ok = device == "cuda" and tensor.dtype in _FLA_DTYPES and fla_available()
        choice = "fla" if fla_ok else "torch"
    elif choice == "fla":
        if device != "cuda":
            raise ValueError(f"backend 'fla' runs on CUDA tensors only, got device {device!r}; "
                             "use backend='torch' (or 'auto') on this device")
        if not fla_available():
            raise ImportError("backend 'fla' needs fla-core with triton: pip install 'elastic-ssm[gpu]' "
                              "(or fla-core), or use backend='torch'")
        if tensor.dtype not in _FLA_DTYPES:
            raise ValueError(f"backend 'fla' supports {_FLA_DTYPES}, got {tensor.dtype}; use backend='torch'")
    if torch.compiler.is_compiling():
        return choice  # no logging inside a traced graph (the eager prologue of ESSH announces it)
    key = (choice, device)
    if key not in _announced:
        _announced.add(key)
        _logger.info("spectral_scan backend: %s on %s", choice, device)
    return choice


def triton_available() -> bool:
    """True when the ``triton`` package imports (it is an optional extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (Triton kernels run on CPU tensors, as in the CPU test suite)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``lo`` (a Triton block size)."""
    return max(lo, 1 << (int(n) - 1).bit_length())


def resolve_decode_backend(backend: str, device: torch.device | str) -> str:
    """Backend of the decode kernels: "auto" -> "triton" on CUDA with triton installed (or under
    ``TRITON_INTERPRET=1``), else "torch"; "triton" without triton raises with the fix."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"decode backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        ok = triton_available() and (torch.device(device).type == "cuda" or triton_interpreting())
        return "triton" if ok else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("decode backend 'triton' needs the triton package: pip install 'elastic-ssm[gpu]'")
    return backend
