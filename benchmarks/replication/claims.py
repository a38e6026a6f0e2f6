"""The claims of issue 16 from the replication runs: one JSON of per-tier numbers per claim and its plot.

``collect_claim(claim, root, runs)`` reads each run folder under ``root`` (``steps.py`` keeps them
there across device calls): ``eval.csv`` (``elastic-ssm eval --csv``: bits per byte per tier and capacity
fraction), ``metrics.jsonl`` (tokens, tokens/s, and the validation records: MQAR accuracy per tier),
``parameters.json`` (the Tables 8/9 matching), ``run.yaml`` and ``calls.jsonl`` (wall seconds, device and
commit of every call). A run without its results is listed under ``missing``, never guessed. Rows:

* claim 1 (ESSH Tables 8, 10, 33, 43): bpb and parameters of every tier of the capacity-mixed ESSH, the
  specialists (one tier each; the dense control's full tier is the T10 specialist: same shape, recipe, tokens
  and seed), the dense control truncated and truncated + recovered, MatFormer's tiers (claim 5) and the dense
  Transformer++ of MatFormer's backbone (one point: the architecture's gap without the nesting, Table 10);
  run folders ``<arm>-s<seed>`` are seeds of one arm: ``summary.seeds`` has each arm's mean, min, max and n per
  tier (``seeds.seed_stats``) and ``summary.gaps`` the same-seed gaps of ``seeds.CLAIM1_GAPS`` (``paired_gaps``),
  each with ``sign_resolved`` (every seed's gap has the same sign);
* claim 2 (ES-SSM Sec. 4.2): bpb at every evaluated budget K with and without budget dropout, and ``summary.seeds``
  as claim 1's;
* claim 3 (ESSH Tables 21-23): MQAR accuracy per tier of the last validation (and its step), hybrid and
  mixer-only; a run is ``missing`` until it has validated at its last step, and ``summary.progress`` says how
  far each is (its runs span many calls);
* claim 4: the ESSH rows of claim 1 plus the capacity fractions, each marked ``trained_shape`` (its
  ``(K, n_ff)`` is one that training sampled: ``mixing.capacities`` or ``refine.capacities``) and a summary:
  monotone in parameters or not, and the largest rise of bpb between neighbours;
* claim 5: wall seconds (the train calls of the last attempt, from a fresh start), tokens, steady tokens/s (warm-up
  steps left out, ``split_warmup``) and full-model bpb of each run; the shared run against the sum of the specialists'
  (``wall_ratio``), and ``at_sizes``: at each specialist's size (matched by parameter count) its bpb beside the
  shared run's tier, the recovered dense control's and MatFormer's.

``corpus`` is the data line of the runs' training logs (files, bytes, split, and the manifest digest of the
``pysrc`` corpus); ``same_corpus`` is False when the runs were trained on different corpora (another machine
image between device sessions), and then ``corpus`` lists each.
"""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path
from typing import Any

import yaml

from .seeds import claim1_summary, seed_stats

__all__ = ["ROLES", "arm_of", "base_of", "collect_claim", "read_jsonl", "read_csv", "markdown_table", "run_summary",
           "seed_of"]

#: arm -> (label, role); a run folder is ``<arm>[-lr<lr>][-s<seed>]`` (``base_of``), as the suites in
#: configs/bench/replication-*.yaml name them
ROLES: dict[str, tuple[str, str]] = {
    "essh": ("ESSH capacity-mixed + shared refinement", "elastic"),
    "dense": ("dense control, truncated (full tier = T10 specialist)", "truncated"),
    "essh-long": ("ESSH capacity-mixed + SR, 2,600 steps", "elastic"),
    "dense-long": ("dense control, 2,600 steps, truncated", "truncated"),
    "dense-rec": ("dense control, truncated + recovered (paper's share: lr peak/20, 7.3% tokens)", "recovered"),
    "dense-rec33": ("dense control, truncated + recovered (#16: lr peak/33, 4.6% tokens)", "recovered"),
    "dense-s0-retrain": ("dense control, seed 0 trained again (a same-seed repeat)", "repeat"),
    "essh-s0-retrain": ("ESSH, seed 0 trained again (a same-seed repeat)", "repeat"),
    "spec-t1": ("specialist T1 from scratch", "specialist"),
    "spec-t4": ("specialist T4 from scratch", "specialist"),
    "matformer": ("MatFormer (FFN-only nesting)", "matformer"),
    "transformer": ("Transformer++ dense (MatFormer's backbone)", "baseline"),
    "essm-bd": ("ES-SSM with budget dropout", "budgets"),
    "essm-full": ("ES-SSM full budget only", "budgets"),
    "mqar-hybrid": ("ESSH hybrid", "recall"),
    "mqar-mixer": ("ESSH mixer-only", "recall"),
}
#: seconds of a device call a training run may use (540 s budget - 25 s reserve - eval and margin)
CALL_TRAIN_S = 420
TITLES = {0: "calibration: tokens/s and start-up of each setting", 1: "train once vs train each size",
          2: "budget dropout makes every prefix usable", 3: "recall needs the hybrid",
          4: "capacities between the trained tiers", 5: "cost of one shared run vs the specialists"}


