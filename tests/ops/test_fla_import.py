"""``ops.dispatch``: fla is imported once per process, and ``import_fla_in_background`` (started by
``from_pretrained(device="cuda")`` for ESSH) overlaps that import with loading; a later ``fla_available()`` waits
for it. A stand-in ``fla`` package on ``sys.path`` counts its imports and takes a while to import."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic_ssm.ops import dispatch


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    pkg = tmp_path / "fla"
    (pkg / "ops" / "gla").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text(          # like fla's: imports every op family (here: counts itself)
        "import builtins\nbuiltins._fake_ops_inits = getattr(builtins, '_fake_ops_inits', 0) + 1\n"
        "from .gla import chunk_gla\nevery_op = 'all'\n")
    (pkg / "ops" / "gla" / "__init__.py").write_text("from .chunk import chunk_gla\n")
    (pkg / "ops" / "gla" / "chunk.py").write_text(
        "import time\nimport builtins\ntime.sleep(0.3)\n"
        "builtins._fake_fla_imports = getattr(builtins, '_fake_fla_imports', 0) + 1\n"
        "def chunk_gla():\n    return 'gla'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(dispatch, "_FLA_OK", [])
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    import builtins
    monkeypatch.setattr(builtins, "_fake_fla_imports", 0, raising=False)
    monkeypatch.setattr(builtins, "_fake_ops_inits", 0, raising=False)
    yield builtins
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]


def _import_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "elastic-ssm-import-fla"]


def test_background_import_runs_once_and_the_check_waits_for_it(fake_fla):
    dispatch.import_fla_in_background()
    threads = _import_threads()
    assert len(threads) == 1
    dispatch.import_fla_in_background()             # a second call while it runs starts nothing
    assert len(_import_threads()) <= 1
    assert dispatch.fla_available() is True         # waits for the thread's import, does not import again
    assert fake_fla._fake_fla_imports == 1
    threads[0].join(5)
    dispatch.import_fla_in_background()             # already checked: nothing
    assert not _import_threads() and fake_fla._fake_fla_imports == 1


def test_no_background_import_when_the_environment_picks_torch(fake_fla, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    dispatch.import_fla_in_background()
    assert not _import_threads() and dispatch._FLA_OK == []


def test_no_background_import_without_fla(monkeypatch):
    monkeypatch.setattr(dispatch, "_FLA_OK", [])
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: None)
    dispatch.import_fla_in_background()
    assert not _import_threads() and dispatch._FLA_OK == []


def test_the_check_imports_only_the_gla_kernels_and_the_package_completes_on_demand(fake_fla):
    """``fla.ops.gla.chunk`` loads without ``fla/ops/__init__.py`` (fla's imports every op family); a later
    ``from fla.ops import <another op>`` runs that ``__init__`` once, in the same module, reusing the loaded kernels."""
    assert dispatch.fla_available() is True
    assert (fake_fla._fake_fla_imports, fake_fla._fake_ops_inits) == (1, 0)
    from fla.ops.gla import chunk  # what the scan imports (ops/spectral_scan/chunk_fla.py)

    assert chunk.chunk_gla() == "gla" and fake_fla._fake_ops_inits == 0
    import fla.ops
    from fla.ops import every_op  # another user of fla: the whole package

    assert every_op == "all" and fake_fla._fake_ops_inits == 1 and fake_fla._fake_fla_imports == 1
    assert fla.ops.chunk_gla is chunk.chunk_gla and sys.modules["fla.ops"] is fla.ops


TESTS = Path(__file__).resolve().parents[1]


def _fresh_process_says_ok(code: str, *paths: Path) -> None:
    """Run ``code`` in a new interpreter with ``paths``, the tests folder and the repository on ``sys.path`` (this
    process may already hold ``torch._dynamo``); it must print ``ok``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*paths, TESTS, TESTS.parent]))}
    env.pop(dispatch.ENV_VAR, None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_fla_import_leaves_torch_dynamo_unimported_and_compile_still_works(tmp_path):
    """fla-core wraps its entry points with ``torch.compiler.disable`` at import, which imports ``torch._dynamo``
    (1-2 s): ``fla_without_dynamo`` defers that wrapper to the first call after something imports dynamo, and
    a compiled caller still runs the function outside its graph. In a fresh process (pytest's may hold dynamo)."""
    pkg = tmp_path / "fla" / "ops" / "gla"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "fla", tmp_path / "fla" / "ops", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "chunk.py").write_text("import torch\n\ndef _entry(x):\n    return x + 1\n\n"
                                  "entry = torch.compiler.disable(_entry)\n")
    code = """if True:
        import sys, torch
        from elastic_ssm.ops import dispatch
        c = dispatch.import_fla_chunk()
        assert "torch._dynamo" not in sys.modules and c.entry(1) == 2
        assert torch.compiler.disable.__module__ == "torch.compiler"      # torch's own again after the import
        f = torch.compile(lambda x: c.entry(x) * 2, backend="eager")
        assert f(torch.ones(2)).tolist() == [4.0, 4.0] and c.entry(2) == 3
        print("ok")
    """
    _fresh_process_says_ok(code, tmp_path)


