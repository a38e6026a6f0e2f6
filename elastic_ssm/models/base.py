"""Base class of the elastic models: tier resolution, exact counts, save / load of a model directory
(docs/architecture.md, "A model directory"; ``from_pretrained(path, tier=)`` reads only the tier's prefixes).
Subclasses define ``slice_rules`` and build no non-persistent buffers, so a model made on the meta device is
completed by ``load_state_dict(assign=True)``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigBase, ConfigError, TierLike
from ..elastic import tiers as tiers_mod
from ..elastic.slicing import SliceRule, load_sliced_safetensors, slice_state_dict
from ..layers.ffn import RMSNorm
from ..utils.environment import checked_device
from ..utils.files import atomic_write_bytes, fsync_dir
from . import model_dir
from .model_dir import CONFIG_NAME, WEIGHTS_NAME, CheckpointError


class ElasticModel(nn.Module):
    """What every architecture shares (tiers, counts, save / load) and what ``elastic_ssm.train`` calls;
    ``config`` is the model's (possibly standalone) config. Optional, found with ``hasattr`` by the trainer:
    ``ffn_layers()`` (the unit-ordered SwiGLU layers) and ``hidden_states`` (the chunked loss)."""

    arch: ClassVar[str] = ""
    config_class: ClassVar[type[ConfigBase]]
    #: state-dict names (regex) kept in float32 when loading with a lower ``dtype`` (modal tables, filters)
    keep_fp32: ClassVar[str] = r"$^"
    #: its prefill scans with fla's kernels on CUDA: ``from_pretrained(device="cuda")`` starts importing fla early
    scans_with_fla: ClassVar[bool] = False
    #: the weights' checksum still running after ``from_pretrained(defer_verify=True)`` (a Future), else None
    _weights_check: Any = None

    def __init__(self, config: ConfigBase) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config)}")
        self.config = config
        self.source: dict[str, Any] = {}
        #: the tokenizer the model was trained with (saved with it; ``data.tokenizers``)
        self.tokenizer: Any = None
        #: the tokenizer entry of the loaded config.json (kept when the tokenizer itself cannot be loaded)
        self.tokenizer_record: dict[str, Any] | None = None
        self.name_or_path = ""
        self.register_load_state_dict_pre_hook(_refuse_older_layout)

    def resolve_tier(self, tier: TierLike = None) -> tiers_mod.Tier:
        return tiers_mod.resolve_tier(self.config, model_dir._old_export_alias(self.config, self.source, tier))

    def tier_table(self) -> list[tiers_mod.Tier]:
        return tiers_mod.tier_table(self.config)

    def num_parameters(self, tier: TierLike = None) -> int:
        """Exact parameter count of the standalone export of ``tier`` (computed from the config)."""
        return tiers_mod.num_parameters(self.config, tier)

    @classmethod
    def tier_config(cls, config: ConfigBase, tier: TierLike) -> ConfigBase:
        """The standalone config of ``tier`` (only the retained sizes): the config's ``standalone_config``."""
        return config.standalone_config(config.resolve_tier(tier))  # type: ignore[attr-defined]

    @classmethod
    def slice_rules(cls, config: ConfigBase, tier: tiers_mod.Tier) -> list[SliceRule]:
        """Prefix rules (rows or columns) that cut the shared state dict down to ``tier``."""
        raise NotImplementedError

    def _build_head(self, config: Any) -> None:
        """The final RMSNorm and the untied LM head [V, D] after the blocks, then embedding and head drawn from
        N(0, init_std) (ESSH and the Transformer++ baselines; nothing is drawn on the meta device)."""
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight, std=config.init_std)
            if self.lm_head is not None:
                nn.init.normal_(self.lm_head.weight, std=config.init_std)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden states: [..., D] -> [..., V] (tied: the embedding matrix); the first
        call after a deferred load waits for the weights' checksum (``verified``)."""
        if not torch.compiler.is_compiling() and self._weights_check is not None:   # no guard in compiled code
            self.verified()
        return F.linear(h, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def verified(self) -> ElasticModel:
        """Wait for the checksum of the weights that ``from_pretrained(defer_verify=True)`` left running; a
        mismatch is its ``CheckpointError``, raised again on every later call (the weights stay refused)."""
        check = self._weights_check
        if check is not None:
            check.result()
            self._weights_check = None
        return self

    def is_meta(self) -> bool:
        return any(p.device.type == "meta" for p in self.parameters())

    @property
    def device(self) -> torch.device:
        """Where the model's weights live (the embedding's device), as Hugging Face models report it."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weight matrices (the embedding's); modal tables may stay float32 beside bf16."""
        return next(self.parameters()).dtype

    def _config_json(self) -> dict[str, Any]:
        from .. import __version__

        out = {
            "format": "elastic_ssm",
            "format_version": model_dir.FORMAT_VERSION,
            "library_version": __version__,
            "arch": self.arch,
            "config": self.config.to_dict(),
            "tiers": [dataclasses.asdict(t) for t in self.tier_table()],
            "source": self.source,
        }
        if self.tokenizer is not None:
            from ..data.tokenizers import tokenizer_record

            out["tokenizer"] = tokenizer_record(self.tokenizer)
        elif self.tokenizer_record is not None:
            out["tokenizer"] = self.tokenizer_record
        # Special ids for transformers: the model config's where it has the field (eos is where our generate
        # stops; -1 = none), else the tokenizer's.
        tok = out.get("tokenizer") or {}
        specials = {}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            own = getattr(self.config, key, None)
            value = own if own is not None and (own >= 0 or key == "eos_token_id") else tok.get(key)
            specials[key] = value if value is not None and value >= 0 else None
        out.update(model_dir.hf_keys(self), vocab_size=self.config.vocab_size, **specials)
        return out

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write ``model.safetensors``, the tokenizer files, a model card (standalone exports) and ``config.json``
        (it names the weights' size and digests, so a directory overwritten only halfway is detected) into ``path``.
        Every file is first written whole into a staging folder inside ``path``, then moved in, ``config.json`` last:
        a model saved there before stays loadable until then (an error or Ctrl-C on the way leaves it as it was).
        ``state_dict`` replaces the model's tensors (e.g. gathered from FSDP shards)."""
        from safetensors.torch import save

        from ..data.tokenizers import META_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, save_tokenizer_files

        self.verified()                 # weights that failed their checksum are never written out
        path = Path(path)
        parent = self.source.get("parent") if self.source.get("tier") else None
        if parent and path.is_dir() and Path(parent).is_dir() and path.samefile(parent):
            raise ValueError(f"save_pretrained({str(path)!r}): that directory holds the model this tier "
                             f"{self.source['tier']} was read from, which writing it there would replace; save the "
                             "tier into another directory")
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_pretrained({str(path)!r}): that is a file; a model is saved into a directory: "
                             "give another path")
        state = self.state_dict() if state_dict is None else state_dict
        meta = next((k for k, v in state.items() if v.device.type == "meta"), None)
        if meta is not None:
            raise ValueError(f"save_pretrained: tensor {meta} is on the meta device (no values); load or initialise "
                             "the weights first (from_pretrained, load_state_dict(..., assign=True))")
        path.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=path, prefix=".save.", suffix=".tmp"))   # a temp name (utils.files)
        try:
            tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            blob = save(tensors, metadata={"format": "pt"})   # one key: safetensors writes a map in no fixed order
            digest = atomic_write_bytes(staging / WEIGHTS_NAME, blob)
            stale: set[str] = set()
            if self.tokenizer is not None or self.tokenizer_record is None:   # none at all: remove another model's
                stale = {TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, META_FILE} - set(
                    save_tokenizer_files(self.tokenizer, staging))
            if self.source.get("tier"):       # a standalone export: write its model card
                atomic_write_bytes(staging / "README.md", tiers_mod.model_card(self).encode())
            for name, text in model_dir.remote_code(self.arch).items() if model_dir.hf_keys(self) else ():
                atomic_write_bytes(staging / name, text.encode())  # trust_remote_code=True loads it without our import
            # Size and checksum tie config.json to its weights: a directory overwritten only halfway and same-size
            # bit rot are both detected on load.
            text = json.dumps({**self._config_json(), "weights_bytes": len(blob), "weights_sha256": digest,
                               "weights_sha256_pieces": model_dir.pieces_record(blob)}, indent=2)
            atomic_write_bytes(staging / CONFIG_NAME, text.encode())
            for name in sorted(os.listdir(staging), key=lambda n: n == CONFIG_NAME):   # config.json last
                os.replace(staging / name, path / name)
            for name in stale:
                (path / name).unlink(missing_ok=True)
            fsync_dir(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return path

    @classmethod
    def read_config(cls, path: str | Path) -> tuple[ConfigBase, dict[str, Any]]:
        """The model config and the whole ``config.json`` record of a saved directory (``read_model_meta``); a
        record of another arch, or a config the file holds that does not validate, is a ``CheckpointError``
        naming the file."""
        meta = model_dir.read_model_meta(path)
        if meta["arch"] != cls.arch:
            raise CheckpointError(f"{path} holds a {meta['arch']!r} model; load it with the matching class "
                                  "(or es.models.load_pretrained, which picks it)")
        try:
            return cls.config_class.from_dict(meta["config"]), meta
        except ConfigError as e:
            raise CheckpointError(f"{Path(path) / CONFIG_NAME}: the model config it holds is invalid ({e}); the "
                                  "file is corrupted or was edited by hand: save the model again") from e

    @classmethod
    def from_pretrained(
        cls, path: str | Path, tier: TierLike = None, device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None, verify: bool = True, defer_verify: bool | None = None,
    ) -> ElasticModel:
        """Load a saved model; with ``tier`` only that tier's tensor prefixes are loaded. ``verify`` checks the
        weights against ``config.json``'s sha256 digests on threads beside the load (``model_dir.verify_sha256``); a
        mismatch is a ``CheckpointError`` naming the file. ``defer_verify`` (None: on CUDA) returns before the check
        ends: it goes on beside the first forward, and every output waits for it (``verified``), so corrupted
        weights never give a result."""
        path = Path(path)
        checked_device(device, "from_pretrained(device=)")
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1   # not float8
        if dtype is not None and not floating:
            raise TypeError(f"from_pretrained(dtype=) takes a floating torch.dtype (torch.float32, torch.bfloat16, "
                            f"...; float8 weights: quantize with torchao) or None (as saved), got {dtype!r}")
        config, meta = cls.read_config(path)
        wfile = path / WEIGHTS_NAME
        if not wfile.is_file():
            what = "is a folder, not the weights file" if wfile.exists() else "is missing"
            raise CheckpointError(f"{path}: its {WEIGHTS_NAME} {what}; a directory written by save_pretrained holds "
                                  "it beside config.json: copy the whole directory again, or save the model again")
        expected = meta.get("weights_bytes")
        if expected is not None and wfile.stat().st_size != expected:
            raise CheckpointError(f"{wfile} has {wfile.stat().st_size} bytes but {CONFIG_NAME} was written with a "
                                  f"{expected}-byte weights file: the file is truncated or corrupted, or the "
                                  "directory was partially overwritten; save the model again")
        check = None
        if verify and meta.get("weights_sha256"):
            pool = ThreadPoolExecutor(1)
            check = pool.submit(model_dir.verify_sha256, wfile, meta["weights_sha256"],
                                meta.get("weights_sha256_pieces"))
            pool.shutdown(wait=False)
        model_dir.check_config_fits_weights(config, wfile)   # before the model is built from the config
        rules, full = [], []                        # the tier's prefixes, and those of the full model
        source = dict(meta.get("source") or {})
        t = model_dir._tier_of_directory(config, tier, source, path) if tier is not None else None
        if t is not None:
            rules, full = cls.slice_rules(config, t), cls.slice_rules(config, tiers_mod.resolve_tier(config, None))
            source = {"parent": str(path), "tier": t.name, "parent_config": config.to_dict()}
            config = cls.tier_config(config, t)
        if torch.device(device).type == "cuda":   # both overlap the load and the decoder build (first prefill)
            from ..ops.dispatch import hash_triton_key_in_background

            hash_triton_key_in_background(fla=cls.scans_with_fla)   # triton's import, then fla's beside the key
        with torch.device("meta"):
            model = cls(config)
        read = False
        try:
            state = load_sliced_safetensors(wfile, rules, device=device, full=full)
            read = True
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() and (dtype.itemsize > 4 or   # float64: every one
                                                                  not re.fullmatch(cls.keep_fp32, k)) else v
                         for k, v in state.items()}
            _check_loaded_values(state, cls.keep_fp32, wfile)
        except Exception as e:  # safetensors raises several types on corruption
            if check is not None:
                check.result()  # the checksum names the corruption first
            if read:            # read, but values no saved model holds (_check_loaded_values)
                raise
            if isinstance(e, ValueError):   # a tensor of another size than the config's (read, not corrupted)
                raise CheckpointError(f"{e}; the weights do not match {CONFIG_NAME}: save the model again") from e
            raise CheckpointError(f"{wfile} could not be read ({e}); the file is corrupted or truncated") from e
        if defer_verify is None:
            defer_verify = torch.device(device).type == "cuda"
        if check is not None and not defer_verify:
            check.result()
        _load_strict(model, state, wfile)
        model._weights_check = model_dir.PendingCheck(check) if defer_verify and check is not None else None
        model.source = source
        model.name_or_path = str(path)
        model.tokenizer_record = meta.get("tokenizer")
        model.tokenizer = model_dir._saved_tokenizer(path, model.tokenizer_record)
        return model.eval()


