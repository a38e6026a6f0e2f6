"""Issue 16's harness end to end on the CPU: a claim-1 suite at the tiny preset (capacity-mixed ESSH + shared
refinement, the dense control truncated and recovered, a T1 specialist) through ``elastic-ssm bench``, over
three device-like calls: the first is cut (``--stop-after`` stands for the budget), the second restores the
carried state on a fresh root and finishes, the third skips everything."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from elastic_ssm.cli import main as cli_main

pytestmark = pytest.mark.slow      # ~12 child processes of elastic-ssm train / eval / recover


def _suite(tmp_path):
    src = tmp_path / "src"
    for i in range(60):
        f = src / f"pkg{i % 5}" / f"m{i}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(8)))
    train = {"steps": 6, "micro_batch_size": 4, "tokens_per_step": 512, "seq_len": 64, "seed": 0, "device": "cpu",
             "log_every": 1, "optim": {"lr": 3e-3}, "mixing": {"n_warm_tokens": 0}, "ordering": {"every": 2},
             "eval": {"every": 0, "batches": 2}, "checkpoint": {"every": 2, "keep_last": 1},
             "refine": {"steps": 2, "tokens_per_step": 256}}
    runs = {"essh": ({"arch": "essh", "preset": "tiny"}, "capacity_mixed"),
            "dense": ({"arch": "essh", "preset": "tiny"}, "dense"),
            "spec-t1": ({"arch": "essh", "preset": "tiny", "tier_config": "T1"}, "dense")}
    data = {"source": f"pysrc:{src}", "tokenizer": "bytes"}
    for name, (model, recipe) in runs.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"model": model, "train": {**train, "recipe": recipe},
                                                               "data": data}))
    cli = ["python", "-m", "elastic_ssm.cli"]
    root = str(tmp_path / "state1")

    def step(name, run, args, **kw):
        return {"name": name, "kind": "replication_step", "run": run, "root": root, "args": cli + args, **kw}

    def arm(run, cfg, tiers="all"):
        return [step(f"{run}-train", run, ["train", "--config", str(tmp_path / f"{cfg}.yaml"), "--train.out_dir",
                                           "{run}", "--resume", "auto"],
                     outputs=["{run}/final"], skip_when=["{run}/eval.csv"]),
                step(f"{run}-eval", run, ["eval", "{run}/final", "--data", data["source"], "--seq-len", "64",
                                          "--batch-size", "4", "--n-batches", "2", "--device", "cpu", "--tiers", tiers,
                                          "--csv", "{run}/eval.csv"], requires=["{run}/final"],
                     outputs=["{run}/eval.csv"])]

    entries = [{"name": "restore", "kind": "replication_state", "action": "restore", "root": root,
                "carry": str(tmp_path / "carry"), "records": ""}]      # not the repository's records
    entries += arm("essh", "essh", ",".join(f"T{i}" for i in range(1, 11)) + ",0.3,0.7")
    entries += arm("dense", "dense")[:2]
    entries.append(step("dense-recover", "dense-rec", ["recover", "{root}/dense/final", "--protocol", "refine",
                                                       "--config", str(tmp_path / "dense.yaml"), "--train.out_dir",
                                                       "{run}", "--device", "cpu", "--overwrite"],
                        requires=["{root}/dense/final"], outputs=["{run}/final"], skip_when=["{run}/eval.csv"]))
    entries += arm("dense-rec", "dense")[1:]
    entries += arm("spec-t1", "spec-t1")
    runs = ["essh", "dense", "dense-rec", "spec-t1"]
    entries += [{"name": "report", "kind": "replication_report", "claim": 1, "root": root, "runs": runs},
                {"name": "pack", "kind": "replication_state", "action": "pack", "root": root,
                 "publish": ["results/claim1.json"]}]
    path = tmp_path / "claim1-tiny.yaml"
    path.write_text(yaml.safe_dump({"description": "claim 1 at the tiny preset", "entries": entries}))
    return path, runs


def _call(path, tmp_path, monkeypatch, n, root, *flags):
    out = tmp_path / f"out{n}"
    monkeypatch.setenv("OUT", str(out))
    assert cli_main(["bench", "--bench.suite", str(path), "--bench.out_dir", str(tmp_path / f"bench{n}"),
                     "--bench.set", f"root={root}", *flags]) == 0
    res = json.loads((tmp_path / f"bench{n}" / f"{path.stem}.json").read_text())
    first = {e["name"]: e["rows"][0] if e["rows"] else {"state": e["state"]} for e in res["entries"]}
    return out, {name: row.get("state", row.get("result")) for name, row in first.items()}


def test_claim1_suite_runs_resumes_and_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path / "cache"))
    path, runs = _suite(tmp_path)
    out1, states = _call(path, tmp_path, monkeypatch, 1, tmp_path / "state1",
                         "--bench.set", "essh-train.extra_args=[--stop-after, '2']")
    assert states["essh-train"] == "incomplete" and states["essh-eval"] == "waiting"
    assert all(states[f"{r}-eval"] == "ran" for r in ("dense", "dense-rec", "spec-t1"))
    first = json.loads((out1 / "claim1.json").read_text())
    assert first["missing"] == ["essh"]
    meta = json.loads((out1 / "replication-state.json").read_text())
    assert meta["checkpoints"] == ["essh/pretrain/step_0000002"]        # the unfinished run's checkpoint travels

    shutil.copytree(out1, tmp_path / "carry")                           # the next call, on a bare machine
    root2 = tmp_path / "state2"
    out2, states = _call(path, tmp_path, monkeypatch, 2, root2)
    assert states["restore"].startswith("restored generation 1")
    assert states["essh-train"] == "ran" and states["essh-eval"] == "ran"
    assert all(states[f"{r}-train"] == "skipped" for r in ("dense", "spec-t1"))
    calls = [json.loads(x) for x in (root2 / "essh" / "calls.jsonl").read_text().splitlines()]
    assert [c["fresh"] for c in calls if c["step"] == "essh-train"] == [True, False]   # the second resumed
    steps = [json.loads(x)["step"] for x in (root2 / "essh" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("kind") == "train" and json.loads(x)["stage"] == "pretrain"]
    assert steps == list(range(1, 7))                                   # every step once, as an uncut run
    res = json.loads((out2 / "claim1.json").read_text())
    assert res["missing"] == []
    tiers = {r: [x["tier"] for x in res["rows"] if x["run"] == r] for r in runs}
    assert tiers["essh"] == [f"T{i}" for i in range(1, 11)]             # fractions are claim 4's rows
    assert tiers["dense"] == tiers["dense-rec"] == tiers["essh"] and len(tiers["spec-t1"]) == 1
    assert all(x["bpb"] > 0 for x in res["rows"]) and res["same_corpus"] and "files" in res["corpus"]
    assert json.loads((out2 / "replication-state.json").read_text())["generation"] == 2

    out3, states = _call(path, tmp_path, monkeypatch, 3, root2)         # warm machine, nothing left to do
    assert {s for n, s in states.items() if n.endswith(("-train", "-eval", "-recover"))} == {"skipped"}
    assert json.loads((out3 / "claim1.json").read_text())["rows"] == res["rows"]


SHRINK = ["--train.device", "cpu", "--train.precision", "fp32", "--train.steps", "6", "--train.micro_batch_size", "2",
          "--train.grad_accum", "2", "--train.seq_len", "64", "--train.eval.every", "3", "--train.eval.batches", "1",
          "--train.checkpoint.every", "2", "--train.log_every", "1", "--model.d_model", "32", "--model.d_ff", "64",
          "--model.n_channels", "8", "--model.head_dim", "16", "--model.filter_length", "256",
          "--data.source", "synthetic:mqar:num_pairs=4"]


def test_claim3_suite_runs_both_arms_together_across_calls(tmp_path, monkeypatch):
    """The claim-3 suite itself (configs/bench/replication-claim3.yaml: both MQAR arms `concurrent`), shrunk to a
    CPU toy through extra_args: the first call is cut after 3 of 6 steps (`--stop-after` stands for the budget)
    and both arms' checkpoints travel in one state; the next call, on a fresh root, resumes both and the claim
    is complete."""
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(Path(__file__).resolve().parents[2])             # the suite names configs/replication/...

    def call(n, root, carry, stop=()):
        flags = [f"{arm}.extra_args=[{', '.join(repr(a) for a in SHRINK + list(stop))}]"
                 for arm in ("mqar-hybrid-train", "mqar-mixer-train")]
        sets = [x for f in [f"root={root}", f"carry={carry}", "records=''", *flags] for x in ("--bench.set", f)]
        return _call(Path("replication-claim3"), tmp_path, monkeypatch, n, root, *sets)

    out1, states = call(1, tmp_path / "state1", tmp_path / "none", ["--stop-after", "3"])
    assert states["mqar-hybrid-train"] == states["mqar-mixer-train"] == "incomplete"
    meta = json.loads((out1 / "replication-state.json").read_text())
    assert sorted(meta["checkpoints"]) == ["mqar-hybrid-s0/pretrain/step_0000003",
                                           "mqar-mixer-s0/pretrain/step_0000003"]
    first = json.loads((out1 / "claim3.json").read_text())
    assert first["missing"] == ["mqar-hybrid-s0", "mqar-mixer-s0"]            # validated at step 3 of 6: not done
    assert first["summary"]["progress"]["mqar-mixer-s0"] == {"validated_at": 3, "of_steps": 6}

    root2 = tmp_path / "state2"
    out2, states = call(2, root2, out1)
    assert states["restore"].startswith("restored generation 1")
    assert states["mqar-hybrid-train"] == states["mqar-mixer-train"] == "ran"
    for arm in ("mqar-hybrid-s0", "mqar-mixer-s0"):                      # run folders <arm>-s<seed>
        calls = [json.loads(x) for x in (root2 / arm / "calls.jsonl").read_text().splitlines()]
        assert [c["fresh"] for c in calls] == [True, False]            # the second call resumed
    res = json.loads((out2 / "claim3.json").read_text())
    assert res["missing"] == [] and {r["step"] for r in res["rows"]} == {6}
    assert {(r["run"], r["tier"]) for r in res["rows"]} == {(a, t) for a in ("mqar-hybrid-s0", "mqar-mixer-s0")
                                                            for t in ("T1", "T4", "T10")}
