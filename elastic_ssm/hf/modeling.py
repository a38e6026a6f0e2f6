"""``ElasticHFConfig`` / ``ElasticForCausalLM`` (what every family shares; ``families.py``) and ESSH's. ``forward``
takes ``input_ids`` [B, T], a left-padding ``attention_mask``, ``labels`` and a ``cache``: with none and
``use_cache`` one is allocated and prefilled; with a prefilled one each token is one ``step`` (``ESSH.generate``'s
calls in its order, so HF ``generate`` gives our tokens). ``ESSHHFCache``: our ``ESSHCache`` behind
``transformers.Cache`` (docs/huggingface.md, "What is inside"); a recurrent state cannot be rolled back."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import GENERATION_CONFIG_NAME

from ..elastic.tiers import tier_table
from ..models import model_class
from ..models.cache import ESSHCache
from ..models.model_dir import FAMILIES
from ..utils.environment import auto_device

__all__ = ["ESSHForCausalLM", "ESSHHFCache", "ESSHHFConfig", "ElasticForCausalLM", "ElasticHFConfig"]

#: the cache's name in transformers' forward() and outputs (``cache`` since 5.x, before: ``past_key_values``)
CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


#: ``ESSH.generate``'s defaults (greedy; sampling at temperature 1, no top-p cut). ``top_k`` stays unset (a 0
#: beside ``do_sample=False`` makes transformers warn); ``_prepare_generation_config`` makes an unasked one 0.
GENERATION_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_p": 1.0}


@contextlib.contextmanager
def recording_hidden(model: Any, on: bool):
    """Yield the list transformers' ``hidden_states`` is made from (``hidden_tuple``): the input of each block's
    first norm (the embedding output, then each block's output) and the final norm's output, per call of the trunk
    or of ``step`` while inside (a compiled trunk runs eagerly, since it would skip the hooks)."""
    seen: list[torch.Tensor] = []
    if not on:
        yield seen
        return
    final = model.norm_f if hasattr(model, "norm_f") else model.norm
    hooks = [(b.norm1 if hasattr(b, "norm1") else b.ln1).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
             for b in model.blocks] + [final.register_forward_hook(lambda m, a, out: seen.append(out))]
    try:
        with torch.compiler.set_stance("force_eager"):
            yield seen
    finally:
        for h in hooks:
            h.remove()


def hidden_tuple(seen: list[torch.Tensor], n_layers: int) -> tuple[torch.Tensor, ...]:
    """``n_layers + 1`` tensors [B, T, D] of a ``recording_hidden`` list (decode steps joined along T)."""
    if not seen or len(seen) % (n_layers + 1):
        raise RuntimeError(f"output_hidden_states=True recorded {len(seen)} tensors, not a multiple of "
                           f"n_layers + 1 = {n_layers + 1}; call the model without it")
    return tuple(torch.cat([h.reshape(h.shape[0], -1, h.shape[-1]) for h in seen[i::n_layers + 1]], 1)
                 for i in range(n_layers + 1))


class _NoRollbackCache(Cache):
    """Our caches' common part: ``n_layers`` layers, beam edits by ``_apply(fn)``, no rollback."""

    is_compileable = is_croppable = False
    is_initialized = True

    def __init__(self, n_layers: int) -> None:
        super().__init__(layers=[])
        self.n_layers, self.prefilled = n_layers, False

    def __len__(self) -> int:
        return self.n_layers

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.prefilled

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.n_layers

    def _apply(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(f"this cache cannot be rolled back by {tokens_to_remove} tokens (assisted "
                                      "decoding is not supported)")

    def activate_past_recording(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("this cache cannot record past states (assisted decoding is not supported)")


class ESSHHFCache(_NoRollbackCache):
    """Decoding state of ``batch_size`` sequences of one ESSH as loaded, for ``transformers`` generation (the
    dtypes of ``ESSHCache.allocate``)."""

    def __init__(self, model: Any, batch_size: int) -> None:
        super().__init__(model.config.n_layers)
        self.inner = ESSHCache.allocate(model, batch_size)

    def __repr__(self) -> str:
        n = self.inner.nbytes()
        return (f"ESSHHFCache(batch={self.inner.batch}, tier={self.inner.tier.name}, seen={self.get_seq_length()}, "
                f"recurrent={n['recurrent']:,} B, kv={n['kv']:,} B)")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the longest sequence (left padding does not count)."""
        return int(self.inner.positions.max()) if self.prefilled else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1                                         # fixed-size state: no length limit

    batch_size = property(attrgetter("inner.batch"))

    @property
    def is_sliding(self) -> list[bool]:
        return [i not in self.inner.states for i in range(self.n_layers)]   # an SWA layer's key/value ring

    @property
    def is_linear(self) -> list[bool]:
        return [i in self.inner.states for i in range(self.n_layers)]       # a spectral layer's mode state

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``recurrent``, ``kv`` and ``total`` (equals ``elastic.tiers.state_bytes`` x batch)."""
        return self.inner.nbytes()

    def _apply(self, fn) -> None:
        self.inner.apply_(fn)

    def reset(self) -> None:
        self.inner.reset_()
        self.prefilled = False


class ElasticHFConfig(PretrainedConfig):
    """A directory's ``config.json`` for ``transformers`` (a family subclass per ``model_type``): ``config`` (the
    model config's fields), ``tiers`` (the tier table), ``tier`` (the one to load; None or ``"full"``: as saved)."""

    model_type = "essh"
    config: dict | None = None
    tiers: list | None = None
    tier: str | None = None
    arch: str = "essh"
    vocab_size: int = 260
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        if self.config is None:
            self.config = model_class(self.arch).config_class.preset("tiny").to_dict()
        cfg = self.model_config()
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.max_position_embeddings = getattr(cfg, "seq_len", None)    # ES-SSM's filter length L; others: none
        self.tie_word_embeddings = cfg.tie_embeddings
        if self.tiers is None:
            self.tiers = [dataclasses.asdict(t) for t in tier_table(cfg)]
        self.tier = tier_name(self.tier)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):     # our configs use -1 for "none"
            if getattr(self, name) is not None and getattr(self, name) < 0:
                setattr(self, name, None)
        super().__post_init__(**kwargs)

    def model_config(self) -> Any:
        """The model config this config describes (the saved model's, before any ``tier`` cut)."""
        return model_class(self.arch).config_class.from_dict(dict(self.config))

    @classmethod
    def from_model(cls, model: Any, tier: str | None = None) -> ElasticHFConfig:
        """The config of a loaded model (its own, possibly standalone, config and its tokenizer ids)."""
        meta = model._config_json()
        keep = {k: meta[k] for k in ("config", "tiers", "arch", "vocab_size", "bos_token_id", "eos_token_id",
                                     "pad_token_id", "format", "format_version", "source", "tokenizer")
                if k in meta}
        return cls(**keep, tier=tier, architectures=[FAMILIES[model.arch].model_class])


class ESSHHFConfig(ElasticHFConfig):
    """An ESSH directory's config (model_type ``essh``)."""

    model_type = "essh"
    arch: str = "essh"


def tier_name(tier: Any) -> Any:
    """``tier`` with ``"full"`` / ``"none"`` as None; ``ValueError`` for an empty one (it would load the full model)."""
    if isinstance(tier, str) and not tier.strip():
        raise ValueError(f"tier={tier!r} is empty: give a tier name such as 'T4' (config.tiers lists them), "
                         "'full', or leave tier out for the model as saved")
    return None if tier in ("full", "none") else tier


def _device(device_map: Any) -> str:
    """The single device of a ``device_map`` (this wrapper does not split a model across devices)."""
    if device_map is None:
        return "cpu"
    if isinstance(device_map, dict):
        devices = {str(v) for v in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"ESSHForCausalLM loads onto one device; got device_map={device_map!r}")
        device_map = devices.pop()
    if device_map == "auto":
        return auto_device()[0]         # never mps (no float64)
    return f"cuda:{int(device_map)}" if isinstance(device_map, int) or str(device_map).isdigit() else str(device_map)


class ElasticForCausalLM(PreTrainedModel, GenerationMixin):
    """One of our models behind ``transformers``' causal-LM API (a family subclass each)."""

    config_class = ElasticHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True
    _supports_cache_class = True
    #: the ``transformers.Cache`` subclass ``allocate_cache`` returns (``forward`` refuses any other)
    cache_class: type = Cache

    def __init__(self, config: ElasticHFConfig, model: Any = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else model_class(config.arch)(config.model_config())
        self.post_init()
        if self.can_generate():
            self.generation_config.update(**GENERATION_DEFAULTS)
            if config.eos_token_id is not None:   # finished rows repeat eos, as ESSH.generate does
                self.generation_config.pad_token_id = config.eos_token_id

    def _prepare_generation_config(self, generation_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' merge of the call's and the model's generation settings, except that an unasked
        ``top_k`` is 0 (no top-k cut, as in ``ESSH.generate``) instead of transformers' global default 50, and an
        unasked ``pad_token_id`` is the (first) ``eos_token_id`` of the call, as in ``ESSH.generate``."""
        out = super()._prepare_generation_config(generation_config, *args, **kwargs)
        asked = kwargs.get("top_k", getattr(generation_config, "top_k", None))
        if asked is None and self.generation_config.top_k is None:
            out[0].top_k = 0
        eos = out[0].eos_token_id
        first = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
        if first is not None and kwargs.get("pad_token_id", getattr(generation_config, "pad_token_id", None)) is None:
            out[0].pad_token_id = first
        return out

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: the ESSH initialises its own parameters, and loading assigns the saved ones."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                       # forward allocates an ESSHHFCache itself (no KV DynamicCache)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *model_args: Any, tier: str | None = None,
                        config: ElasticHFConfig | None = None, device_map: Any = None, dtype: Any = None,
                        torch_dtype: Any = None, **kwargs: Any) -> ElasticForCausalLM:
        """Load one of our model directories; ``tier`` (or ``config.tier``) reads only that tier's prefixes;
        ``device_map`` (one device), ``dtype`` / ``torch_dtype`` and ``generation_config`` (else the directory's
        ``generation_config.json``), ``subfolder`` and ``output_loading_info`` as in ``transformers``; quantization
        options refused, hub keywords ignored."""
        path = Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "")
        asked = [k for k in ("quantization_config", "load_in_8bit", "load_in_4bit") if kwargs.get(k)]
        if asked:
            raise ValueError(f"{cls.__name__}.from_pretrained does not apply {asked[0]}=; load the float model and "
                             "quantize it with torchao's quantize_ (docs/architecture.md, 'Standard modules')")
        if not (path / "config.json").is_file():
            raise OSError(f"{path} is not a local elastic_ssm model directory (no config.json); our models load "
                          "from a directory written by save_pretrained (a training run's final/, an export)")
        tier = tier_name(tier if tier is not None else getattr(config, "tier", None))
        dtype = torch_dtype if dtype is None else dtype
        dtype = None if dtype == "auto" else getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype
        model = model_class(cls.config_class.arch).from_pretrained(path, tier=tier, device=_device(device_map),
                                                                   dtype=dtype)
        out = cls(cls.config_class.from_model(model, tier=tier), model=model)
        gen = kwargs.get("generation_config")          # else the directory's generation_config.json, as transformers
        if gen is None and (path / GENERATION_CONFIG_NAME).is_file():
            gen = GenerationConfig.from_pretrained(path)
        if gen is not None:
            out.generation_config = copy.deepcopy(gen)
        out.config.name_or_path = str(path)
        out.name_or_path = str(path)
        if kwargs.get("output_loading_info"):          # every tensor is loaded or the load fails: nothing to report
            return out.eval(), {k: [] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
        return out.eval()

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        """Write our format (weights, tokenizer, ``config.json`` readable by both loaders); a tier is never written
        over the directory it was read from (``ElasticModel.save_pretrained``), and ``generation_config.json``."""
        self.model.save_pretrained(save_directory)
        self.generation_config.save_pretrained(save_directory)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.model.lm_head

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """Refused before anything changes (transformers' own resize half-resized the embedding, then failed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resize its token embeddings (vocab_size "
                                  f"{self.config.vocab_size} is fixed by the tokenizer it was trained with); train "
                                  "a model with a larger --model.vocab_size instead")

    tokenizer = property(attrgetter("model.tokenizer"), doc="The tokenizer saved with the model (or None).")

    def allocate_cache(self, batch_size: int, prompt_length: int = 0) -> Any:
        """The family's ``transformers.Cache`` around our cache (``.inner``), for ``batch_size`` sequences."""
        raise NotImplementedError(f"{type(self).__name__} defines no cache; use a family class (ESSHForCausalLM, "
                                  "elastic_ssm.hf.families)")

    def _inner_for_prefill(self, cache: Any, input_ids: torch.Tensor) -> Any:
        """Our cache inside ``cache``, ready for the prefill of ``input_ids`` [B, T]."""
        return cache.inner

    def _step(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step: tokens [B] -> logits [B, V]."""
        return self.model.step(tokens, cache.inner)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, inputs_embeds: torch.Tensor | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits [B, T, V] (and ``loss`` with ``labels``, ``cache`` with ``use_cache``, ``hidden_states`` with
        ``output_hidden_states``: ``hidden_tuple``, the last after the final norm; ``return_dict=False``: the tuple
        of those given, loss first, as transformers' models); see the module docstring."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError(f"{type(self).__name__} takes input_ids (inputs_embeds is not supported)")
        cache = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
        if cache is not None and not isinstance(cache, self.cache_class):
            raise TypeError(f"{type(self).__name__} needs the cache its generate allocates (or none), got "
                            f"{type(cache).__name__}")
        use_cache = bool(use_cache) or cache is not None      # generate passes use_cache=True; scoring needs none
        record = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        with recording_hidden(self.model, record) as seen:
            if cache is not None and cache.prefilled:
                logits = torch.stack([self._step(tok, cache) for tok in input_ids.unbind(1)], dim=1)
            else:
                mask = attention_mask
                if mask is not None and bool(mask.bool().all()):
                    mask = None                # no padding: the same call as ESSH.generate without a mask
                if use_cache and cache is None:
                    cache = self.allocate_cache(*input_ids.shape)
                inner = self._inner_for_prefill(cache, input_ids) if use_cache else None
                logits = self.model(input_ids, attention_mask=mask, cache=inner)
                if use_cache:
                    cache.prefilled = True
        hidden = hidden_tuple(seen, len(self.model.blocks)) if record else None
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden,
                                     **{CACHE_KEY: cache if use_cache else None})
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, next_sequence_length: int | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = True,
                                      **kwargs: Any) -> dict[str, Any]:
        """Prefill with the whole prompt, then feed only the tokens the cache has not seen."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.prefilled:
            input_ids = input_ids[:, -(next_sequence_length or 1):]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": use_cache,
                  "output_hidden_states": kwargs.get("output_hidden_states")}
        if cache is not None:
            inputs[CACHE_KEY] = cache
        return inputs


class ESSHForCausalLM(ElasticForCausalLM):
    """An ESSH behind ``transformers``: decodes with an ``ESSHHFCache`` (mode states and window rings)."""

    config_class = ESSHHFConfig
    cache_class = ESSHHFCache
    _no_split_modules = ["ESSHBlock"]

    def allocate_cache(self, batch_size: int, prompt_length: int = 0) -> ESSHHFCache:
        return ESSHHFCache(self.model, batch_size)
