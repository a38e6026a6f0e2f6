"""``benchmarks/serve_prefill.py`` (the serve suite's ``prefill-burst`` entry) on the CPU: a row per pool and path,
each with one time per repeat, a profile table per pool, and a one-line refusal of CUDA where there is none."""

import json

import pytest
import torch

from benchmarks.serve_prefill import PrefillProbeOptions, main, run


def test_the_probe_times_each_pool_both_ways_and_writes_a_profile_per_pool(tmp_path, capsys):
    opts = PrefillProbeOptions(device="cpu", preset="tiny", rows=5, prompt=6, chunk=2, repeats=2, out=str(tmp_path))
    rows = run(opts)
    assert [(r["pool"], r["path"]) for r in rows] == [
        ("T10", "eager 5 x 6"), ("T10", "graphed 3 x (2 x 6)"),
        ("T1,T4,T10", "eager 5 x 6"), ("T1,T4,T10", "graphed 3 x (2 x 6)")]
    assert all(len(r["ms"]) == 2 and all(t > 0 for t in r["ms"]) for r in rows)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")] == rows
    for name in ("prefill_T10.txt", "prefill_T1_T4_T10.txt"):
        assert "aten::" in (tmp_path / name).read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_the_probe_says_so_in_one_line():
    with pytest.raises(SystemExit, match="no CUDA device here; pass --device cpu"):
        main(["--preset", "tiny"])