def _check_loaded_values(state: dict[str, torch.Tensor], keep_fp32: str, origin: Any) -> None:
    """``CheckpointError`` for weights no saved model holds: a floating tensor of another dtype than the rest
    (``keep_fp32`` tensors may be float32 beside a lower precision), or NaN / infinite values."""
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    main = {k: v.dtype for k, v in floats.items() if not re.fullmatch(keep_fp32, k)}
    common = Counter(main.values()).most_common(1)[0][0] if main else None      # the dtype most tensors hold
    odd = next((k for k, d in main.items() if d != common), None) or next(
        (k for k, v in floats.items() if k not in main and v.dtype not in (common, torch.float32)), None)
    if odd is not None:
        raise CheckpointError(f"{origin}: tensor {odd} is {floats[odd].dtype} while the model's other weights are "
                              f"{common}; the file was edited or mixes two models: save the model again, or load "
                              "with dtype= (--dtype) to convert every tensor")
    sums = [v.sum(dtype=torch.float32) for v in floats.values()]   # NaN/inf whenever a value is; one host read
    finite = torch.stack(sums).isfinite().tolist() if sums else []   # for all (not one per tensor, on CUDA)
    bad = next((k for k, ok in zip(floats, finite)                    # isfinite() rules out an overflowing sum
                if not ok and not bool(torch.isfinite(floats[k]).all())), None)
    if bad is not None:
        raise CheckpointError(f"{origin}: tensor {bad} holds NaN or infinite values; the training run diverged or "
                              "the file is damaged: load an earlier checkpoint")