def arm_of(name: str) -> str:
    """The arm of run folder ``name``, whose seeds ``seed_stats`` pools: ``essh-s1`` -> ``essh``,
    ``transformer-lr0.002`` -> itself (another learning rate is another arm)."""
    return re.sub(r"-s\d+$", "", name)


def base_of(name: str) -> str:
    """The ``ROLES`` key of run folder ``name``: its arm without ``-lr<lr>`` (``mqar-mixer-lr0.0006-s1`` ->
    ``mqar-mixer``)."""
    return re.sub(r"-lr[0-9.]+(e-?\d+)?$", "", arm_of(name))


def seed_of(name: str) -> int | None:
    """The seed in run folder ``name`` (``essh-s2`` -> 2; None without ``-s<seed>``)."""
    m = re.search(r"-s(\d+)$", name)
    return int(m.group(1)) if m else None


def _role(name: str) -> str:
    """The role of run folder ``name``'s arm in ``ROLES`` ('' for a folder no claim names)."""
    return ROLES.get(base_of(name), ("", ""))[1]


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV record (none when it is absent), numbers as numbers (text stays text, "tier" always)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    def num(v: str | None) -> Any:
        if v in ("", None):
            return None
        try:
            return int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            return v                              # a text column (e.g. a run's stage)

    return [{k: (v if k == "tier" else num(v)) for k, v in r.items()} for r in rows]


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``head`` and ``rows`` (cells already formatted), ending with a newline."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none when it is absent; an unreadable line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue                                  # a torn last line of an interrupted call
    return out


#: a logged step more than this many times slower than the median step is warm-up (``split_warmup``); the
#: records of 2026-12-01 have steady spreads up to 2.3 x and warm-up steps from 6.6 x to 891 x
WARMUP_FACTOR = 5.0


def logged_rate(records: list[dict[str, Any]]) -> float:
    """Tokens/s of a run from its logged steps, time-weighted: each record is one step (the same tokens per step)
    at ``tokens_per_s``, so the rate is their tokens over their seconds (the harmonic mean of the records). A
    median or plain mean would follow the cheap steps of a run whose step cost varies (budget dropout's small K,
    capacity mixing's small tiers)."""
    n = len(records)
    return n / sum(1.0 / max(r["tokens_per_s"], 1e-9) for r in records)


