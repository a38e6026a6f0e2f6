"""On the GPU with fla: a fresh process that imports fla through elastic_ssm reads the configs shipped for this GPU
(``ops/dispatch.py``): fla's mode is strict, its folder ours, and fla's own lookup returns each shipped entry
(so ``benchmarks.fla_configs.entry_hash`` agrees with fla's ``AutotuneKey.key_hash``), the chunk's plainly autotuned
state kernels too."""

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_ssm.ops import dispatch as tc

pytestmark = pytest.mark.gpu

PROBE = r"""
import json, sys
from elastic_ssm.ops.dispatch import fla_available
assert fla_available(), "fla does not import"
import fla.ops.utils.cache as c
entries = []
for path in sorted(__import__("pathlib").Path(sys.argv[1]).glob("*.json")):
    for h, e in json.loads(path.read_text())["autotune_entries"].items():
        key = c.AutotuneKey(tuple(e["autotune_key"]))
        entries.append([path.stem, h == c.AutotuneKey.key_hash(key.autotune_key),
                        c.load_cached_config(path.stem, key) == e["config"]])
import fla.ops.common.chunk_h as ch
tuners = [type(ch.chunk_fwd_kernel_h.fn).__name__, type(ch.chunk_bwd_kernel_dh.fn).__name__]
print(json.dumps({"mode": c.FLA_CACHE_MODE.value, "dir": str(c.get_fla_config_dir()), "entries": entries,
                  "tuners": tuners}))
"""


def test_fla_reads_the_configs_shipped_for_this_gpu():
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA: deselect with -m 'not gpu'")
    d = tc.shipped_dir(torch.cuda.get_device_name(0))
    if d is None:
        pytest.skip(f"no fla configs are shipped for {torch.cuda.get_device_name(0)} (ops/fla_configs/)")
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    p = subprocess.run([sys.executable, "-c", PROBE, str(d)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["mode"] == "strict" and res["dir"] == str(d)
    assert res["tuners"] == ["CachedAutotuner"] * 2, res["tuners"]    # triton.autotune kernels read them too
    assert res["entries"] and all(same_hash and found for _, same_hash, found in res["entries"]), res["entries"]
