"""The replication kinds (issue 16): a step skips, waits, defers, stops at the budget with SIGTERM; the state
travels between calls in parts and comes back only when newer; every skip path is a file the suite makes. The
reports and claims: ``test_replication_claims.py``."""

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks.replication.state import ReplicationStateOptions, pack_records, pack_state, restore_state, run_state
from benchmarks.replication.steps import ReplicationStepOptions, run_step, wait_concurrent
from benchmarks.suite import EntryContext
from elastic_ssm.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _ctx(tmp_path, name="step", budget=None):
    deadline = None if budget is None else time.monotonic() + budget
    return EntryContext(name=name, out_dir=tmp_path / "bench" / name, log=lambda s: None, deadline=deadline)


def _step(tmp_path, code, **kw):
    return ReplicationStepOptions(args=("python", "-c", code), run="r", root=str(tmp_path / "state"), **kw)


def test_step_runs_records_and_then_skips(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    code = ("import os, pathlib, sys; pathlib.Path(sys.argv[1]).write_text('x'); "
            "print('made it', os.environ['TRITON_CACHE_DIR'])")
    opts = ReplicationStepOptions(args=("python", "-c", code, "{run}/out.txt"), run="r", root=str(tmp_path / "state"),
                                  outputs=("{run}/out.txt",))
    row = run_step(opts, _ctx(tmp_path))[0]
    assert row["state"] == "ran" and row["rc"] == 0 and row["fresh"] is True
    run = tmp_path / "state" / "r"
    assert f"made it {(tmp_path / 'state' / '.triton').resolve()}" in (run / "logs" / "step.log").read_text()
    calls = [json.loads(x) for x in (run / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["commit"] and calls[0]["device"]
    assert run_step(opts, _ctx(tmp_path))[0]["state"] == "skipped"          # its output exists now
    assert len((run / "calls.jsonl").read_text().splitlines()) == 1
    (run / "out.txt").unlink()                       # outputs that did not travel to the next machine:
    assert run_step(opts, _ctx(tmp_path))[0]["state"] == "ran"              # run again, unless `once`
    once = ReplicationStepOptions(**{**opts.to_dict(), "once": True})
    (run / "out.txt").unlink()
    assert run_step(once, _ctx(tmp_path))[0]["state"] == "skipped"
    with open(run / "calls.jsonl", "a") as f:
        f.write("not json\n")                                              # a torn line is read past
    assert run_step(once, _ctx(tmp_path))[0]["state"] == "skipped"
    other = ReplicationStepOptions(**{**once.to_dict(), "run": "r2"})
    assert run_step(other, _ctx(tmp_path))[0]["state"] == "ran"             # another run's record does not count


def test_step_waits_defers_and_reports_failures(tmp_path):
    assert run_step(_step(tmp_path, "pass", requires=("{run}/final",)), _ctx(tmp_path))[0]["state"] == "waiting"
    row = run_step(_step(tmp_path, "pass", needs_s=300, reserve_s=0), _ctx(tmp_path, budget=100))[0]
    assert row["state"] == "deferred"
    assert run_step(_step(tmp_path, "raise SystemExit(3)"), _ctx(tmp_path))[0]["state"] == "failed rc=3"
    done = _step(tmp_path, "pass", outputs=("{run}/missing",), skip_when=("{root}",))
    assert run_step(done, _ctx(tmp_path))[0]["state"] == "skipped"           # everything downstream is done
    assert run_step(_step(tmp_path, "pass", outputs=("{run}/never",)), _ctx(tmp_path))[0]["state"] == "incomplete"


def test_a_run_cut_before_starts_over_only_with_more_time_than_it_had(tmp_path):
    """essm-full of 2026-12-01: a fresh attempt stopped after 251 s whose 0.5 GB checkpoint did not travel is
    not started again with less than 251 s + grace left, whatever its needs_s says; with its checkpoint (it
    resumes) the needs_s alone decides."""
    run = tmp_path / "state" / "r"
    run.mkdir(parents=True)
    (run / "calls.jsonl").write_text(json.dumps({"run": "r", "step": "step", "state": "stopped", "rc": 143,
                                                 "wall_s": 90.0, "fresh": True, "checkpoint": True}) + "\n")
    opts = _step(tmp_path, "pass", needs_s=10, reserve_s=0, grace_s=5)
    logs = []
    ctx = EntryContext(name="step", out_dir=tmp_path / "bench", log=logs.append, deadline=time.monotonic() + 80)
    assert run_step(opts, ctx)[0]["state"] == "deferred"
    assert "a fresh attempt was stopped after 90 s" in logs[-1] and "needs 95 s" in logs[-1]
    assert run_step(opts, _ctx(tmp_path, budget=120))[0]["state"] == "ran"
    spans = ReplicationStepOptions(**{**opts.to_dict(), "spans_calls": True})   # replication-long: each call is cut
    assert run_step(spans, _ctx(tmp_path, budget=80))[0]["state"] == "ran"      # by design, the next one resumes
    (run / "pretrain" / "step_0000002").mkdir(parents=True)         # a checkpoint here: it resumes
    (run / "pretrain" / "step_0000002" / "COMPLETE.json").write_text("{}")
    assert run_step(opts, _ctx(tmp_path, budget=80))[0]["state"] == "ran"
    resumed = ReplicationStepOptions(**{**spans.to_dict(), "needs_s": 400})   # dense-long-s0 at step 2419 of 2600
    assert run_step(resumed, _ctx(tmp_path, budget=60))[0]["state"] == "ran"    # was deferred with 330 s left
    assert run_step(resumed, _ctx(tmp_path, budget=20))[0]["state"] == "deferred"   # < grace_s + 30 s


def test_step_gets_sigterm_before_the_budget_ends(tmp_path):
    code = ("import signal, sys, time, pathlib\n"
            "def stop(*a):\n    pathlib.Path(sys.argv[1]).write_text('checkpoint'); sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)\n")
    opts = ReplicationStepOptions(args=("python", "-c", code, "{run}/ckpt"), run="r", root=str(tmp_path / "state"),
                                  outputs=("{run}/final",), grace_s=5, reserve_s=0)
    t = time.monotonic()
    row = run_step(opts, _ctx(tmp_path, budget=8))[0]
    assert row["state"] == "stopped" and row["rc"] == 143 and time.monotonic() - t < 30
    assert (tmp_path / "state" / "r" / "ckpt").read_text() == "checkpoint"


def _fake_run(root, name, final=True, ckpt_bytes=1000):
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "stage": "pretrain", "step": 1}\n')
    (run / "logs" / "t.log").write_text("log\n")
    (run / ".lock").write_text("pid")
    step = run / "pretrain" / "step_0000002"
    step.mkdir(parents=True)
    (step / "optimizer.pt").write_bytes(b"\0" * ckpt_bytes)
    (step / "COMPLETE.json").write_text("{}")
    (run / "pretrain" / "latest").write_text("step_0000002")
    if final:
        (run / "final").mkdir()
        (run / "final" / "model.safetensors").write_bytes(b"\0" * 5000)
    return run


def test_pack_leaves_weights_out_and_restores_only_newer_state(tmp_path):
    root, out = tmp_path / "state", tmp_path / "out"
    _fake_run(root, "done")
    _fake_run(root, "partial", final=False, ckpt_bytes=3 * 2**20)
    _fake_run(root, "big", final=False, ckpt_bytes=6 * 2**20)
    tuned = root / ".triton" / "ab12" / "chunk_gla_fwd_kernel_o.autotune.json"
    tuned.parent.mkdir(parents=True)
    tuned.write_text('{"key": [32, 64], "configs_timings": []}')
    (tuned.parent / "chunk_gla_fwd_kernel_o.cubin").write_bytes(b"\0" * 4096)   # compiled kernels stay behind
    meta = pack_state(root, out, max_mib=5, part_mib=0.001)                   # room for one checkpoint
    assert meta["checkpoints"] == ["partial/pretrain/step_0000002"] and len(meta["parts"]) > 1
    assert all((out / p["name"]).stat().st_size <= 0.001 * 2**20 + 1 for p in meta["parts"])
    fresh = tmp_path / "fresh"
    assert "restored generation 1" in restore_state(out, fresh)
    got = {str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()}
    assert "done/metrics.jsonl" in got and "partial/pretrain/step_0000002/optimizer.pt" in got
    assert ".triton/ab12/chunk_gla_fwd_kernel_o.autotune.json" in got and not any(g.endswith(".cubin") for g in got)
    assert not any("final" in g or g.startswith("big/pretrain/step") or g.endswith((".lock", "latest")) for g in got)
    assert "kept the machine's state" in restore_state(out, fresh)          # same generation: nothing replaced
    (fresh / "done" / "new.txt").write_text("newer")
    assert pack_state(fresh, out)["generation"] == 2
    older = tmp_path / "older"
    restore_state(out, older)
    assert (older / "done" / "new.txt").read_text() == "newer"
    part = out / json.loads((out / "replication-state.json").read_text())["parts"][0]["name"]
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="missing or differs"):
        restore_state(out, tmp_path / "third")
    assert restore_state(tmp_path / "nothing", tmp_path / "x").startswith("nothing carried")


def test_committed_records_bring_a_finished_run_back_when_the_carried_state_is_lost(tmp_path):
    """``pack`` also writes the runs' records (text the reports read, no weights or checkpoints); unpacked into the
    repository and named by ``restore``'s ``records``, they seed a machine that got no carried state, so a
    finished run's steps are skipped instead of trained again; a file the carried state holds is never
    replaced."""
    import tarfile

    root, out = tmp_path / "state", tmp_path / "out"
    run = _fake_run(root, "done")
    (run / "eval.csv").write_text("tier,bpb\nT10,2.0\n")
    _fake_run(root, "partial", final=False)
    tuned = root / ".triton" / "abc123" / "chunk_gla_fwd_kernel_o.autotune.json"     # the steps' Triton cache
    tuned.parent.mkdir(parents=True)
    tuned.write_text('{"configs_timings": []}')
    (tuned.parent / "chunk_gla_fwd_kernel_o.cubin").write_bytes(b"binary")         # compiled: not a record
    meta = pack_records(root, out)
    with tarfile.open(out / "replication-records.tgz") as tar:
        names = sorted(tar.getnames())
    assert names == [".triton/abc123/chunk_gla_fwd_kernel_o.autotune.json", "done/eval.csv", "done/logs/t.log",
                     "done/metrics.jsonl", "partial/logs/t.log", "partial/metrics.jsonl"] and meta["files"] == 6
    records = tmp_path / "repo" / "records"
    records.mkdir(parents=True)
    with tarfile.open(out / "replication-records.tgz") as tar:
        tar.extractall(records, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    lost = tmp_path / "lost"                                          # a new machine, nothing carried
    (lost / "partial").mkdir(parents=True)
    (lost / "partial" / "metrics.jsonl").write_text("newer\n")
    opts = ReplicationStateOptions(action="restore", root=str(lost), carry=str(tmp_path / "no-carry"),
                                   records=str(records))
    [row] = run_state(opts, _ctx(tmp_path, "restore"))
    assert "records of done, partial added" in row["result"]
    assert (lost / "done" / "eval.csv").read_text() == "tier,bpb\nT10,2.0\n"
    assert (lost / "partial" / "metrics.jsonl").read_text() == "newer\n"       # never replaced
    assert (lost / ".triton" / "abc123" / "chunk_gla_fwd_kernel_o.autotune.json").is_file()   # autotuning back
    step = ReplicationStepOptions(args=("python", "-c", "raise SystemExit(3)"), run="done", root=str(lost),
                                  outputs=("{run}/final",), skip_when=("{run}/eval.csv",))
    assert run_step(step, _ctx(tmp_path, "done-train"))[0]["state"] == "skipped"
    packed = run_state(ReplicationStateOptions(action="pack", root=str(lost), dest=str(tmp_path / "out2")),
                       _ctx(tmp_path, "pack"))
    assert packed[0]["generation"] == 1 and (tmp_path / "out2" / "replication-records.tgz").is_file()


def test_pack_keeps_the_most_recently_written_checkpoints_when_not_all_fit(tmp_path):
    """An old probe's checkpoint (calib-mqar, cut at step 88) must not push out the checkpoint of the run the call
    just advanced, although its name sorts first; what stays behind is listed."""
    root = tmp_path / "state"
    old = _fake_run(root, "calib-mqar", final=False, ckpt_bytes=3 * 2**20)
    _fake_run(root, "mqar-hybrid", final=False, ckpt_bytes=3 * 2**20)
    stamp = (old / "pretrain" / "step_0000002" / "COMPLETE.json")
    os.utime(stamp, (stamp.stat().st_atime - 3600, stamp.stat().st_mtime - 3600))
    meta = pack_state(root, tmp_path / "out", max_mib=5)
    assert meta["checkpoints"] == ["mqar-hybrid/pretrain/step_0000002"]
    assert meta["checkpoints_left_out"] == ["calib-mqar/pretrain/step_0000002"]


def test_concurrent_steps_run_together_and_pack_waits_for_them(tmp_path):
    """Claim 3's two MQAR arms share one GPU: each concurrent step starts and the suite goes on at once; both
    commands run at the same time (each waits to see the other's file), and the pack entry waits for both before
    it packs, so their checkpoints and calls are in the state. A concurrent step near the budget still gets its
    SIGTERM."""
    code = ("import pathlib, sys, time\n"
            "me, other = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
            "me.parent.mkdir(parents=True, exist_ok=True); me.write_text('up')\n"
            "t = time.monotonic()\n"
            "while not other.exists():\n"
            "    time.sleep(0.05)\n"
            "    if time.monotonic() - t > 20: sys.exit(7)\n"
            "time.sleep(1); (me.parent / 'final').mkdir()\n")
    state = tmp_path / "state"

    def arm(run, other):
        return ReplicationStepOptions(args=("python", "-c", code, "{run}/up", f"{{root}}/{other}/up"), run=run,
                                      root=str(state), outputs=("{run}/final",), concurrent=True)

    rows = [run_step(arm("a", "b"), _ctx(tmp_path, "a-train"))[0],
            run_step(arm("b", "a"), _ctx(tmp_path, "b-train"))[0]]
    assert [r["state"] for r in rows] == ["started", "started"]
    logs = []
    ctx = EntryContext(name="pack", out_dir=tmp_path / "bench" / "pack", log=logs.append)
    run_state(ReplicationStateOptions(action="pack", root=str(state), dest=str(tmp_path / "out")), ctx)
    assert [r["state"] for r in rows] == ["ran", "ran"] and all(r["rc"] == 0 for r in rows)   # updated in place
    for run in ("a", "b"):
        calls = [json.loads(x) for x in (state / run / "calls.jsonl").read_text().splitlines()]
        assert [c["state"] for c in calls] == ["ran"]
    assert wait_concurrent() == 0                                  # nothing left running
    slow = ReplicationStepOptions(args=("python", "-c", "import time; time.sleep(60)"), run="c", root=str(state),
                                  concurrent=True, grace_s=2, reserve_s=0)
    t = time.monotonic()
    row = run_step(slow, _ctx(tmp_path, "c-train", budget=4))[0]
    assert row["state"] == "started" and wait_concurrent() == 1 and time.monotonic() - t < 15
    assert row["state"] == "stopped"
    broken = ReplicationStepOptions(args=(str(tmp_path / "no-such-program"),), run="d", root=str(state),
                                    concurrent=True)
    row = run_step(broken, _ctx(tmp_path, "d-train"))[0]
    assert wait_concurrent() == 1 and row["state"].startswith("error: FileNotFoundError")   # in the row, not lost


def test_a_step_needing_a_concurrent_steps_output_waits_for_that_step_only(tmp_path):
    """An evaluation whose input a concurrent training step is still making waits for that step (not "waiting"
    for a later call, as on 2026-12-02 when --bench.only put spec-t4-s1-eval before the pair ended); a concurrent
    step making other outputs keeps running."""
    state = tmp_path / "state"
    make = ("import pathlib, sys, time; time.sleep(float(sys.argv[2])); "
            "pathlib.Path(sys.argv[1]).mkdir(parents=True)")
    fast = ReplicationStepOptions(args=("python", "-c", make, "{run}/final", "1.5"), run="a", root=str(state),
                                  outputs=("{run}/final",), concurrent=True)
    slow = ReplicationStepOptions(args=("python", "-c", make, "{run}/final", "8"), run="b", root=str(state),
                                  outputs=("{run}/final",), concurrent=True)
    assert run_step(fast, _ctx(tmp_path, "a-train"))[0]["state"] == "started"
    b = run_step(slow, _ctx(tmp_path, "b-train"))[0]
    evaluate = ReplicationStepOptions(args=("python", "-c", "print('eval')"), run="a", root=str(state),
                                      requires=("{run}/final",))
    t = time.monotonic()
    row = run_step(evaluate, _ctx(tmp_path, "a-eval"))[0]
    assert row["state"] == "ran" and (state / "a" / "final").is_dir() and time.monotonic() - t < 6
    assert b["state"] == "started"                                # the other pair member is still running
    assert wait_concurrent() == 1 and b["state"] == "ran"
    lone = ReplicationStepOptions(args=("python", "-c", "print('eval')"), run="c", root=str(state),
                                  requires=("{run}/final",))
    assert run_step(lone, _ctx(tmp_path, "c-eval"))[0]["state"] == "waiting"   # nothing makes it: a later call


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "bench").glob("replication-*.yaml")), ids=lambda p: p.stem)
def test_every_skip_path_is_a_file_the_suite_makes(path):
    """A step's ``skip_when`` names what later steps produce; a name no step makes (``importance-essh/eval.csv`` of
    2026-12-04, where importance writes ``channel_importance.json``) never matches, and the model trains again for
    nothing. Besides the outputs of the suite's steps, only ``parameters.json``, which ``elastic-ssm train`` writes
    when a run has finished (pipeline.py), may be named."""
    from benchmarks.suite import load_suite

    steps = [e.options for e in load_suite(path).entries if e.kind == "replication_step"]
    made = {out.replace("{run}", f"{{root}}/{o.run}") for o in steps for out in o.outputs}
    wrong = [(o.run, p) for o in steps for p in o.skip_when
             if p.replace("{run}", f"{{root}}/{o.run}") not in made and p != "{run}/parameters.json"]
    assert not wrong, wrong