def test_eager_calls_of_the_gla_ops_import_no_dynamo():
    """The scan's two ops are declared with ``torch.library.Library`` (``torch.library.custom_op`` would import
    ``torch._dynamo`` at their first call): an inference call and a forward under autograd leave it unimported.
    In a fresh process, with the CPU stand-in for fla (tests/fla_stand_in.py)."""
    code = """if True:
        import sys, torch
        import fla_stand_in
        class Patch:
            def setitem(self, d, k, v): d[k] = v
        fla_stand_in.install(Patch())
        from elastic_ssm.ops.spectral_scan import chunk_fla
        q, v, g = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), -torch.rand(1, 8, 2, 16)
        with torch.inference_mode():
            chunk_fla.gla_chunk(q, q, v, g)
        o, _ = chunk_fla.gla_chunk(q.clone().requires_grad_(), q, v, g)
        assert o.requires_grad and "torch._dynamo" not in sys.modules
        print("ok")
    """
    _fresh_process_says_ok(code)


def test_triton_key_is_hashed_once_per_process_on_a_background_thread(monkeypatch):
    """``hash_triton_key_in_background`` (started by ``from_pretrained(device="cuda")``): Triton's per-process
    compile-cache key, which the decoder build's first kernel would otherwise compute, is hashed on its own thread,
    once however often models load."""
    cache = pytest.importorskip("triton.runtime.cache", reason="triton is a dev dependency on linux x86_64 only")
    calls = []
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(threading.current_thread().name))
    monkeypatch.setattr(dispatch, "_TRITON_KEYED", [])
    dispatch.hash_triton_key_in_background()
    dispatch.hash_triton_key_in_background()
    for t in [t for t in threading.enumerate() if t.name == "elastic-ssm-triton-key"]:
        t.join(10)
    assert calls == ["elastic-ssm-triton-key"]


def test_hashing_the_triton_key_beside_another_import_of_triton_breaks_neither(tmp_path):
    """The key's thread imports the ``triton`` package whole before its submodule. Asked first for
    ``triton.runtime.cache`` while another thread (the fla import) still runs ``triton/__init__.py``, it starts
    ``triton.runtime`` against the half-initialised package; the other thread's ``from .runtime import ...`` then
    meets that half-done submodule and its ``import triton`` fails (the scan would silently leave fla). A stand-in
    ``triton`` that imports slowly."""
    pkg = tmp_path / "triton" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text("import time\ntime.sleep(0.5)\nknobs = 1\n"
                                                     "from .runtime import autotune\n")
    (pkg / "__init__.py").write_text("from .. import knobs\nautotune = 'autotune'\nfrom . import cache\n")
    (pkg / "cache.py").write_text("import threading\nkeys = []\n\ndef triton_key():\n"
                                  "    keys.append(threading.current_thread().name)\n")
    code = """if True:
        import threading, time, traceback
        from elastic_ssm.ops import dispatch
        errors = []
        def fla_like():
            try:
                import triton
            except Exception:
                errors.append(traceback.format_exc())
        other = threading.Thread(target=fla_like)
        other.start()
        time.sleep(0.1)                      # the other import holds the package's lock
        dispatch.hash_triton_key_in_background()
        other.join(10)
        [t.join(10) for t in threading.enumerate() if t.name == "elastic-ssm-triton-key"]
        import triton.runtime.cache as cache
        assert not errors, errors
        assert cache.keys == ["elastic-ssm-triton-key"], cache.keys
        print("ok")
    """
    _fresh_process_says_ok(code, tmp_path)


def test_the_triton_key_waits_for_an_import_of_fla_in_progress(tmp_path):
    """fla imports triton too: the key's thread imports it only once fla's import (``dispatch._FLA_LOCK``) is done,
    so the two threads never import triton at the same time. A stand-in ``triton``."""
    pkg = tmp_path / "triton" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text("from . import runtime\n")
    (pkg / "__init__.py").write_text("from . import cache\n")
    (pkg / "cache.py").write_text("keys = []\n\ndef triton_key():\n    keys.append(1)\n")
    code = """if True:
        import sys, threading, time
        from elastic_ssm.ops import dispatch
        with dispatch._FLA_LOCK:             # an import of fla in progress
            dispatch.hash_triton_key_in_background()
            time.sleep(0.3)
            assert "triton" not in sys.modules
        [t.join(10) for t in threading.enumerate() if t.name == "elastic-ssm-triton-key"]
        assert sys.modules["triton.runtime.cache"].keys == [1]
        print("ok")
    """
    _fresh_process_says_ok(code, tmp_path)


