"""The model card (``README.md``) written by ``save_pretrained`` into every exported tier directory: the tier and
its parent's sizes, exact parameter count, decoding state in bytes (ESSH Table 53), tokenizer, quality when
known, and how to load the directory with this library and with Hugging Face ``transformers``."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..config import model_config_from_dict
from . import tiers as tiers_mod

__all__ = ["model_card"]

#: what a tier of each arch keeps (Transformer++ / MatFormer: nested FFN units only)
RETAINED = {"essh": "spectral-channel and feed-forward", "es_ssm": "spectral-channel"}


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    return f"{n:,} B ({n / 1024:.1f} KiB)" if n < 2**20 else f"{n:,} B ({n / 2**20:.1f} MiB)"


def model_card(model: Any, quality: dict[str, float] | None = None) -> str:
    """Markdown text of the card of ``model`` (a standalone export). ``quality``: metric name -> value
    (e.g. held-out bits per byte), printed when given; else the card says it was not measured."""
    cfg, source = model.config, model.source or {}
    tier = source.get("tier", "full")
    params = model.num_parameters()
    state = tiers_mod.state_bytes(cfg)
    tok = model.tokenizer
    loader = "models.load_pretrained"
    tok_line = "none saved (pass one with --tokenizer)" if tok is None else \
        f"{'byte-level (bytes 0-255 + 4 specials)' if tok.vocab_size <= 260 else 'BPE'}, {tok.vocab_size:,} ids " \
        f"(`tokenizer.json`, `tokenizer_config.json`)"
    lines = [
        f"# elastic_ssm {model.arch.upper()} export, tier {tier}",
        "",
        f"A standalone {model.arch} model cut from a shared elastic model at tier **{tier}** "
        "(train once, export many): it holds only the retained "
        f"{RETAINED.get(model.arch, 'feed-forward')} prefixes.",
        "",
        "| | |",
        "|---|---|",
        f"| tier | {tier} |",
        f"| parameters | {params:,} |",
    ]
    parent = source.get("parent_config")
    if parent:
        pcfg = model_config_from_dict({"arch": model.arch, **parent})
        lines.append(f"| parameters of the shared model | {tiers_mod.num_parameters(pcfg):,} |")
    if model.arch == "essh":
        lines += [f"| spectral channels K / FFN width | {cfg.n_channels} / {cfg.d_ff} |",
                  f"| layers / width / vocabulary | {cfg.n_layers} / {cfg.d_model} / {cfg.vocab_size:,} |"]
    detail = {"essh": f"recurrent {_size(state['recurrent'])} fp32, window ring {_size(state['kv'])} bf16",
              "es_ssm": "the last L-1 normalised inputs per block, fp32"}.get(
        model.arch, "bf16 K and V of every layer at 2048 tokens of context (full attention)")
    lines += [f"| decoding state per sequence | {_size(state['total'])} ({detail}) |", f"| tokenizer | {tok_line} |"]
    if quality:
        lines += [f"| {k} | {v:.4f} |" for k, v in quality.items()]
    else:
        lines.append("| quality | not measured at export (`elastic-ssm eval DIR`) |")
    lines += [
        "",
        "## Load with elastic_ssm",
        "",
        "```python",
        "import elastic_ssm as es",
        f"model = es.{ {'essh': 'ESSH.from_pretrained', 'es_ssm': 'ESSSM.from_pretrained'}.get(model.arch, loader)}"
        "(\"DIR\")          # model.tokenizer is the saved tokenizer",
        "ids = model.tokenizer.encode(\"def main():\")",
    ]
    if model.arch == "essh":
        lines += ["import torch",
                  "out = model.generate(torch.tensor([ids]), max_new_tokens=32)",
                  "print(model.tokenizer.decode(out[0].tolist()))",
                  "```",
                  "",
                  "Command line: `elastic-ssm generate DIR --prompt \"def \"`, `elastic-ssm eval DIR`.",
                  "",
                  "## Load with Hugging Face transformers (`pip install 'elastic-ssm[hf]'`)",
                  "",
                  "```python",
                  "import elastic_ssm.hf  # registers model_type 'essh' with AutoConfig / AutoModelForCausalLM",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(\"DIR\")",
                  "model = AutoModelForCausalLM.from_pretrained(\"DIR\")",
                  "out = model.generate(**tok(\"def main():\", return_tensors=\"pt\"), max_new_tokens=32)",
                  "```"]
    else:
        lines += ["import torch", "logits = model(torch.tensor([ids]))", "```"]
    lines += ["", f"Written by elastic_ssm {__version__}."]
    return "\n".join(lines) + "\n"
