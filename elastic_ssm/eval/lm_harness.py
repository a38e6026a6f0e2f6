"""lm-evaluation-harness adapter (ESSH Appendix E.4; Tables 1(a), 13, 15; extra ``eval``; docs/evaluation.md says how
each request type is scored): ``ElasticLM`` is one tier of a model as an lm-eval ``LM``; ``evaluate_tiers_on_tasks``
loads the model once and runs every tier."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install 'elastic-ssm[eval]' "
                      "(or pip install 'lm-eval>=0.4.9')") from e

from ..config import tier_word
from ..data.tokenizers import resolve_tokenizer
from ..elastic.tiers import check_counts
from ..models import load_pretrained
from ..utils.progress import progress as progress_bar
from .perplexity import continuation_scores

__all__ = ["ElasticLM", "check_model_args", "evaluate_tiers_on_tasks", "result_rows"]


def _as_int(value: Any, name: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    check_counts(**{name: out})
    return out


def check_model_args(args: Iterable[str], added: dict[str, Any] | None = None) -> None:
    """A one-line ``ValueError`` for ``--model_args`` keys that ``ElasticLM`` does not take (naming those it does),
    or that lm-eval also sets from its own flags (``added``), which would be a ``TypeError`` in ``__init__``."""
    accepted = [name for name in inspect.signature(ElasticLM.__init__).parameters if name != "self"]
    unknown = [key for key in args if key not in accepted]
    if unknown:
        raise ValueError(f"--model_args: unknown key(s) {', '.join(unknown)}; the elastic-ssm model takes "
                         f"{', '.join(accepted)} (e.g. pretrained=DIR,tier=T4)")
    twice = [key for key in args if (added or {}).get(key) is not None]
    if twice:
        raise ValueError(f"--model_args {twice[0]}: lm-eval sets it from its own --{twice[0]} flag too; give it "
                         "there only")


@register_model("elastic-ssm", "elastic_ssm")
class ElasticLM(TemplateLM):
    """One tier of an elastic model behind lm-eval's ``LM`` interface.

    ``show_progress`` (class default True) gates the scoring bar; ``evaluate_tiers_on_tasks`` sets it.

    Args:
        pretrained: a model (``ESSH`` / ``ESSSM`` / a standalone export) or a ``save_pretrained`` directory.
        tier: tier name (``"T3"``; ES-SSM ``"K8"`` or a budget, ``8`` or ``"8"``), or ``"full"`` / None (default).
        tokenizer: None (default): the tokenizer saved with the model (bytes for a model without one); else
            ``"bytes"``, a ``tokenizer.json`` or a tokenizer folder, which must equal the saved one.
        device: where a loaded model goes (default: the model's device, else ``"cpu"``).
        batch_size: sequences per forward pass, or ``"auto"`` up to ``max_batch_size`` (default 64): on CUDA the
            largest power of two whose forward at the longest request fits in memory; on CPU ``min(8, max_batch_size)``.
        max_length: longest scored input in tokens; longer inputs keep their last ``max_length`` tokens.
        max_gen_toks: default generation length for ``generate_until``.
        precision: ``"fp32"`` or ``"bf16"`` (autocast)."""

    backend = "causal"
    show_progress = True

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ElasticLM:
        """lm-eval's ``--model_args`` string; an unknown key is named with the accepted ones (``check_model_args``)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> ElasticLM:
        """lm-eval's ``--model_args`` as a dict; unknown keys refused as in ``create_from_arg_string``."""
        check_model_args(arg_dict, additional_config)
        return super().create_from_arg_obj(arg_dict, additional_config)

    def __init__(self, pretrained: Any, tier: str | None = "full", tokenizer: Any = None,
                 device: str | None = None, batch_size: int | str = 8, max_length: int | str = 2048,
                 max_gen_toks: int | str = 256, precision: str = "fp32", max_batch_size: Any = None) -> None:
        super().__init__()
        if isinstance(pretrained, (str, Path)):
            model = load_pretrained(pretrained, device=device or "cpu")
        else:
            model = pretrained if device is None else pretrained.to(device)
        if getattr(model.config, "task", "lm") != "lm":
            raise ValueError("lm-eval scores language models; this checkpoint is a sequence classifier "
                             f"(task={model.config.task!r})")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        self.model = model.eval()
        tier = tier_word(tier)                               # "8" (lm-eval's quoted tier='8'): the ES-SSM budget 8
        self.tier = None if tier in (None, "", "none", "full") else tier
        if self.tier is not None:
            model.resolve_tier(self.tier)                    # unknown names fail here, naming the choices
        self.tok = resolve_tokenizer(model, tokenizer)
        self.max_batch_size = _as_int(max_batch_size, "max_batch_size") if max_batch_size else 64
        self.batch_size = 0 if str(batch_size).startswith("auto") else _as_int(batch_size, "batch_size")
        self.max_length = _as_int(max_length, "max_length")
        if model.arch == "es_ssm":                           # fixed filter length L (ES-SSM Sec. 3)
            self.max_length = min(self.max_length, model.config.seq_len)
        self.max_gen_toks = _as_int(max_gen_toks, "max_gen_toks")
        self.precision = precision
        self._device = next(model.parameters()).device

    eot_token_id = property(attrgetter("tok.eos_id"))
    device = property(attrgetter("_device"))
    #: the conditioning token of an empty context and of the first rolling window
    prefix_token_id = property(attrgetter("tok.bos_id"))
    tokenizer_name = property(attrgetter("tok.spec"))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw: Any) -> list[int]:
        return list(self.tok.encode(string))

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tok.decode(list(tokens))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kw: Any) -> list[tuple[float, bool]]:
        """``(context, continuation)`` token pairs -> ``(sum log p(continuation | context), is_greedy)``."""
        prepared = []
        for key, ctx, cont in requests:
            if not cont:
                raise ValueError(f"empty continuation for context {key[0]!r:.60}: nothing to score")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens is longer than max_length="
                                 f"{self.max_length}: raise max_length")
            if not ctx:
                ctx = [self.prefix_token_id]
            full = (ctx + cont)[-(self.max_length + 1):]
            prepared.append((full[:-len(cont)], cont))                       # truncated context, continuation
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(prepared)), key=lambda i: -sum(map(len, prepared[i])))   # longest first
        if order and not self.batch_size:
            self.batch_size = self._auto_batch_size(sum(map(len, prepared[order[0]])))
        with progress_bar(total=len(order), desc="scoring", unit="req",
                          enabled=self.show_progress and not disable_tqdm and len(order) >= 2) as bar:
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                bar.update(len(idx))
                scores = continuation_scores(self.model, self.tier, [prepared[i][0] for i in idx],
                                             [prepared[i][1] for i in idx], self.precision)
                for i, (score, hits) in zip(idx, scores):
                    greedy = all(hits)
                    out[i] = (score, greedy)
                    key = requests[i][0]
                    if key is not None and key[0] is not None:
                        self.cache_hook.add_partial("loglikelihood", key, (score, greedy))
        return out  # type: ignore[return-value]

    def _auto_batch_size(self, length: int) -> int:
        """``batch_size="auto"``: the largest power of two <= ``max_batch_size`` whose forward of ``length``
        tokens fits on the device (CUDA; tried from the top, halving on out-of-memory); CPU: 8."""
        if self._device.type != "cuda":
            return min(8, self.max_batch_size)
        size = 1 << (self.max_batch_size.bit_length() - 1)
        while size > 1:
            try:
                continuation_scores(self.model, self.tier, [[0] * max(1, length - 1)] * size, [[0]] * size,
                                    self.precision)
                break
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                size //= 2
        return size

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over disjoint rolling windows of ``max_length`` tokens."""
        out = []
        for req in progress_bar(requests, desc="rolling log-likelihood", unit="doc",
                                enabled=self.show_progress and not disable_tqdm):
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task sets ``do_sample``: its ``temperature``, default 1, ``top_k``, ``top_p``)
        continuation, cut at the first stop string; another generation argument is ``generate``'s one-line error.

        Requests with the same generation arguments run together, ``batch_size`` at a time, as one
        left-padded batch (``ESSH.generate``: every row equals its unpadded single-sequence result)."""
        if not hasattr(self.model, "generate"):
            raise NotImplementedError(f"generate_until needs cached generation, which {type(self.model).__name__} "
                                      "does not have (ESSH and ES-SSM do); use loglikelihood tasks for this model")
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted((req.args[1] or {}).items())), []).append(i)
        out: list[str] = [""] * len(requests)
        if not self.batch_size:
            self.batch_size = self._auto_batch_size(self.max_length)
        bar = progress_bar(total=len(requests), desc="generating", unit="req",
                           enabled=self.show_progress and not disable_tqdm)
        for members in groups.values():
            kw = dict(requests[members[0]].args[1] or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            n_new = kw.pop("max_gen_toks", self.max_gen_toks)
            n_new = _as_int(kw.pop("max_new_tokens", n_new), "max_gen_toks")   # transformers' name wins, as in hf
            if kw.get("num_beams") == 1:                                        # greedy; more beams: refused below
                kw.pop("num_beams")
            sample = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p") if k in kw}
            sample = {**sample, "do_sample": True} if kw.pop("do_sample", False) else {"do_sample": False}
            for start in range(0, len(members), self.batch_size):
                idx = members[start:start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-max(1, self.max_length - n_new):]
                           or [self.prefix_token_id] for i in idx]
                width = max(len(p) for p in prompts)                # left padding: right-pad the reversed rows
                x = pad_sequence([torch.tensor(p[::-1]) for p in prompts], batch_first=True,
                                 padding_value=self.eot_token_id).flip(1)               # [B, width]
                mask = pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True).flip(1)
                full = self.model.generate(x.to(self._device), max_new_tokens=n_new, tier=self.tier,
                                           attention_mask=mask.to(self._device), eos=self.eot_token_id,
                                           **sample, **kw)       # generate names an option it lacks
                for row, i in enumerate(idx):
                    text = self.tok_decode([t for t in full[row, width:].tolist() if t != self.eot_token_id])
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    out[i] = text
                bar.update(len(idx))
        bar.close()
        return out


