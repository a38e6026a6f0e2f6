"""Glue from a ``RunConfig`` to data, model and ``train()`` (used by the CLI and the quickstart)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, model_config_from_dict
from .utils.environment import cpu_threads_for


@dataclass
class RunData:
    """A run's ``train_tokens`` and fixed ``val_batches``, or a ``synthetic`` task that generates both."""

    train_tokens: Any
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    vocab_size: int
    bytes_per_token: float
    source: str
    synthetic: Any = None
    tokenizer: Any = None
    corpus: str = ""

    def describe(self) -> str:
        n_val = sum(int((y != -100).sum()) for _, y in self.val_batches)
        if self.synthetic is not None:
            return (f"{self.source}: fresh batches every step, {n_val:,} scored validation tokens in "
                    f"{len(self.val_batches)} fixed batches, vocab {self.vocab_size}")
        return (f"{self.source}: {len(self.train_tokens):,} training tokens, {n_val:,} validation tokens "
                f"in {len(self.val_batches)} fixed batches, vocab {self.vocab_size}"
                + (f"; corpus {self.corpus}" if self.corpus else ""))

    def batches(self, seq_len: int, batch_size: int, seed: int):
        """``data(rank, world_size)`` factory for ``train()``: shuffled, sharded, resumable."""
        if self.synthetic is not None:
            return self.synthetic.batches(seq_len, batch_size, seed)
        from .data import PackedBatches

        def make(rank: int = 0, world_size: int = 1):
            return PackedBatches(self.train_tokens, seq_len, batch_size, seed=seed, rank=rank, world_size=world_size)

        return make


def build_data(run: Any, verify: bool = False) -> RunData:
    """``run``'s checked training and validation data; ``verify``: re-hash prepared token files whole."""
    from .data import evaluation_batches, load_corpus, load_tokenizer

    d, t = run.data, run.train
    limit = run.model.max_seq_len()         # refused before any work: longer than the model accepts (ES-SSM filters)
    if limit is not None and t.seq_len > limit:
        field = type(run.model).length_field
        raise ConfigError(f"--train.seq_len {t.seq_len} exceeds --model.{field} {limit}, the longest sequence this "
                          f"{run.arch} model accepts; give --train.seq_len {limit} or less, or --model.{field} "
                          f"{t.seq_len} or more")
    if getattr(run.model, "task", "lm") != "lm":
        raise ConfigError("the CLI's data pipeline packs token streams for language modelling; train an ES-SSM "
                          "classifier from Python with train(model, batches of (input_ids, labels[B]), cfg)")
    if d.source.startswith("synthetic:"):
        from .data.synthetic import SyntheticSource

        try:
            src = SyntheticSource(d.source, run.model.vocab_size)
            val = src.validation(t.seq_len, t.micro_batch_size, t.eval.batches, t.seed)
        except ValueError as e:
            raise ConfigError(f"data.source: {e}") from e
        return RunData(None, val, run.model.vocab_size, 0.0, d.source, synthetic=src)
    tok = load_tokenizer(d.tokenizer)
    if tok.vocab_size > run.model.vocab_size:
        raise ConfigError(f"tokenizer {d.tokenizer!r} has {tok.vocab_size} ids but model.vocab_size is "
                          f"{run.model.vocab_size}; set --model.vocab_size >= {tok.vocab_size}")
    cap = d.max_train_bytes or None
    train_tokens = load_corpus(d.source, tok, split="train", max_bytes=cap, text_field=d.text_field, verify=verify)
    val_src = d.val_source or d.source
    val_tokens = load_corpus(val_src, tok, split=_validation_split(d), text_field=d.text_field, verify=verify)
    val = list(evaluation_batches(val_tokens, t.seq_len, t.micro_batch_size, t.eval.batches))
    if not val:
        raise ConfigError(f"validation source {val_src!r} is shorter than one sequence of {t.seq_len} tokens")
    bpt = t.eval.bytes_per_token or (1.0 if tok.vocab_size <= 260 else 0.0)
    from .data.pysrc import describe_split_files

    corpus = describe_split_files(getattr(train_tokens, "meta", {}), getattr(val_tokens, "meta", {}))
    return RunData(train_tokens, val, tok.vocab_size, bpt or 1.0, d.source, tokenizer=tok, corpus=corpus)


def _validation_split(d: Any) -> str | None:
    """The split of the validation source read: all of a ``data.val_source`` file or folder of its own (None), the
    validation split of ``data.source``, of a named corpus (stdlib, pysrc, hf:) or of a folder of prepared splits."""
    from .data.pysrc import is_pysrc

    v = d.val_source
    if not v or v == d.source or is_pysrc(v) or v == "stdlib" or v.startswith("hf:"):
        return "validation"
    return "validation" if (Path(v).expanduser() / "validation.bin").is_file() else None


