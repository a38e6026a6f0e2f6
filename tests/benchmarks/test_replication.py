"""The replication kinds (issue 16): a step skips, waits, defers, stops at the budget with SIGTERM; the state
travels between calls in parts and comes back only when newer; a claim's JSON lists what is missing."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.replication.claims import collect_claim, run_summary
from benchmarks.replication.report import ReplicationReportOptions, run_report
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


def test_report_lists_missing_runs_and_judges_smoothness(tmp_path):
    root = tmp_path / "state"
    run = root / "essh"
    run.mkdir(parents=True)
    rows = [("T1", 0.0625, 8, 192, 7e6, 3.0), ("xi=0.3", 0.3, 18, 768, 1.8e7, 2.4), ("T10", 1.0, 32, 2048, 4.1e7, 2.5)]
    (run / "eval.csv").write_text("tier,xi,K,n_ff,params,bpb,loss\n" +
                                  "".join(f"{t},{x},{k},{n},{int(p)},{b},{b * 0.69}\n" for t, x, k, n, p, b in rows))
    (run / "run.yaml").write_text("model: {arch: essh, preset: 40m}\ntrain: {recipe: capacity_mixed, mixing: "
                                  "{capacities: [0.0625, 1.0]}, refine: {capacities: [0.0625]}}\n")
    res = collect_claim(4, root, ["essh", "spec-t1"])
    assert res["missing"] == ["spec-t1"]
    trained = {r["tier"]: r["trained_shape"] for r in res["rows"]}
    assert trained == {"T1": True, "xi=0.3": False, "T10": True}
    assert res["summary"]["monotone"] is False and res["summary"]["largest_rise_between"] == ["xi=0.3", "T10"]
    assert [r["tier"] for r in collect_claim(1, root, ["essh"])["rows"]] == ["T1", "T10"]   # fractions: claim 4
    opts = ReplicationReportOptions(claim=4, root=str(root), runs=("essh",))
    run_report(opts, _ctx(tmp_path, "report"))
    saved = json.loads((root / "results" / "claim4.json").read_text())
    assert saved["summary"]["untrained_points"] == 1
    if "matplotlib" in sys.modules or _has_matplotlib():
        assert (root / "results" / "claim4.png").stat().st_size > 0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_run_rate_is_tokens_over_seconds_when_step_costs_vary(tmp_path):
    """A budget-dropout run: logged steps of 0.5M tok/s (small K) and 0.2M tok/s (full K). The run's rate is its
    tokens over its seconds, not the median of the records (which the calibration of 2026-12-01 took: 5.7 x too
    fast for the ES-SSM); the first record (start-up) is left out."""
    run = tmp_path / "essm-bd"
    run.mkdir()
    rates = [50_000.0, 5e5, 5e5, 5e5, 2e5, 2e5]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "stage": "pretrain", "step": 10 * (i + 1), "tokens": 65536 * 10 * (i + 1),
                    "tokens_per_s": r}) + "\n" for i, r in enumerate(rates)))
    s = run_summary(run)
    seconds = sum(1 / r for r in rates[1:])                  # per token of a step, each record one step
    assert s["tokens_per_s"] == pytest.approx(5 / seconds) and s["tokens_per_s"] == pytest.approx(3.125e5, rel=1e-4)
    assert s["steady_s"] == pytest.approx(65536 * 60 / s["tokens_per_s"])


def test_one_time_warmup_steps_leave_the_steady_rate_and_go_to_startup(tmp_path):
    """The calibration of 2026-12-01: fla autotuned a new shape inside steps 1 and 8 of the ESSH probe (263 s and
    40 s against ~0.4 s), which took its time-weighted rate to 37k tok/s. Such steps (> WARMUP_FACTOR x the median)
    are warm-up: out of the rate, into the start-up; a 2.5 x spread of step costs (capacity mixing) stays in."""
    run = tmp_path / "calib-essh"
    run.mkdir()
    rates = [250.0, 2e5, 1.6e6, 2e5, 2e5, 65536 / 40.0, 8e4, 2e5, 2e5]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "stage": "pretrain", "step": i + 1, "tokens": 65536 * (i + 1),
                    "tokens_per_s": r}) + "\n" for i, r in enumerate(rates)))
    (run / "calls.jsonl").write_text(json.dumps({"step": "calib-essh-train", "fresh": True, "wall_s": 330.0}) + "\n")
    s = run_summary(run)
    steady = [r for i, r in enumerate(rates) if i not in (0, 5)]
    assert s["warmup_steps"] == [1, 6]
    assert s["tokens_per_s"] == pytest.approx(len(steady) / sum(1 / r for r in steady))
    assert s["warmup_s"] == pytest.approx(65536 / 250.0 + 40.0, abs=0.1)
    calib = collect_claim(0, tmp_path, ["calib-essh"])["summary"]["settings"]["calib-essh"]
    assert calib["startup_s"] == pytest.approx(330.0 - 9 * 65536 / s["tokens_per_s"], abs=0.1)
    assert calib["startup_s"] > s["warmup_s"] > 300


def _mqar_run(root, name, validations, steps=20000, model="{arch: essh}"):
    """A recall run folder: run.yaml (model, train.steps) and the validations of its training at the given steps."""
    run = root / name
    run.mkdir(parents=True)
    (run / "run.yaml").write_text(f"model: {model}\ntrain: {{recipe: capacity_mixed, steps: {steps}}}\n")
    lines = [{"kind": "eval", "stage": "pretrain", "step": step, "tier": tier, "K": k, "n_ff": ff, "accuracy": acc}
             for step, acc in validations for tier, k, ff, acc in
             (("T1", 8, 192, acc - 0.02), ("T4", 18, 256, acc - 0.01), ("T10", 32, 512, acc))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_claim3_reads_the_last_validation_and_a_cut_run_stays_missing(tmp_path):
    """MQAR runs span many device calls: each call's report shows the last validation's accuracy with its step,
    and a run counts as done only once it has validated at its last step."""
    _mqar_run(tmp_path, "mqar-hybrid", [(1000, 0.30), (2000, 0.95)], steps=2000)
    _mqar_run(tmp_path, "mqar-mixer", [(1000, 0.02), (5000, 0.03)],
              model=yaml.safe_load((REPO / "configs/replication/mqar-mixer.yaml").read_text())["model"])
    res = collect_claim(3, tmp_path, ["mqar-hybrid", "mqar-mixer"])
    # a cut run has no parameters.json yet: its counts come from run.yaml's model (Table 21: 1.25 / 1.53 / 2.04M)
    assert [round(r["params"] / 1e6, 2) for r in res["rows"] if r["run"] == "mqar-mixer"] == [1.25, 1.53, 2.04]
    assert res["missing"] == ["mqar-mixer"]
    rows = {(r["run"], r["tier"]): r for r in res["rows"]}
    assert rows["mqar-hybrid", "T10"]["accuracy"] == pytest.approx(0.95) and rows["mqar-hybrid", "T1"]["step"] == 2000
    assert rows["mqar-mixer", "T4"]["accuracy"] == pytest.approx(0.02) and rows["mqar-mixer", "T4"]["step"] == 5000
    assert res["summary"]["progress"] == {"mqar-hybrid": {"validated_at": 2000, "of_steps": 2000},
                                          "mqar-mixer": {"validated_at": 5000, "of_steps": 20000}}


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


def test_claim5_sets_each_specialist_beside_the_shared_tier_of_its_size(tmp_path):
    """Claim 5 matches a specialist to the shared run's tier by parameter count (the dense control's full model is
    the T10 specialist), sums the specialists' training seconds and divides by the shared run's."""
    root = tmp_path / "state"

    def run(name, rows, wall):
        d = root / name
        d.mkdir(parents=True)
        (d / "eval.csv").write_text("tier,xi,K,n_ff,params,bpb,loss\n" +
                                    "".join(f"{t},{x},8,64,{p},{b},0.5\n" for t, x, p, b in rows))
        (d / "calls.jsonl").write_text(json.dumps({"run": name, "step": f"{name}-train", "wall_s": wall,
                                                   "fresh": True}) + "\n")

    run("essh", [("T1", 0.0625, 700, 1.4), ("T4", 0.3125, 1800, 1.2), ("T10", 1.0, 4100, 1.1)], 300.0)
    run("dense", [("T1", 0.0625, 700, 4.9), ("T10", 1.0, 4100, 1.15)], 200.0)
    run("dense-rec", [("T1", 0.0625, 700, 2.9), ("T10", 1.0, 4100, 1.16)], 50.0)
    run("spec-t1", [("T1", 1.0, 700, 1.25)], 100.0)
    res = collect_claim(5, root, ["essh", "dense", "dense-rec", "spec-t1", "spec-t4"])
    summary = res["summary"]
    assert res["missing"] == ["spec-t4"]
    assert summary["specialists_wall_s"] is None               # spec-t4 has not run: no sum is guessed
    assert [(s["tier"], s["specialist"], s["specialist_bpb"], s["shared_bpb"], s["recovered_bpb"])
            for s in summary["at_sizes"]] == [("T1", "spec-t1", 1.25, 1.4, 2.9), ("T10", "dense", 1.15, 1.1, 1.16)]
    run("spec-t4", [("T1", 1.0, 1800, 1.15)], 150.0)
    run("transformer", [("T1", 1.0, 4110, 1.5)], 90.0)       # one size, not a specialist of a tier: no sum, no size
    names = ["essh", "dense", "dense-rec", "spec-t1", "spec-t4", "transformer"]
    summary = collect_claim(5, root, names)["summary"]
    assert summary["specialists_wall_s"] == pytest.approx(450.0) and summary["wall_ratio"] == pytest.approx(1.5)
    assert [s["tier"] for s in summary["at_sizes"]] == ["T1", "T4", "T10"]
    assert summary["runs"]["transformer"]["bpb_full"] == pytest.approx(1.5) and "transformer" not in summary[
        "specialists"]
    if _has_matplotlib():
        from benchmarks.replication.plot import plot_claim
        assert plot_claim(collect_claim(5, root, names), tmp_path / "claim5.png") == ""
        assert plot_claim(collect_claim(1, root, names), tmp_path / "claim1.png") == ""
        assert (tmp_path / "claim5.png").stat().st_size > 0


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


def test_a_run_evaluated_by_its_validation_gets_its_eval_csv(tmp_path):
    """MQAR's records had no eval.csv (their recall is the training's last validation); the report step writes
    one from it for a run that reached its steps, and never for a cut run or over an existing file."""
    from benchmarks.replication.claims import final_eval_csv, read_csv

    run = tmp_path / "mqar-mixer-s1"
    run.mkdir()
    (run / "run.yaml").write_text("train:\n  seed: 1\n  steps: 2\n")
    lines = [{"kind": "train", "stage": "pretrain", "step": s, "loss": 1.0, "tokens": 8 * s, "tokens_per_s": 10.0}
             for s in (1, 2)]
    lines += [{"kind": "eval", "tier": t, "accuracy": a, "stage": "pretrain", "step": step}
              for step, (t, a) in ((1, ("T1", 0.1)), (2, ("T1", 0.25)), (2, ("T10", 0.75)))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:3]))
    assert final_eval_csv(run) is None                              # cut at step 2 before its validation
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert final_eval_csv(run) == run / "eval.csv"
    assert [(r["tier"], r["accuracy"], r["step"]) for r in read_csv(run / "eval.csv")] == [("T1", 0.25, 2),
                                                                                             ("T10", 0.75, 2)]
    before = (run / "eval.csv").read_text()
    assert final_eval_csv(run) is None and (run / "eval.csv").read_text() == before
    (run / "eval.csv").unlink()                                     # the claim-3 report step writes it too
    logs = []
    ctx = EntryContext(name="report", out_dir=tmp_path / "bench", log=logs.append, deadline=time.monotonic() + 60)
    run_report(ReplicationReportOptions(claim=3, root=str(tmp_path), runs=("mqar-mixer-s1",)), ctx)
    assert (run / "eval.csv").read_text() == before and any("from its last validation" in x for x in logs)