def _slow_key_triton(tmp_path: Path) -> None:
    """A stand-in ``triton`` whose key takes 0.5 s, with ``knobs.runtime.jit_cache_hook`` set to a user's hook."""
    pkg = tmp_path / "triton" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text(
        "from . import runtime\nimport types\nseen = []\n"
        "def user_hook(**kw):\n    seen.append(kw['key'])\n    return False\n"
        "knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(jit_cache_hook=user_hook))\n")
    (pkg / "__init__.py").write_text("from . import cache\n")
    (pkg / "cache.py").write_text("import time\nkeys = []\n\ndef triton_key():\n    time.sleep(0.5)\n"
                                  "    keys.append(1)\n")


def test_a_compile_beside_the_key_waits_for_it_and_the_hook_is_put_back(tmp_path):
    """``triton_key`` is an ``lru_cache``: a kernel compiled while the key's thread hashes would hash it again (the
    decoder build's first kernel, 0.25-0.4 s on an H200). While the thread runs, Triton's pre-compile hook makes
    such a compile wait for it and still calls the hook that was there; afterwards that hook is back."""
    _slow_key_triton(tmp_path)
    code = """if True:
        import sys, threading, time
        from elastic_ssm.ops import dispatch
        dispatch.hash_triton_key_in_background()
        deadline = time.time() + 5
        def hook_set():
            knobs = getattr(sys.modules.get("triton"), "knobs", None)   # None while triton still imports
            return knobs is not None and knobs.runtime.jit_cache_hook is not sys.modules["triton"].user_hook
        while time.time() < deadline and not hook_set():
            time.sleep(0.01)
        import triton
        cache = sys.modules["triton.runtime.cache"]
        assert cache.keys == []                               # still hashing
        assert triton.knobs.runtime.jit_cache_hook(key="k1") is False    # what a compile calls first
        assert cache.keys == [1] and triton.seen == ["k1"]    # it waited for the key, then ran the user's hook
        [t.join(10) for t in threading.enumerate() if t.name == "elastic-ssm-triton-key"]
        assert triton.knobs.runtime.jit_cache_hook is triton.user_hook
        print("ok")
    """
    _fresh_process_says_ok(code, tmp_path)


def test_fla_import_starts_once_triton_is_in_and_runs_beside_the_key(tmp_path):
    """``hash_triton_key_in_background(fla=True)`` (``from_pretrained`` of a model that scans with fla): the key's
    thread imports triton first, then starts fla's import, which no longer waits for the hash; when the key was
    started before (or triton is absent), only fla's import starts."""
    _slow_key_triton(tmp_path)
    code = """if True:
        import sys, threading
        from elastic_ssm.ops import dispatch
        started = []
        dispatch.import_fla_in_background = lambda: started.append(
            ("triton" in sys.modules, list(sys.modules["triton.runtime.cache"].keys)))
        dispatch.hash_triton_key_in_background(fla=True)
        [t.join(10) for t in threading.enumerate() if t.name == "elastic-ssm-triton-key"]
        assert started == [(True, [])], started             # after triton's import, before the key's hash ends
        dispatch.hash_triton_key_in_background(fla=True)
        assert started[1:] == [(True, [1])], started
        print("ok")
    """
    _fresh_process_says_ok(code, tmp_path)


def test_the_installed_triton_has_the_pre_compile_hook_the_key_thread_sets():
    """``_compiles_wait_for`` sets ``triton.knobs.runtime.jit_cache_hook`` (Triton 3.4+ calls it before each compile);
    a Triton without it would silently lose the wait, so the pinned one must have it, unset by default."""
    triton = pytest.importorskip("triton", reason="triton is a dev dependency on linux x86_64 only")
    assert hasattr(triton.knobs.runtime, "jit_cache_hook") and triton.knobs.runtime.jit_cache_hook is None
    gate = threading.Event()
    worker = threading.Thread(target=gate.wait, args=(10,))
    worker.start()
    with dispatch._compiles_wait_for(worker, triton):
        hook = triton.knobs.runtime.jit_cache_hook
        threading.Timer(0.2, gate.set).start()
        assert hook(key="k") is None and not worker.is_alive()     # the caller waited for the worker
    assert triton.knobs.runtime.jit_cache_hook is None