def fit_model_to_tokenizer(run: Any) -> Any:
    """``run`` with the model's ``vocab_size`` (and ESSH's eos / pad ids) from the data's tokenizer; an explicit
    ``vocab_size`` >= the tokenizer's is kept (padding: 50304 for GPT-2's 50257 ids); synthetic tasks keep theirs."""
    from .data import load_tokenizer

    if run.data.source.startswith("synthetic:") or getattr(run.model, "task", "lm") != "lm":
        return run
    tok = load_tokenizer(run.data.tokenizer)
    vocab = run.model.vocab_size
    if "vocab_size" in run.explicit_model_fields:
        if vocab < tok.vocab_size:
            raise ConfigError(f"tokenizer {run.data.tokenizer!r} has {tok.vocab_size} ids but model.vocab_size is "
                              f"{vocab}; set --model.vocab_size >= {tok.vocab_size} or leave it out")
    else:
        vocab = tok.vocab_size
    changes: dict[str, Any] = {"vocab_size": vocab}
    for name, tid in (("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
        if hasattr(run.model, name) and name not in run.explicit_model_fields:
            changes[name] = tid
    changes = {k: v for k, v in changes.items() if getattr(run.model, k) != v}
    return dataclasses.replace(run, model=run.model.replace(**changes)) if changes else run   # still implicit


def train_run(run: Any, data: RunData, resume: bool | str = False, progress: bool | str = True, overwrite: bool = False,
              stages: tuple[str, ...] | None = None, stop_after: int | None = None):
    """The model trained on ``data`` with ``run.train``, the run recorded in its ``run.yaml``; ``stages``,
    ``stop_after``: ``train``'s (``("pretrain", "refine")`` gives a dense run its refinement stage)."""
    from .train import train

    t = run.train
    res = train(run.model, data.batches(t.seq_len, t.micro_batch_size, t.seed), t, val_data=data.val_batches,
                resume=resume, progress=progress, overwrite=overwrite, record=run.to_dict(),
                tokenizer=data.tokenizer, stages=stages, stop_after=stop_after)
    return res.model


def _position(out: Any) -> tuple[str, int] | None:
    """``(stage, step)`` of the newest complete checkpoint in ``out`` (later stage first), or None; read only."""
    from .train.checkpoint import find_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stage in ("refine", "pretrain"):
            found = find_checkpoint(out / stage)
            if found is not None:
                return stage, int(found.name.split("_")[1])
    return None


def run_training(run: Any, resume: bool | str = False, overwrite: bool = False, stop_after: int | None = None,
                 verify_data: bool = False, progress: bool | str = True):
    """``elastic-ssm train``: build data (every source checked before anything is written), then train."""
    from .cli_util import is_rank_zero, resolve_device

    if run.train.device != "auto":        # a device this machine lacks is named before any data is read
        resolve_device(run.train.device, "train.device")
    run = fit_model_to_tokenizer(run)
    out = Path(run.train.out_dir)
    if resume == "auto":       # checkpoints that all fail their check: named now, not "no checkpoint yet, starting"
        from .train.rundir import has_checkpoint, refuse_unusable_run

        refuse_unusable_run(out)
        resume_auto_continues = has_checkpoint(out)   # else a fresh start: a run.yaml there is not compared
    at_start = _position(out) if resume else None
    from .train.preflight import check_same_arch, read_run_record

    saved = read_run_record(out) if resume is True or (resume == "auto" and resume_auto_continues) else None
    if saved is not None:
        check_same_arch(out, saved, run.arch)
        try:
            before = model_config_from_dict(type(run.model).upgrade_record(saved["model"])).to_dict()
        except ConfigError as e:
            raise ConfigError(f"{out / 'run.yaml'}: its model section is invalid ({e}); restore it from a copy, or "
                              "start a new --train.out_dir") from None
        # a run started before the tokenizer set eos / pad keeps its saved ids (they do not touch the weights), one
        # started before a setting existed (``added_fields``) its old value, unless set explicitly (a specialist
        # started before tier_names keeps its T1 name); every other setting is compared by train()'s start-up checks
        kept = ["eos_token_id", "pad_token_id", *(k for k in type(run.model).added_fields if k not in saved["model"])]
        ids = {k: before[k] for k in kept
               if k in before and k not in run.explicit_model_fields and before[k] != getattr(run.model, k)}
        run = dataclasses.replace(run, model=run.model.replace(**ids)) if ids else run
    main = is_rank_zero()                # under torchrun, status lines come from rank 0 only
    threads = cpu_threads_for(run.train.device)     # before any work: the data is tokenized with them too
    if threads and main:
        print(f"[train] {threads}")
    data = build_data(run, verify=verify_data)
    from .elastic.tiers import format_report, parameter_report

    params = parameter_report(run.model, run.model_source)      # Tables 8 / 9 / 54, reported with the run
    if main:
        print(f"[train] {data.describe()}")
        print(f"[train] parameters: {format_report(params)}")
    model = train_run(run, data, resume=resume, overwrite=overwrite, stop_after=stop_after, progress=progress)
    if not main:
        return model
    if (out / "final").is_dir():
        from .utils.files import atomic_write_bytes

        atomic_write_bytes(out / "parameters.json", json.dumps(params, indent=2).encode())
        print(f"[train] done; final model in {out / 'final'} (load with elastic_ssm.models.load_pretrained)")
    elif stop_after and (after := _position(out)) is not None and after == at_start and after[1] >= stop_after:
        where = "past" if after[1] > stop_after else "at"
        print(f"[train] the run is already {where} step {stop_after} (at {after[0]} step {after[1]}); nothing was "
              f"trained (--stop_after {stop_after}); continue with --resume and a larger --stop_after, or without "
              "--stop_after to finish it")
    else:
        print(f"[train] stopped at step {stop_after} of the current stage (--stop_after); checkpoint in {out}; "
              "continue with --resume")
    return model
