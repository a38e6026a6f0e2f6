"""docs/results.md's claim tables, rendered from the committed run records: ``python -m benchmarks.results_page``.

Every table of the page between ``<!-- table: NAME -->`` and ``<!-- /table -->`` is rendered by ``RENDER[NAME]``
from ``docs/results/records/<run>/`` (eval.csv, metrics.jsonl, parameters.json, run.yaml, calls.jsonl) through
``benchmarks.replication.claims`` (``collect_claim``) and ``.seeds`` (``seed_stats``, ``paired_gaps``: the same
numbers the suites' reports write), with the runs each claim's suite names
(``configs/bench/replication-claimN.yaml``, its report entry). ``--check`` (the default) exits 1 when a region
differs from its rendering, when a renderer has no region on the page, or when a claim section (``### Claim ...``,
``### Seeds ...``) holds a table line outside a region (a hand-typed number); ``--write`` rewrites the regions. The
papers' numbers in the tables are constants below, each with its table. Rounding: bits per byte to 3 decimals,
accuracy to 3 (4 at 0.995 and above), parameters in M to 1 or 2 decimals.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import sys
from pathlib import Path

from benchmarks import results_claim1 as rc1
from benchmarks.replication.claims import arm_of, base_of, collect_claim, read_jsonl, run_summary, seed_of
from benchmarks.replication.claims import markdown_table as table
from benchmarks.replication.seeds import CLAIM1_GAPS, paired_gaps
from benchmarks.results_claim1 import baselines_table, best_run, commits_of, long_table, lr_runs, repeat_table
from benchmarks.results_claim3 import claim3, claim3_data, claim3_seeds, claim3_steps, seed_cell
from benchmarks.results_evals import RENDER_EVALS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
RECORDS = ROOT / "docs" / "results" / "records"
REGION = re.compile(r"<!-- table: (\S+) -->\n(.*?)<!-- /table -->", re.S)
TIERS = [f"T{i}" for i in range(1, 11)]
#: ESSH paper perplexities (370M, 7.4B tokens): Table 11 shared vs independent, Table 33 recovered dense control vs
#: ESSH control (3.7B-token ablation), Table 10 baselines vs ESSH T10
PAPER_PPL = {"T1 shared - specialist": (23.61, 19.79, "Table 11"), "T4 shared - specialist": (17.68, 16.25, "Table 11"),
             "T10 shared - dense": (14.71, 14.44, "Table 11"),
             "T1 recovered (#16) - shared": (45.66, 25.32, "Table 33"),
             "T1 recovered (paper's share) - shared": (45.66, 25.32, "Table 33"),
             "T4 recovered (#16) - shared": (23.75, 19.15, "Table 33"),
             "T4 recovered (paper's share) - shared": (23.75, 19.15, "Table 33"),
             "MatFormer full - ESSH T10": (16.80, 14.71, "Table 10"),
             "Transformer++ - ESSH T10": (15.88, 14.71, "Table 10"),
             "MatFormer full - Transformer++": (16.80, 15.88, "Table 10")}
#: ESSH Table 47 (A100-hours): independent T1, T4, T10, and shared training total (pretraining + refinement)
PAPER_COST = (22.8, 33.1, 50.6, 53.9)


@functools.cache
def suite_runs(claim: int) -> tuple[str, ...]:
    """The runs the report entry of ``replication-claimN`` names."""
    from benchmarks.suite import load_suite

    return tuple(next(e for e in load_suite(f"replication-claim{claim}").entries
                      if e.kind == "replication_report").options.runs)


@functools.cache
def claim(n: int) -> dict:
    return collect_claim(n, RECORDS, suite_runs(n))


def claim1_bpb() -> dict[tuple[str, str], float]:
    """Claim 1's bits per byte by (run, tier)."""
    return {(r["run"], r["tier"]): r["bpb"] for r in claim(1)["rows"]}


