"""``benchmarks/first_token.py``'s child process body on the CPU: its phases, and the cProfile and torch.profiler
files its profiling options write (the GPU numbers: docs/benchmarks.md, "First token")."""

import time

import elastic_ssm as es
from benchmarks.first_token import ChildOptions, _first_token_child


def test_the_child_times_its_phases_and_writes_both_profiles(tmp_path):
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.save_pretrained(tmp_path / "m")
    tier = model.tier_table()[-1].name
    opts = ChildOptions(model=str(tmp_path / "m"), tier=tier, prompt=32, device="cpu",
                        cprofile=str(tmp_path / "profile.txt"), torch_profile=str(tmp_path / "torch_profile.txt"),
                        spawned_at=time.time())
    res = _first_token_child(opts)
    assert all(res[k] >= 0 for k in ("import_s", "load_s", "decoder_s", "prefill_s", "first_token_s"))
    assert isinstance(res["torch_pyc"], bool)
    tables = (tmp_path / "torch_profile.txt").read_text()
    assert "== decoder build" in tables and "== first prefill" in tables and "Self CPU" in tables
    profile = (tmp_path / "profile.txt").read_text()
    assert "Ordered by: cumulative time" in profile and "Ordered by: internal time" in profile


def test_bytecode_check_finds_a_cached_pyc_and_its_absence(tmp_path):
    import py_compile

    from benchmarks.first_token import _has_bytecode

    src = tmp_path / "mod.py"
    src.write_text("x = 1\n")
    assert not _has_bytecode(str(src))
    py_compile.compile(str(src))
    assert _has_bytecode(str(src))