def split_warmup(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(steady, warm-up) records of a run's logged steps. The first step (start-up) and every step slower than
    ``WARMUP_FACTOR`` x the median step of the rest are warm-up: one-time costs such as fla autotuning a shape it
    meets for the first time (40-260 s for one step of the calibration of 2026-12-01, whose time-weighted rate they
    cut from ~175k to 37k tok/s) or a first compile. Budget dropout's and capacity mixing's cost spread (about 2.5 x
    between their smallest and full steps) stays inside the steady rate."""
    if len(records) < 2:
        return list(records), []
    rest = records[1:]
    median = sorted(1.0 / max(r["tokens_per_s"], 1e-9) for r in rest)[len(rest) // 2]
    is_slow = [1.0 / max(r["tokens_per_s"], 1e-9) > WARMUP_FACTOR * median for r in rest]
    return ([r for r, slow in zip(rest, is_slow) if not slow],
            [records[0], *(r for r, slow in zip(rest, is_slow) if slow)])


def _count_parameters(model: dict[str, Any]) -> dict[str, Any]:
    """The full and per-tier parameter counts of a run's resolved ``model`` section (``parameter_report``); empty
    when the section does not describe a model this version can build."""
    from elastic_ssm.config import ConfigError, model_config_from_dict
    from elastic_ssm.elastic.tiers import parameter_report

    try:
        rep = parameter_report(model_config_from_dict(dict(model)))
    except (ConfigError, TypeError, ValueError):
        return {}
    return {k: rep[k] for k in ("arch", "params", "tiers")}


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What one run folder says: config, parameters, tokens, tokens/s, wall seconds, device and commit."""
    out: dict[str, Any] = {"present": run_dir.is_dir()}
    if (run_dir / "run.yaml").is_file():
        rec = yaml.safe_load((run_dir / "run.yaml").read_text()) or {}
        out["model"], out["recipe"] = rec.get("model", {}), rec.get("train", {}).get("recipe")
        out["train"] = rec.get("train", {})
        if rec.get("recover"):          # a recovery: the run folder whose weights it started from
            src = Path(str(rec["recover"].get("source", "")))   # a run name, or recover's PARENT path (.../final)
            out["source"] = src.parent.name if src.name == "final" else src.name
    if (run_dir / "parameters.json").is_file():
        out["parameters"] = json.loads((run_dir / "parameters.json").read_text())
    elif out.get("model"):          # a run cut between calls has no parameters.json yet: count from its run.yaml
        out["parameters"] = _count_parameters(out["model"])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in metrics if r.get("kind") == "train"]
    if train:
        stages = list(dict.fromkeys(r.get("stage") for r in train))     # in training order: stable JSON
        out["tokens"] = sum(max(r["tokens"] for r in train if r.get("stage") == s) for s in stages)
        out["steps"] = {s: max(r["step"] for r in train if r.get("stage") == s) for s in stages}
        steady, warmup = split_warmup(train)
        out["tokens_per_s"] = logged_rate(steady or train)
        out["steady_s"] = out["tokens"] / out["tokens_per_s"]
        out["tokens_per_step"] = out["tokens"] / max(sum(out["steps"].values()), 1)
        out["warmup_steps"] = [r["step"] for r in warmup]
        out["warmup_s"] = round(sum(out["tokens_per_step"] / max(r["tokens_per_s"], 1e-9) for r in warmup), 1)
    calls = [c for c in read_jsonl(run_dir / "calls.jsonl")      # training calls: every step but the evaluation
             if c.get("step") and not c["step"].endswith("-eval")]
    start = max((i for i, c in enumerate(calls) if c.get("fresh")), default=0)
    attempt = calls[start:]
    if attempt:
        out["wall_s"] = round(sum(c.get("wall_s", 0.0) for c in attempt), 1)
        out["calls"] = len(attempt)
        out["environment"] = sorted({f"{c.get('device')} / torch {c.get('torch')} / commit {c.get('commit')}"
                                     for c in attempt})
    evals = [r for r in metrics if r.get("kind") == "eval"]
    if evals:
        last = max((r.get("stage") == "refine", r.get("step", 0)) for r in evals)
        out["last_validation"] = [r for r in evals if (r.get("stage") == "refine", r.get("step", 0)) == last]
    out["eval"] = read_csv(run_dir / "eval.csv")
    return out


