"""The main job (``elastic-ssm quickstart``): train a small ESSH once on CPU (capacity-mixed, then its shared
refinement), export and check all ten tiers, evaluate them beside the dense control truncated and recovered (Tables
33, 43), write ``report.md``, ``tiers.csv`` and ``quality_size.png``; ``resume`` continues a stopped quickstart."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .cli_util import write_csv
from .config import ConfigError, RunConfig
from .config.run import DEFAULT_RUN
from .eval.perplexity import TierEval, evaluate_tiers, format_evals
from .utils.environment import cpu_threads_for
from .utils.files import atomic_write_bytes, atomic_write_text, free_stamped_path
from .utils.progress import pyplot, save_png


def _plot(rows: list[TierEval], control: list[TierEval] | None, path: Path, raw: list[TierEval] | None = None) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.params / 1e6 for r in rows], [r.bpb for r in rows], "o-", label="ESSH capacity-mixed (exports)")
    if raw:
        ax.plot([r.params / 1e6 for r in raw], [r.bpb for r in raw], "x:", color="silver",
                label="dense control, truncated (raw)")
    if control:
        ax.plot([r.params / 1e6 for r in control], [r.bpb for r in control], "s--", color="gray",
                label="dense control, truncated and recovered" if raw else "dense control, truncated")
    for r in rows:
        ax.annotate(r.tier, (r.params / 1e6, r.bpb), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set(xlabel="parameters of the standalone export (M)", ylabel="held-out bits per byte",
           title="Train once, export many: quality vs size")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)
    return True


def _inversions(rows: list[TierEval]) -> str:
    """Where a larger tier scored worse than the one below it, with by how much (empty when none: monotone)."""
    return ", ".join(f"{b.tier} {b.bpb - a.bpb:.2g} bpb above {a.tier}" for a, b in zip(rows, rows[1:])
                     if b.bpb > a.bpb)


#: what ``quickstart`` writes into ``--out`` (the two runs, the exports, the report)
OUTPUTS = ("elastic", "dense", "exports", "report.md", "tiers.csv", "quality_size.png")


def _claim_outputs(out: Path, control: bool, overwrite: bool) -> Path | None:
    """``ConfigError`` naming the ``OUTPUTS`` already in ``out``; with ``overwrite`` they move (nothing is deleted)
    into ``<out>/replaced-<UTC time>/``, returned."""
    names = [n for n in OUTPUTS if (out / n).exists() and (control or n != "dense")]
    if not names:
        return None
    if not overwrite:
        raise ConfigError(f"{out} already holds quickstart outputs ({', '.join(names)}); pass --overwrite to move "
                          "them aside (nothing is deleted), or choose another --out")
    from .train.rundir import RunLock

    for name in ("elastic", "dense"):               # never move a run that a live process is writing
        if (out / name / ".lock").is_file():
            RunLock(out / name, owner="quickstart run", flag="--out").acquire().release()

    dest = free_stamped_path(out, "replaced-")
    dest.mkdir()
    for name in names:
        os.replace(out / name, dest / name)
    print(f"[quickstart] --overwrite: moved the earlier outputs ({', '.join(names)}) to {dest}")
    return dest


def _train_or_load(run: Any, data: Any, resume: bool, overwrite: bool, stages=None, progress: bool | str = True):
    """Train ``run``; with ``resume``, continue it or load its final model (record compared first)."""
    from .pipeline import train_run

    final = Path(run.train.out_dir) / "final"
    if resume and (final / "config.json").is_file():
        from .models import load_pretrained
        from .train.preflight import _check_resume_record
        from .train.rundir import RunLock

        with RunLock(run.train.out_dir, owner="quickstart run", flag="--out"):
            _check_resume_record(Path(run.train.out_dir), run.to_dict(), run.train.RESUME_FREE)
            print(f"[quickstart] --resume: {final} is finished; loading it")
            return load_pretrained(final)
    return train_run(run, data, resume="auto" if resume else False, overwrite=overwrite, stages=stages,
                     progress=progress)


def quickstart(out_dir: str | Path = "runs/quickstart", steps: int = 0, control: bool = True,
               config: str | Path | None = None, overwrite: bool = False,
               resume: bool | str = False, progress: bool | str = True) -> dict[str, Any]:
    from .elastic.tiers import model_card
    from .models import check_export, export_tier
    from .pipeline import build_data, fit_model_to_tokenizer

    out = Path(out_dir)
    if resume and overwrite:
        raise ConfigError("--resume continues the quickstart in --out and --overwrite moves it aside; give one")
    if resume == "auto" and not (out / "elastic").is_dir():     # nothing to continue: a fresh start
        resume = False
    if resume and not (out / "elastic").is_dir():
        raise ConfigError(f"--resume: {out} holds no quickstart run to continue (no {out / 'elastic'}); drop "
                          "--resume to start one, or give its --out")
    run = RunConfig.from_yaml(DEFAULT_RUN if config is None else config)
    if run.arch != "essh":
        raise ConfigError("quickstart trains an ESSH (model.arch: essh); use `elastic-ssm train` for ES-SSM runs")
    run = run.with_overrides({}, {"out_dir": str(out / "elastic"), **({"steps": steps} if steps else {})}, {})
    if not resume:
        _claim_outputs(out, control, overwrite)
    out.mkdir(parents=True, exist_ok=True)          # after the checks: a refused run leaves no folder behind
    run = fit_model_to_tokenizer(run)
    threads = cpu_threads_for(run.train.device)     # before any work: the corpus is tokenized with them too
    if threads:
        print(f"[quickstart] {threads}")
    t0 = time.time()
    data = build_data(run)
    print(f"[quickstart] corpus: {data.describe()}")
    model = _train_or_load(run, data, resume, overwrite, progress=progress)
    t_train = time.time() - t0

    print("[quickstart] exporting and checking every tier against the shared model")
    checks, rows = [], []
    for t in model.tier_table():
        small = export_tier(model, t)
        res = check_export(model, t, standalone=small, input_ids=data.val_batches[0][0][:2])
        print(f"  {res}")
        checks.append(res)
        small.save_pretrained(out / "exports" / t.name)
        ev = evaluate_tiers(small, data.val_batches)[0]
        rows.append(TierEval(t.name, t.K, t.n_ff, t.params, ev.loss, ev.tokens, ev.bytes_per_token))
        atomic_write_bytes(out / "exports" / t.name / "README.md", model_card(   # the card, now with quality
            small, {"held-out bits per byte (quickstart validation)": rows[-1].bpb}).encode())

    control_rows = raw_rows = None
    if control:
        control_rows, raw_rows = _dense_control(run, data, out, overwrite, resume, progress)

    table = format_evals(rows)
    print("\n" + table)
    write_csv(str(out / "tiers.csv"), [{**r.row(), "export_check": "bitwise" if c.bitwise_equal else
                                        f"{c.max_abs_diff:.3g}"} for r, c in zip(rows, checks)], overwrite=True)
    plotted = _plot(rows, control_rows, out / "quality_size.png", raw_rows)
    summary = {
        "monotone": not _inversions(rows), "inversions": _inversions(rows), "held_out_tokens": rows[0].tokens,
        "bpb_T1": rows[0].bpb, "bpb_T10": rows[-1].bpb, "control_bpb_T1": control_rows and control_rows[0].bpb,
        "control_bpb_T10": control_rows and control_rows[-1].bpb, "control_raw_bpb_T1": raw_rows and raw_rows[0].bpb,
        "control_recovered": bool(raw_rows), "all_exports_bitwise": all(c.bitwise_equal for c in checks),
        "train_seconds": t_train, "total_seconds": time.time() - t0,
    }
    _write_report(out, run, table, control_rows, summary, plotted, checks, raw_rows)
    dense = ""
    if raw_rows:
        dense = (f"; dense control at T1: truncated and recovered {summary['control_bpb_T1']:.3f}, "
                 f"raw truncation {summary['control_raw_bpb_T1']:.3f}")
    elif control_rows:
        dense = f"; dense control truncated to T1: {summary['control_bpb_T1']:.3f}"
    inv = f" ({summary['inversions']})" if summary["inversions"] else ""
    print(f"\n[quickstart] monotone tier curve: {summary['monotone']}{inv}; T1 {summary['bpb_T1']:.3f} bpb vs "
          f"T10 {summary['bpb_T10']:.3f}" + dense)
    print(f"[quickstart] wrote {out / 'report.md'}, {out / 'tiers.csv'}"
          + (f", {out / 'quality_size.png'}" if plotted else " (install matplotlib for the plot)"))
    return summary


def _dense_control(run: Any, data: Any, out: Path, overwrite: bool, resume: bool = False,
                   progress: bool | str = True) -> tuple[list[TierEval], list[TierEval] | None]:
    """The dense control: full-capacity pretraining (same steps and data), then the run's refinement, if any, as
    recovery: (recovered rows, rows of the pretraining's last checkpoint), or (raw rows, None) without one."""
    from .models import load_pretrained
    from .train import find_checkpoint

    recover = run.train.refine.steps > 0
    print("[quickstart] training the dense control (full capacity only, same steps and data"
          + (f"), then recovering its truncations with the same {run.train.refine.steps}-step refinement"
             if recover else ")"))
    dense_run = run.with_overrides({}, {"recipe": "dense", "out_dir": str(out / "dense")}, {})
    stages = ("pretrain", "refine") if recover else None
    dense = _train_or_load(dense_run, data, resume, overwrite, stages, progress)  # same data config: reuse the corpus
    rows = evaluate_tiers(dense, data.val_batches)
    if not recover:
        return rows, None
    raw = load_pretrained(find_checkpoint(out / "dense" / "pretrain") / "model")
    return rows, evaluate_tiers(raw, data.val_batches)


def _write_report(out: Path, run: Any, table: str, control_rows, summary: dict, plotted: bool, checks,
                  raw_rows=None) -> None:
    t = run.train
    refine = (f", then {t.refine.steps} steps of shared refinement (ESSH D.8) of "
              f"{t.micro_batches(1, 'refine') * t.micro_batch_size} x {t.seq_len} bytes" if t.refine.steps else "")
    lines = [
        "# elastic_ssm quickstart report", "",
        f"Model: ESSH `{run.model.layout}` layout, d={run.model.d_model}, K-bar={run.model.n_channels}, "
        f"m={run.model.n_modes}, d_ff={run.model.d_ff}; trained {t.steps} steps of "
        f"{t.micro_batches(1) * t.micro_batch_size} x {t.seq_len} bytes with the "
        f"capacity-mixed recipe{refine} on the embedded corpus (Python standard library source).", "",
        "## Every tier, exported and evaluated on held-out files", "", "```", table, "```", "",
        f"- Export check: {sum(c.bitwise_equal for c in checks)}/{len(checks)} standalone exports are "
        "bitwise equal to the shared model at their tier (CPU, float32).",
        f"- Tier curve monotone (smaller tier => higher BPB): **{summary['monotone']}**"
        + (f" ({summary['inversions']}; the held-out set is {summary['held_out_tokens']:,} bytes)."
           if summary["inversions"] else "."),
        f"- Smallest tier T1: {summary['bpb_T1']:.4f} bpb vs full T10: {summary['bpb_T10']:.4f} bpb "
        f"(+{summary['bpb_T1'] - summary['bpb_T10']:.4f}).",
    ]
    if raw_rows:
        lines += [
            f"- Dense control (same pretraining steps, full capacity only), truncated to T1 and recovered with the "
            f"same refinement stage (the paper's protocol, Tables 33 and 43): {summary['control_bpb_T1']:.4f} bpb "
            f"(raw truncation before recovery: {summary['control_raw_bpb_T1']:.4f}; its T10 after recovery: "
            f"{summary['control_bpb_T10']:.4f}).", "",
            "## Dense control truncated to each tier and recovered", "", "```", format_evals(control_rows), "```",
            "", "## Dense control truncated to each tier (raw, before recovery)", "", "```",
            format_evals(raw_rows), "```",
        ]
    elif control_rows:
        lines += [
            f"- Dense control (same steps, full capacity only) truncated to T1: "
            f"{summary['control_bpb_T1']:.4f} bpb (its T10: {summary['control_bpb_T10']:.4f}); the run has no "
            "refinement stage, so the truncation is not recovered.", "",
            "## Dense control truncated to each tier", "", "```", format_evals(control_rows), "```",
        ]
    if plotted:
        lines += ["", "![quality vs size](quality_size.png)"]
    lines += ["", f"Wall time: {summary['total_seconds']:.0f} s (training {summary['train_seconds']:.0f} s)."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