def evaluate_tiers_on_tasks(pretrained: Any, tasks: Sequence[str], tiers: str | Sequence[str | int] | None = "all",
                            tokenizer: Any = None, device: str | None = None, batch_size: int = 8,
                            max_length: int = 2048, limit: int | float | None = None,
                            num_fewshot: int | None = None, include_path: str | None = None,
                            precision: str = "fp32", bootstrap_iters: int = 1000, seed: int = 1234,
                            progress: bool = False) -> list[dict[str, Any]]:
    """lm-eval ``tasks`` at every tier of ``tiers`` ("all" / None: the tier table) of one model, loaded once: one
    ``result_rows`` row per tier, task and metric. ``include_path``: a folder of local task YAML files; ``limit``
    caps the documents per task (a smoke run)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)   # task names are checked before the model loads
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}: not a registered task, group or tag name nor a task "
                         "YAML file (`lm-eval ls tasks` lists them; local tasks need --include_path)")
    first = ElasticLM(pretrained, tier=None, tokenizer=tokenizer, device=device, batch_size=batch_size,
                      max_length=max_length, precision=precision)
    model = first.model
    names = [t.name for t in model.tier_table()] if tiers in ("all", None) else list(tiers)
    resolved = [model.resolve_tier(name) for name in names]    # every tier checked before the first task runs
    rows = []
    for t in progress_bar(resolved, desc="lm-eval tiers", unit="tier", enabled=progress):
        lm = ElasticLM(model, tier=t.name, tokenizer=first.tok, batch_size=batch_size, max_length=max_length,
                       precision=precision)
        lm.show_progress = progress
        res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=False,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
        rows += result_rows(res, t)
    return rows


#: keys of lm-eval's per-task results that are bookkeeping, not scores (the task's name, its number of samples)
_NOT_METRICS = frozenset({"alias", "sample_len", "samples"})


def result_rows(results: dict[str, Any], tier: Any) -> list[dict[str, Any]]:
    """lm-eval's ``results`` of one tier as rows ``{"tier", "K", "n_ff", "params", "task", "metric",
    "value", "stderr"}`` (one per task and metric; ``tier`` is a ``Tier``)."""
    rows = []
    for task, metrics in sorted(results["results"].items()):
        for key, value in metrics.items():
            metric, _, flt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or metric in _NOT_METRICS:
                continue
            stderr = metrics.get(f"{metric}_stderr,{flt}")
            rows.append({"tier": tier.name, "K": tier.K, "n_ff": tier.n_ff, "params": tier.params, "task": task,
                         "metric": metric if flt in ("", "none") else f"{metric},{flt}", "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None})
    return rows
