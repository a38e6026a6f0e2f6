"""fla kernel configs built from Triton's autotuning results and merged into the per-GPU folder
(``benchmarks/fla_configs.py``; the package reads them: tests/ops/test_tuned_configs.py)."""

import json
from pathlib import Path

from benchmarks.fla_configs import configs_from_autotuning, entry_hash, write_configs

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "results" / "records" / ".triton"      # H200 autotuning results of the replication runs


def _autotune_file(cache: Path, name: str, kernel: str, key: list, timings: list) -> None:
    d = cache / name
    d.mkdir(parents=True)
    (d / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))


def _cfg(bk: int, warps: int) -> dict:
    return {"kwargs": {"BK": bk}, "num_warps": warps, "num_ctas": 1, "num_stages": 2, "maxnreg": None,
            "pre_hook": None, "ir_override": None}


def test_each_key_keeps_the_config_triton_picked(tmp_path):
    _autotune_file(tmp_path, "A", "k_fwd", [64, False, "torch.float32"], [
        [_cfg(32, 2), [0.05, 0.04, 0.06]], [_cfg(64, 4), [0.03, 0.04, 0.05]], [_cfg(64, 8), [0.03, 0.02, 0.09]]])
    _autotune_file(tmp_path, "B", "k_fwd", [16, False, "torch.bfloat16"], [[_cfg(32, 1), [0.01, 0.01, 0.01]]])
    (tmp_path / "C").mkdir()
    (tmp_path / "C" / "broken.autotune.json").write_text("{not json")
    out = configs_from_autotuning(tmp_path, "3.6.0")
    assert list(out) == ["k_fwd"] and out["k_fwd"]["triton_version"] == "3.6.0"
    entries = out["k_fwd"]["autotune_entries"]
    by_key = {json.dumps(e["autotune_key"]): e["config"] for e in entries.values()}
    # the median (first timing) decides; the tie at 0.03 goes to the next timing, as Triton's min over the lists
    assert by_key['[64, false, "torch.float32"]'] == {k: v for k, v in _cfg(64, 8).items() if k != "pre_hook"}
    assert by_key['[16, false, "torch.bfloat16"]']["kwargs"] == {"BK": 32}
    assert set(entries) == {entry_hash(e["autotune_key"]) for e in entries.values()}
    assert len(set(entries)) == 2


def test_the_recorded_h200_results_convert():
    out = configs_from_autotuning(RECORDED)
    files = list(RECORDED.glob("*/*.autotune.json"))
    assert files and sum(len(c["autotune_entries"]) for c in out.values()) == len(
        {(f.name, json.dumps(json.loads(f.read_text())["key"])) for f in files})
    one = json.loads(files[0].read_text())
    best = min(one["configs_timings"], key=lambda ct: ct[1])[0]
    entry = out[files[0].name[: -len(".autotune.json")]]["autotune_entries"][entry_hash(one["key"])]
    assert entry["config"]["kwargs"] == best["kwargs"] and entry["config"]["num_warps"] == best["num_warps"]


def test_write_configs_merges_entries_into_the_gpu_folder(tmp_path):
    _autotune_file(tmp_path / "c1", "A", "k", [64, "torch.float32"], [[_cfg(32, 2), [0.05, 0.05, 0.05]]])
    _autotune_file(tmp_path / "c2", "A", "k", [16, "torch.float32"], [[_cfg(64, 4), [0.05, 0.05, 0.05]]])
    out = tmp_path / "NVIDIA_H200"
    assert write_configs(tmp_path / "c1", out) == {"k": 1}
    assert write_configs(tmp_path / "c2", out) == {"k": 2}          # the first run's entry stays
    assert len(json.loads((out / "k.json").read_text())["autotune_entries"]) == 2