def f3(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def sgn(x: float) -> str:
    return f"{x:+.3f}"


def cell(c: dict | None, fmt=f3) -> str:
    """A seed cell: the mean, the range min-max and n."""
    if not c:
        return ""
    if c["n"] == 1:
        return f"{fmt(c['mean'])} (n=1)"
    return f"{fmt(c['mean'])} ({fmt(c['min'])} to {fmt(c['max'])}, n={c['n']})"


def _mean(v: list[float]) -> dict:
    return {"n": len(v), "mean": sum(v) / len(v), "min": min(v), "max": max(v)} if v else {}


# ---- claim 1 -----------------------------------------------------------------------------------------------------
def claim1() -> str:
    res = claim(1)
    seeds, rows = res["summary"]["seeds"], res["rows"]
    params = {(r["arm"], r["tier"]): r["params"] for r in rows}
    best, mat = best_run(RECORDS, "transformer"), best_run(RECORDS, "matformer")
    spec = {"T1": seeds.get("spec-t1", {}).get("T1"), "T4": seeds.get("spec-t4", {}).get("T1"),
            "T10": seeds.get("dense", {}).get("T10")}
    out = []
    for t in TIERS:
        g = lambda arm, t=t: seeds.get(arm, {}).get(t)       # noqa: E731
        out.append([t, f"{params[('essh', t)] / 1e6:.1f}", cell(g("essh")),
                    cell(spec.get(t)) + (" (the dense control)" if t == "T10" and spec.get(t) else ""),
                    cell(g("dense")), cell(g("dense-rec33")), cell(g("dense-rec")),
                    f"{params[('matformer', t)] / 1e6:.1f}" if ("matformer", t) in params else "",
                    cell(g(mat)), cell(seeds.get(best, {}).get("T1")) if t == "T10" else ""])
    return table(["tier", "ESSH params (M)", "ESSH capacity-mixed + SR", "specialist from scratch",
                  "dense control, truncated", "+ recovered, #16 protocol (lr 6e-5, 60 steps)",
                  "+ recovered, paper's share (lr 1e-4, 95 steps)", "MatFormer params (M)",
                  f"MatFormer (lr {lr_runs(RECORDS, 'matformer')[mat][0]:g})",
                  f"Transformer++ dense (41.1M, lr {lr_runs(RECORDS, 'transformer')[best][0]:g})"], out)


def _stage_tokens(run: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in read_jsonl(RECORDS / run / "metrics.jsonl"):
        if r.get("kind") == "train":
            out[r["stage"]] = max(out.get(r["stage"], 0), r["tokens"])
    return out


def _tokens_per_parameter(run: str) -> float:
    return _stage_tokens(run)["pretrain"] / run_summary(RECORDS / run)["parameters"]["params"]


def claim1_seeds() -> str:
    res = claim(1)
    bpb = claim1_bpb()
    out = []
    for run in [n for n in suite_runs(1) if n not in res["missing"]]:
        s, arm = run_summary(RECORDS / run), arm_of(run)
        tok, full = _stage_tokens(run), s.get("parameters", {}).get("params")
        pre, ref = tok.get("pretrain"), tok.get("refine")
        refine = f"{ref / 1e6:.1f}" if ref else ""
        if arm.startswith("dense-rec"):                  # recovery: refine tokens against its source's pretraining
            base = _stage_tokens(f"dense-s{seed_of(run)}").get("pretrain")
            refine += f" ({100 * ref / base:.1f}% of {base / 1e6:.1f}M)" if ref and base else ""
        own = {"spec-t1": "T1", "spec-t4": "T4"}.get(arm)          # a specialist's one tier is its own shape
        cols = [f3(bpb.get((run, "T1"))) if own == t else "" for t in ("T1", "T4", "T10")] if own else [
            f3(bpb.get((run, t))) for t in ("T1", "T4", "T10")]
        out.append([run, str(s.get("train", {}).get("seed", "")), *cols, f"{pre / 1e6:.1f}" if pre else "",
                    refine, f"{pre / full:.2f}" if pre and full else "",
                    f"{s['wall_s']:.1f}" if s.get("wall_s") else "", commits_of(s)])
    return table(["run", "train.seed", "T1 bpb", "T4 bpb", "T10 bpb", "pretraining tokens (M)",
                  "refine tokens (M)", "tokens per parameter (full model)", "wall s (training calls)", "commit"], out)


def claim1_gaps() -> str:
    gaps = claim(1)["summary"]["gaps"]
    seeds = sorted({s for g in gaps.values() for s in g["seeds"]}, key=int)
    out = []
    for name in CLAIM1_GAPS:
        g = gaps[name]
        by = {int(k): v for k, v in g["seeds"].items()}
        sign = ("yes" if g["sign_resolved"] else "no") if g["n"] > 1 else "one seed"
        out.append([name, *[sgn(by[s]) if s in by else "" for s in seeds],
                    sgn(g["mean"]) if g["n"] else "", f"{sgn(g['min'])} to {sgn(g['max'])}" if g["n"] else "",
                    str(g["n"]), sign])
    return table(["same-seed gap (bpb)", *[f"s{s}" for s in seeds], "mean", "range", "n", "same sign at every seed"],
                 out)


def _gap_cells() -> dict[str, dict]:
    res = claim(1)
    out = {k: {**g, "mean": g["mean"]} for k, g in res["summary"]["gaps"].items()}
    st = res["summary"]["seeds"]
    essh = list(st["essh"]["T10"]["seeds"].values())
    mat = st[best_run(RECORDS, "matformer")]["T10"]["mean"]
    tr = st[best_run(RECORDS, "transformer")]["T1"]["mean"]
    out["MatFormer full - ESSH T10"] = _mean([mat - e for e in essh])
    out["Transformer++ - ESSH T10"] = _mean([tr - e for e in essh])
    out["MatFormer full - Transformer++"] = _mean([mat - tr])
    return out


def claim1_paper() -> str:
    gaps, out = _gap_cells(), []
    for name, (a, b, tab) in PAPER_PPL.items():
        g, paper = gaps[name], math.log(a / b)
        if not g or not g.get("n"):
            continue
        if g["n"] > 1 and not (g["min"] > 0 or g["max"] < 0):
            verdict = f"sign not resolved over {g['n']} seeds"
        else:
            same = (g["mean"] > 0) == (paper > 0)
            verdict = ("same sign" if same else "opposite sign") + (" at every seed" if g["n"] > 1 else ", one run")
        rng = f" ({sgn(g['min'])} to {sgn(g['max'])}, n={g['n']})" if g["n"] > 1 else " (n=1)"
        out.append([f"{name} ({tab}: {a:.2f} vs {b:.2f})", f"{paper:+.3f}", sgn(g["mean"]) + rng,
                    f"{g['mean'] * math.log(2):+.3f}", verdict])
    return table(["comparison (paper PPL)", "paper (nats/token)", "ours, mean gap in bpb (range, n)",
                  "ours, mean in nats/byte", "agrees in sign?"], out)


# ---- claims 2-5 --------------------------------------------------------------------------------------------------
def claim2_gaps(arm: str = "essm-full", other: str = "essm-bd") -> dict[int, dict]:
    """K -> the same-seed gap ``arm - other`` (default "without - with" budget dropout) over the seeds both arms ran:
    ``cell``'s dict with ``seeds`` ({seed: gap}, ``paired_gaps``)."""
    rows = claim(2)["rows"]
    gaps = {k: paired_gaps(rows, arm, other, f"K{k}") for k in sorted({r["K"] for r in rows})}
    return {k: {**_mean(list(g.values())), "seeds": g} for k, g in gaps.items()}


def claim2() -> str:
    ks = [2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
    rows, st, gaps = claim(2)["rows"], claim(2)["summary"]["seeds"], claim2_gaps()
    size = {r["K"]: r["params"] for r in rows if r["arm"] == "essm-bd"}
    runs = {arm: ", ".join(sorted(st[arm]["K32"]["seeds"])) for arm in ("essm-bd", "essm-full")}   # each seed's run
    return table(["K", *map(str, ks)], [["parameters (M)", *[f"{size[k] / 1e6:.1f}" for k in ks]],
                                        [f"with budget dropout ({runs['essm-bd']})",
                                         *[cell(st["essm-bd"].get(f"K{k}")) for k in ks]],
                                        [f"without, K = 32 only ({runs['essm-full']})",
                                         *[cell(st["essm-full"].get(f"K{k}")) for k in ks]],
                                        ["without - with, same seed", *[cell(gaps.get(k), sgn) for k in ks]]])


def claim4() -> str:
    rows = sorted(claim(4)["rows"], key=lambda r: r["xi"])
    return table(["point", "xi", "K", "FFN width", "parameters (M)", "bpb", "shape sampled in training"],
                 [[str(r["tier"]), f"{r['xi']:g}", str(r["K"]), str(r["n_ff"]), f"{r['params'] / 1e6:.2f}",
                   f3(r["bpb"]), "yes" if r["trained_shape"] else "no"] for r in rows])


def claim5() -> str:
    s = claim(5)["summary"]
    cost, runs = s["runs"], suite_runs(5)

    def row(label: str, names: list[str], models: str) -> list[str]:
        wall = f"{sum(cost[n]['wall_s'] for n in names):.1f}"
        if len(names) > 1:
            wall += " (" + " + ".join(f"{cost[n]['wall_s']:.1f}" for n in names) + ")"
        return [label, " + ".join(names), wall, f"{sum(cost[n]['steady_s'] for n in names):.1f}",
                f"{sum(cost[n]['tokens'] for n in names) / 1e6:.1f}",
                " / ".join(f"{cost[n]['tokens_per_s']:,.0f}" for n in names), models]

    by = lambda a: next(n for n in runs if base_of(n) == a)   # noqa: E731
    return table(["way to get the models", "runs", "wall s", "steady s", "tokens (M)", "steady tok/s", "models"], [
        row("one shared run (ESSH capacity-mixed + SR)", [by("essh")], "ten tiers and every capacity between"),
        row("a specialist per size", s["specialists"], "three"),
        row("dense control + recovery (#16 protocol)", [by("dense"), by("dense-rec33")], "ten tiers"),
        row("MatFormer", [by("matformer")], "ten widths"),
        row("Transformer++ trained dense", [by("transformer")], "one"),
    ]) + f"\nWall ratio, specialists / shared run: {s['wall_ratio']:.2f}.\n"


def claim5_sizes() -> str:
    return table(["size", "shared run's tier", "specialist (run, wall s)", "dense truncated + recovered (#16)",
                  "MatFormer at the same tier"],
                 [[f"{r['tier']} ({r['params'] / 1e6:.1f}M)", f3(r["shared_bpb"]),
                   f"{f3(r['specialist_bpb'])} ({r['specialist']}, {r['specialist_wall_s']:.1f} s)",
                   f3(r["recovered_bpb"]), f3(r["matformer_bpb"])] for r in claim(5)["summary"]["at_sizes"]])


def summary() -> str:
    """The page's summary: each claim's verdict with its numbers, seeds and tokens per parameter."""
    c1, gaps, b1 = claim(1)["summary"], claim(1)["summary"]["gaps"], claim1_bpb()
    t10 = gaps["T10 shared - dense"]
    st = c1["seeds"]
    e, d = st["essh"], st["dense"]
    c2, cost2 = claim(2)["summary"]["seeds"], claim2_gaps("essm-bd", "essm-full")[32]    # with - without at K = 32
    c3 = claim3_data(RECORDS)["seeds"]
    c4, c5 = claim(4)["summary"], claim(5)["summary"]
    c4b = {r["tier"]: r["bpb"] for r in claim(4)["rows"]}
    tpp, long4 = _tokens_per_parameter("essh-s0"), rc1.long_clause(RECORDS, max(
        abs(b1[f"{m}-s0-retrain", "T10"] - b1[f"{m}-s0", "T10"]) for m in ("dense", "essh")))
    tpp4 = f"; 4x point {_tokens_per_parameter(rc1.LONG[0][2]):.2f}" if long4 else ""
    return table(["claim", "verdict", "numbers (bits per byte unless said)", "seeds", "tokens per parameter"], [
        ["1 train once vs each size", "partial",
         f"shared tier - specialist: T1 {cell(gaps['T1 shared - specialist'], sgn)}, T4 "
         f"{cell(gaps['T4 shared - specialist'], sgn)}, the paper's sign (Table 11); T10 shared - dense "
         f"{cell(t10, sgn)}: sign not resolved (paper: the specialist better; same-seed repeats moved T10 by "
         f"{sgn(b1['dense-s0-retrain', 'T10'] - b1['dense-s0', 'T10'])} (dense-s0) and "
         f"{sgn(b1['essh-s0-retrain', 'T10'] - b1['essh-s0', 'T10'])} (essh-s0), as much as the gaps' spread: "
         f"run-to-run noise){long4}; recovered dense - shared at T1, "
         "paper's share " + cell(gaps["T1 recovered (paper's share) - shared"], sgn) + ", #16's "
         f"{cell(gaps['T1 recovered (#16) - shared'], sgn)}: the paper's sign (Table 33), larger",
         f"essh n={e['T10']['n']}, dense n={d['T10']['n']}, spec-t1 n={st['spec-t1']['T1']['n']}, "
         f"spec-t4 n={st['spec-t4']['T1']['n']}; 4x: 1", f"{tpp:.2f}{tpp4} (paper ~20; ~10 in Tables 33, 37)"],
        ["2 budget dropout", "partial",
         f"every prefix usable with it (K = 4: {cell(c2['essm-bd']['K4'])}); without it K = 4 "
         f"{cell(c2['essm-full']['K4'])}, degraded, not collapsed; full-budget cost {cell(cost2, sgn)} at K = 32",
         f"{cost2['n']} ({', '.join(f's{x}' for x in cost2['seeds'])})", f"{_tokens_per_parameter('essm-bd-s0'):.2f}"],
        ["3 recall needs the hybrid", "partial",
         f"hybrid T1/T4/T10 {' / '.join(seed_cell(c3['mqar-hybrid'][t]) for t in ('T1', 'T4', 'T10'))} "
         f"(replicated); mixer-only {' / '.join(seed_cell(c3['mqar-mixer'][t]) for t in ('T1', 'T4', 'T10'))} "
         "accuracy, far above the paper's 0.011 / 0.023 / 0.024",
         "; ".join(f"{a.removeprefix('mqar-')} {c['T10']['n']}" for a, c in c3.items()),
         f"{_tokens_per_parameter('mqar-hybrid-s0'):.0f} (hybrid; synthetic)"],
        ["4 capacities between tiers", "replicated",
         f"{c4['points']} points ({c4['untrained_points']} shapes no step sampled) "
         + ("fall monotonically with parameters" if c4["monotone"] else "are not monotone")
         + f"; below the smallest trained capacity a steep rise (xi = 0.04: {f3(c4b['xi=0.04'])} against T1 "
         f"{f3(c4b['T1'])})", "1 (essh-s0)", f"{tpp:.2f}"],
        ["5 cost", "replicated",
         f"three specialists cost {c5['wall_ratio']:.2f} x the shared run's wall time "
         f"({c5['specialists_wall_s']:.1f} against {c5['shared_wall_s']:.1f} s); paper (Table 47, independent T1 + "
         f"T4 + T10 against the shared run's total) {sum(PAPER_COST[:3]) / PAPER_COST[3]:.2f} x", "1 (s0 runs)",
         f"{tpp:.2f}"],
    ])


def essm_modal() -> str:
    """ES-SSM decoding, modal against exact (record ``essm-modal``: the es-ssm suite's report rows)."""
    import csv

    with (RECORDS / "essm-modal" / "eval.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        exact = r["decode"] == "exact"
        fit = ("-", "-") if exact else (f"{float(r['fit_max']):.3g}", f"{float(r['fit_mean']):.3g}")
        out.append([r["K"], r["decode"], r["m"], *fit, f"{float(r['bpb']):.5f}", f"{float(r['delta_bpb']):+.1e}",
                    f"{int(r['state_bytes']):,}"])
    return table(["K", "decode", "m", "fit error max", "fit error mean", "bpb", "Δ bpb vs exact", "state bytes/seq"],
                 out)


RENDER = {"essm-modal": essm_modal, "summary": summary, "claim1": claim1, "claim1-seeds": claim1_seeds,
          "claim1-gaps": claim1_gaps, "claim1-paper": claim1_paper, "claim2": claim2, "claim4": claim4,
          "claim5": claim5, "claim5-sizes": claim5_sizes,
          **{name: functools.partial(fn, RECORDS) for name, fn in (*RENDER_EVALS.items(), ("claim1-long", long_table),
                                                                   ("claim1-repeat", repeat_table),
                                                                   ("claim1-baselines", baselines_table),
                                                                   ("claim3", claim3), ("claim3-seeds", claim3_seeds),
                                                                   ("claim3-steps", claim3_steps))}}


def render(text: str) -> tuple[str, list[str]]:
    """The page with every region re-rendered, and the problems found (unknown or missing regions, hand-typed
    tables in claim sections)."""
    problems, seen = [], []

    def sub(m: re.Match) -> str:
        seen.append(m.group(1))
        if m.group(1) not in RENDER:
            problems.append(f"unknown table region {m.group(1)!r}")
            return m.group(0)
        return f"<!-- table: {m.group(1)} -->\n{RENDER[m.group(1)]()}<!-- /table -->"

    new = REGION.sub(sub, text)
    problems += [f"no region for table {n!r} on the page" for n in RENDER if n not in seen]
    section, inside = "", False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            section = line
        inside = (inside or line.startswith("<!-- table: ")) and not line.startswith("<!-- /table")
        if line.startswith("|") and not inside and re.match(r"#+ (Claim|Seeds)", section):
            problems.append(f"line {i}: a table in '{section}' outside a generated region (hand-typed)")
    return new, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--write", action="store_true", help="rewrite the page's table regions from the records")
    ap.add_argument("--check", action="store_true", help="exit 1 when the page and the records disagree (default)")
    args = ap.parse_args(argv)
    text = args.page.read_text()
    new, problems = render(text)
    if args.write:
        args.page.write_text(new)
        print(f"wrote {args.page}")
    elif new != text:
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "page", "records"))
        problems.append("the page's tables differ from the records (diff above; --write rewrites them)")
    for p in problems:
        print(f"results_page: {p}", file=sys.stderr)
    if not problems and not args.write:
        print(f"results_page: {args.page} agrees with {RECORDS} ({len(RENDER)} tables)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
