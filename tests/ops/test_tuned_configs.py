"""fla kernel configs shipped per GPU (``ops/dispatch.py``): pointed at before fla is imported unless the user
chose otherwise (built by ``benchmarks.fla_configs``: tests/benchmarks/test_fla_configs.py)."""

import sys
from pathlib import Path

import pytest
import torch

from elastic_ssm.ops import dispatch as tc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A CUDA machine named NVIDIA H200 with configs shipped under tmp_path, and no FLA_* variables."""
    for var in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):     # set, then removed: what the test sets is undone after it
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    (tmp_path / "NVIDIA_H200").mkdir()
    (tmp_path / "NVIDIA_H200" / "k.json").write_text("{}")
    return tmp_path


def test_fla_is_pointed_at_this_gpus_configs(gpu, monkeypatch):
    import os

    assert tc.use_shipped_configs(gpu) == gpu / "NVIDIA_H200"
    assert os.environ["FLA_CONFIG_DIR"] == str(gpu / "NVIDIA_H200") and os.environ["FLA_CACHE_MODE"] == "strict"


def test_a_users_choice_or_another_gpu_is_left_alone(gpu, monkeypatch):
    import os

    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert tc.use_shipped_configs(gpu) is None and "FLA_CONFIG_DIR" not in os.environ
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    assert tc.use_shipped_configs(gpu) is None and "FLA_CACHE_MODE" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tc.use_shipped_configs(gpu) is None


def test_the_package_ships_the_h200_configs_as_package_data():
    assert tc.shipped_dir("NVIDIA H200") is not None
    text = (ROOT / "pyproject.toml").read_text()
    assert '"ops/fla_configs/*/*.json"' in text


FAKE_FLA = {   # the shape of fla-core 0.6 that matters here: a costly fla/ops/__init__, the cache module's switch
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "raise RuntimeError('the whole of fla.ops was imported')\n",
    "fla/ops/utils/__init__.py": "",
    "fla/ops/utils/cache.py": ("ON = [False]\n"
                               "def configure_fla_cache_autotune():\n    ON[0] = True\n"
                               "def restore_autotune_backend():\n    ON[0] = False\n"),
    "fla/ops/common/__init__.py": "",
    "fla/ops/common/chunk_h.py": "from fla.ops.utils import cache\nDEFINED_WITH_FLA_AUTOTUNE = cache.ON[0]\n",
    "fla/ops/gla/__init__.py": "",
    "fla/ops/gla/chunk.py": "from fla.ops.common.chunk_h import DEFINED_WITH_FLA_AUTOTUNE\n",
}


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    for rel, text in FAKE_FLA.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]


def test_the_plainly_autotuned_chunk_kernels_are_defined_under_flas_autotuner(fake_fla, monkeypatch):
    from elastic_ssm.ops.dispatch import fla_configs_for_every_kernel, import_leaf

    monkeypatch.setenv("FLA_CONFIG_DIR", "/configs")
    with fla_configs_for_every_kernel():                             # fla.ops/__init__ stays deferred
        chunk_h = import_leaf("fla.ops", "fla.ops.common.chunk_h")
    cache = sys.modules["fla.ops.utils.cache"]
    assert chunk_h.DEFINED_WITH_FLA_AUTOTUNE and not cache.ON[0]     # on while fla imported, Triton's back after
    with fla_configs_for_every_kernel():                             # defined already: nothing to switch
        assert not cache.ON[0]


def test_no_config_folder_or_a_failed_import_leaves_triton_autotune_alone(fake_fla, monkeypatch):
    from elastic_ssm.ops.dispatch import fla_configs_for_every_kernel, import_leaf

    monkeypatch.setenv("FLA_CONFIG_DIR", "")
    with fla_configs_for_every_kernel():
        chunk_h = import_leaf("fla.ops", "fla.ops.common.chunk_h")
    assert not chunk_h.DEFINED_WITH_FLA_AUTOTUNE
    del sys.modules["fla.ops.common.chunk_h"]
    monkeypatch.setenv("FLA_CONFIG_DIR", "/configs")
    with pytest.raises(ImportError), fla_configs_for_every_kernel():
        import fla.ops.common.absent  # noqa: F401
    assert not sys.modules["fla.ops.utils.cache"].ON[0]               # restored when the import inside fails


def test_the_scan_imports_fla_one_way(fake_fla, monkeypatch):
    """``import_fla_chunk`` (``fla_available`` and the scan's custom ops): fla.ops/__init__ deferred, the chunk's
    kernels under fla's autotuner; a second call returns the module already imported."""
    from elastic_ssm.ops.dispatch import import_fla_chunk

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")     # persist_autotuning's setdefault: undone after the test
    monkeypatch.setenv("FLA_CONFIG_DIR", "/configs")
    chunk = import_fla_chunk()
    assert chunk.DEFINED_WITH_FLA_AUTOTUNE and import_fla_chunk() is chunk is sys.modules["fla.ops.gla.chunk"]