def final_eval_csv(run_dir: Path) -> Path | None:
    """``run_dir/eval.csv`` from the run's own last validation (``metrics.jsonl``: one row per tier, e.g. MQAR's
    recall as ``accuracy``) for a run that reached its ``train.steps`` and has no ``eval.csv`` of its own (the
    record layout holds one per run); None when there is nothing to write. An existing file is never touched."""
    s = run_summary(run_dir)
    target = run_dir / "eval.csv"
    want = (s.get("train") or {}).get("steps")
    last = s.get("last_validation") or [{}]
    if target.exists() or not want or max((s.get("steps") or {0: 0}).values()) < want or last[0].get("step") != want:
        return None                   # validated at its last step only: an earlier validation is not the result
    rows = [{k: v for k, v in r.items() if k != "kind"} for r in s["last_validation"]]
    with open(target, "x", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return target


def _trained_shapes(summary: dict[str, Any]) -> set[tuple[int, int]]:
    from elastic_ssm.config import model_config_from_dict

    model = {k: v for k, v in summary.get("model", {}).items()}
    if not model:
        return set()
    cfg = model_config_from_dict(model)
    t = summary.get("train", {})
    fracs = list(t.get("mixing", {}).get("capacities", [])) + list(t.get("refine", {}).get("capacities", []))
    return {(cfg.channels_for(x), cfg.ffn_width_for(x) if x < 1 else cfg.d_ff) for x in fracs} | {
        (cfg.n_channels, cfg.d_ff)}


def _rows(claim: int, name: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    label, role = ROLES.get(base_of(name), (name, "elastic"))
    if lr := re.search(r"-lr([0-9.]+(e-?\d+)?)", name):       # another learning rate of the arm: say which
        label += f", lr {float(lr.group(1)):g}"
    elif role in ("matformer", "baseline") and (peak := (s.get("train") or {}).get("optim", {}).get("lr")):
        label += f", lr {float(peak):g}"                         # a baseline's first run: its lr from run.yaml
    base = {"run": name, "arm": arm_of(name), "seed": seed_of(name), "label": label, "role": role,
            "source": s.get("source")}
    if role == "recall":
        return [{**base, "tier": r["tier"], "K": r.get("K"), "n_ff": r.get("n_ff"),
                 "params": s.get("parameters", {}).get("tiers", {}).get(r["tier"]), "accuracy": r.get("accuracy"),
                 "step": r.get("step")}
                for r in s.get("last_validation", [])]
    rows = [{**base, **{k: r.get(k) for k in ("tier", "xi", "K", "n_ff", "params", "bpb", "loss")}}
            for r in s.get("eval", [])]
    if claim in (1, 5) and role == "elastic":                 # fractions belong to claim 4's plot
        rows = [r for r in rows if not str(r["tier"]).startswith("xi=")]
    if role == "specialist":      # its one tier: "T1" in records before tier_names, its source's name (T4) after
        rows = [{**r, "tier": "T1"} for r in rows if not str(r["tier"]).startswith("xi=")]
    if claim == 4:
        shapes = _trained_shapes(s)
        for r in rows:
            r["trained_shape"] = (r["K"], r["n_ff"]) in shapes if shapes else None
    return rows


def _summary(claim: int, runs: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    if claim == 0:                  # start-up = wall - steady; the steps of this setting that fit CALL_TRAIN_S
        out = {}
        for n, s in runs.items():
            if not (s.get("wall_s") and s.get("tokens")):
                continue
            startup = max(s["wall_s"] - s["steady_s"], 0.0)
            out[n] = {"tokens_per_s": s["tokens_per_s"], "startup_s": round(startup, 1),
                      "warmup_s": s["warmup_s"], "warmup_steps": s["warmup_steps"],
                      "tokens_per_step": s["tokens_per_step"],
                      "steps_that_fit": int(max(CALL_TRAIN_S - startup, 0) * s["tokens_per_s"] / s["tokens_per_step"])}
        return {"call_train_s": CALL_TRAIN_S, "settings": out}
    if claim == 1:
        return claim1_summary(rows)
    if claim == 2:                  # each budget's mean, min, max over the seeds of each arm ("K4", ...)
        return {"seeds": seed_stats(rows)}
    if claim == 4:
        pts = sorted((r["params"], r["bpb"], r["tier"]) for r in rows if r["bpb"] is not None)
        rises = [(b2 - b1, t1, t2) for (_, b1, t1), (_, b2, t2) in zip(pts, pts[1:])]
        worst = max(rises, default=(0.0, None, None))
        return {"points": len(pts), "untrained_points": sum(1 for r in rows if r.get("trained_shape") is False),
                "monotone": all(d <= 0 for d, _, _ in rises), "largest_rise_bpb": worst[0],
                "largest_rise_between": [worst[1], worst[2]]}
    if claim == 5:
        cost = {n: {k: s.get(k) for k in ("wall_s", "steady_s", "tokens", "tokens_per_s", "calls")}
                for n, s in runs.items()}
        for n, s in runs.items():
            full = [r for r in s.get("eval", []) if r.get("xi") in (1, 1.0) or r.get("tier") == "T10"]
            cost[n]["bpb_full"] = full[-1]["bpb"] if full else None
        each = [n for n in runs if _role(n) in ("specialist", "truncated")]
        total = lambda key: (sum(cost[n][key] for n in each) if each and all(cost[n][key] for n in each)   # noqa: E731
                             else None)
        shared = next((n for n in runs if _role(n) == "elastic"), None)
        shared_wall = cost[shared]["wall_s"] if shared else None
        return {"runs": cost, "specialists": each, "specialists_wall_s": total("wall_s"),
                "specialists_steady_s": total("steady_s"), "shared": shared, "shared_wall_s": shared_wall,
                "wall_ratio": (total("wall_s") / shared_wall) if total("wall_s") and shared_wall else None,
                "at_sizes": _quality_at_sizes(rows, cost)}
    if claim == 3:                  # how far each recall run is: its last validation's step of its train.steps
        return {"progress": {n: {"validated_at": _validated_at(s), "of_steps": s.get("train", {}).get("steps")}
                             for n, s in runs.items()}}
    return {}


def _quality_at_sizes(rows: list[dict[str, Any]], cost: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Claim 5's quality at each size a specialist was trained for: the shared run's tier of the same parameter
    count, that specialist (the dense control's full model is the T10 one), the dense control truncated +
    recovered and MatFormer at the same tier name, in bits per byte, with the specialist's wall seconds."""
    by_role = lambda role: [r for r in rows if r["role"] == role and r.get("bpb") is not None]   # noqa: E731
    own = {r["params"]: r for r in by_role("specialist")}
    own.update({r["params"]: r for r in by_role("truncated") if r.get("xi") in (1, 1.0)})
    same_tier = lambda role, tier: next((r["bpb"] for r in by_role(role) if r["tier"] == tier), None)   # noqa: E731
    out = []
    for r in by_role("elastic"):
        spec = own.get(r["params"])
        if spec is None:
            continue
        out.append({"tier": r["tier"], "params": r["params"], "shared_bpb": r["bpb"], "specialist": spec["run"],
                    "specialist_bpb": spec["bpb"], "specialist_wall_s": cost.get(spec["run"], {}).get("wall_s"),
                    "recovered_bpb": same_tier("recovered", r["tier"]),
                    "matformer_bpb": same_tier("matformer", r["tier"])})
    return out


def _validated_at(s: dict[str, Any]) -> int | None:
    return max((r.get("step", 0) for r in s.get("last_validation", [])), default=None)


def _done(claim: int, name: str, s: dict[str, Any]) -> bool:
    """Whether a run has its claim's results: an evaluation, or for a recall run (claim 3, whose numbers are
    its training's own validations) a validation at its last step; a run cut between calls is not done."""
    if claim == 0:
        return bool(s.get("tokens"))
    if _role(name) == "recall":
        at, steps = _validated_at(s), s.get("train", {}).get("steps")
        return at is not None and steps is not None and at >= steps
    return bool(s.get("eval") or s.get("last_validation"))


def collect_claim(claim: int, root: str | Path, runs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """One claim's JSON (see the module docstring); ``missing`` lists the runs without results."""
    root = Path(root)
    summaries = {n: run_summary(root / n) for n in runs}
    rows = [r for n in runs for r in _rows(claim, n, summaries[n])]
    if claim == 4:
        rows = [r for r in rows if r["role"] == "elastic"]
    missing = [n for n, s in summaries.items() if not _done(claim, n, s)]
    corpora = {}                        # the data line of each run's last training call (pysrc: files, bytes)
    for n in runs:
        for log in sorted((root / n / "logs").glob("*train*.log")) if (root / n / "logs").is_dir() else []:
            hit = [ln for ln in log.read_text(errors="replace").splitlines() if "; corpus " in ln]
            if hit:
                corpora[n] = hit[-1].split("; corpus ", 1)[1]
    distinct = sorted(set(corpora.values()))
    return {"claim": claim, "title": TITLES[claim], "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "corpus": distinct[0] if len(distinct) == 1 else distinct, "same_corpus": len(distinct) <= 1,
            "missing": missing, "rows": rows, "summary": _summary(claim, summaries, rows),
            "runs": {n: {k: v for k, v in s.items() if k not in ("eval", "last_validation")}
                     for n, s in summaries.items()}}