def _older_layout(expected: Any, given: Any, origin: Any) -> str | None:
    """The one-line refusal of tensors saved before the projections became ``nn.Linear`` modules (commit 5572818:
    ``mixer.in_proj`` where the model holds ``mixer.in_proj.weight``), or None when ``given`` is not such a set."""
    old = next((k for k in given if f"{k}.weight" in expected and k not in expected), None)
    return None if old is None else (
        f"{origin} holds {old} where this version has {old}.weight: it was written before the projections became "
        "nn.Linear modules (commit 5572818), a layout this version does not read; load it once with elastic_ssm at a "
        "commit from 5572818 to 8e29349 (they convert it on load) and save_pretrained it again")


def _refuse_older_layout(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook of the elastic models: a state dict of the older layout (a training checkpoint
    written before commit 5572818) is refused in one line, not with torch's list of missing and unexpected keys."""
    given = [k[len(prefix):] for k in state if k.startswith(prefix)]
    message = _older_layout(set(module.state_dict()), given, "the state dict")
    if message:
        raise ValueError(message)


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], origin: Any) -> None:
    expected = model.state_dict()
    older = _older_layout(set(expected), state, origin)
    if older:
        raise CheckpointError(older)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{origin} does not match the model config: missing tensors {missing[:5]}"
                              f"{'...' if len(missing) > 5 else ''}, unexpected tensors {unexpected[:5]}")
    for k, v in expected.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise CheckpointError(f"{origin}: tensor {k} has shape {tuple(state[k].shape)}, the config expects "
                                  f"{tuple(v.shape)}")
        if v.is_floating_point() != state[k].is_floating_point():   # torch would fail inside its copy, naming no file
            raise CheckpointError(f"{origin}: tensor {k} is {state[k].dtype}, the model holds {v.dtype} there; the "
                                  "file was edited or is not this model's: save the model again")
    model.load_state_dict(state, strict=True, assign=True)


def export_state(model: ElasticModel, tier: tiers_mod.Tier) -> dict[str, torch.Tensor]:
    """The retained tensors of ``tier`` as independent (cloned) tensors."""
    return slice_state_dict(model.state_dict(), type(model).slice_rules(model.config, tier), clone=True)
