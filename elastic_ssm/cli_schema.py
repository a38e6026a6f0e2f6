"""The options of every ``elastic-ssm`` verb, as keyword-only dataclasses built from shared groups; tyro derives
the flags. What a type cannot say sits in ``flag``'s metadata (``minimum``, ``above``, ``maximum``, ``output``), and
``cli.check_options`` checks it before a verb runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from tyro.conf import Positional, arg

from .cli_util import DEVICE_HELP

#: the run file of ``train`` / ``recover`` without ``--config`` (and of ``quickstart``)
DEFAULT_RUN = Path(__file__).resolve().parent / "configs" / "quickstart.yaml"
MODEL_DIR = "model directory (save_pretrained / a run's final/)"
TOKENIZER_HELP = ("default: the tokenizer saved with the model (bytes when it has none); 'bytes', a tokenizer.json "
                  "or folder names one for a model saved without one; one that differs from the saved one is refused")
ModelDir = Annotated[str, Positional, arg(metavar="MODEL_DIR")]


def flag(default: Any = dataclasses.MISSING, help: str = "", *, minimum: float | None = None,
         above: float | None = None, maximum: float | None = None,
         output: str | None = None, metavar: str | None = None) -> Any:
    """A verb option: its default (none: required), a one-line ``help`` and the checks a type cannot state
    (``cli.check_options``); ``metavar`` names a positional argument in messages."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a default of several values")
    meta = {"help": help, "minimum": minimum, "above": above, "maximum": maximum,
            "output": output, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


# ---- shared groups ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DeviceOptions:
    device: str = flag("auto", DEVICE_HELP)


@dataclass(kw_only=True)
class DtypeOptions:
    dtype: Literal["auto", "float32", "bfloat16"] = flag(
        "auto", "weights: auto = bfloat16 on CUDA (the fused decoder's format), float32 on CPU")


@dataclass(kw_only=True)
class PrecisionOptions:
    precision: Literal["fp32", "bf16"] = flag("fp32", "fp32, or bf16 = autocast of the float32 weights")


@dataclass(kw_only=True)
class TokenizerOptions:
    tokenizer: str | None = flag(None, TOKENIZER_HELP)


@dataclass(kw_only=True)
class TiersOptions:
    tiers: str = flag("all", "'all' or comma-separated tier names (T1,T4,T10; ES-SSM K8 or a budget 8)")


@dataclass(kw_only=True)
class QuietOptions:
    quiet: bool = flag(False, "no progress bars on stderr (they show only when stderr is a terminal; the results "
                              "on stdout are the same either way)")


@dataclass(kw_only=True)
class CsvOptions:
    csv: str | None = flag(None, "also write the rows as CSV to this file (an existing one is refused without "
                                 "--overwrite)", output="file")
    overwrite: bool = flag(False, "replace an existing --csv file; refused otherwise (a file not named *.csv, such "
                                  "as a model's config.json, never is)")


@dataclass(kw_only=True)
class ModelDirOptions:
    checkpoint: ModelDir = flag(help=MODEL_DIR, metavar="MODEL_DIR")


@dataclass(kw_only=True)
class HeldOutOptions(ModelDirOptions, TokenizerOptions, DeviceOptions, QuietOptions):
    """A model directory scored on fixed held-out windows of a text source (``eval``, ``importance``)."""

    data: str = flag("stdlib", "source (see `elastic-ssm train --help`, data.source)")
    split: str = flag("validation", "split of the source to evaluate")
    seq_len: int | None = flag(None, "tokens per evaluation sequence (default: 512, or the model's longest sequence "
                                     "when that is shorter: an ES-SSM's filter length seq_len)", minimum=1)
    batch_size: int = flag(8, "sequences per batch", minimum=1)
    n_batches: int = flag(16, "number of batches (fixed windows)", minimum=1)
    bytes_per_token: float = flag(0.0, "divisor of bits per byte (0: 1 for bytes, measured on the data for BPE)",
                                  minimum=0)


@dataclass(kw_only=True)
class TierBudgetOptions:
    """The budgets ``--tier auto`` is chosen under (``es.select_tier``)."""

    max_ms_per_token: float | None = flag(None, "--tier auto: latency budget per stream (needs tier_profile.json: "
                                                "elastic-ssm calibrate)", above=0)
    max_state_bytes: int | None = flag(None, "--tier auto: state budget per sequence", minimum=1)
    max_params: int | None = flag(None, "--tier auto: parameter budget", minimum=1)
    budget_batch: int = flag(1, "--tier auto: decode batch the budget is for", minimum=1)


# ---- commands --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainOptions(QuietOptions):
    """``train``: the run file and how the run directory is treated (settings: --model.* --train.* --data.*)."""

    config: str | None = flag(None, f"run YAML (model/train/data sections); default: {DEFAULT_RUN.name}, the "
                                      "quickstart's run file (the defaults --help shows below)")
    resume: Literal["yes", "auto"] | None = flag(
        None, "continue from the latest checkpoint in train.out_dir ('--resume' alone is '--resume yes'); "
              "'--resume auto' starts fresh when there is none yet (for jobs requeued with the same command)")
    overwrite: bool = flag(False, "start fresh in a train.out_dir that holds another run or other files (they are "
                           "moved aside, never deleted)")
    stop_after: int = flag(0, "end this call at step N of the current stage with a checkpoint there and no final "
                              "model (continue with --resume; 0: run to the end)", minimum=0)
    verify_data: bool = flag(False, "re-hash every prepared token file (*.bin) whole against its sidecar's sha256 "
                                    "before training (by default a sampled fingerprint is checked)")


@dataclass(kw_only=True)
class ExportOptions(ModelDirOptions, TiersOptions, DeviceOptions, QuietOptions):
    tiers: str = flag("all", "'all' or comma-separated tier names to export (T1,T4; ES-SSM K8 or a budget 8)")
    out: str = flag(help="output folder; one sub-folder per tier", output="folder")
    check_len: int = flag(128, "tokens per sequence of the export check", minimum=1)
    overwrite: bool = flag(False, "replace tier folders under --out that already hold files (refused otherwise, "
                                  "even for the same model)")


@dataclass(kw_only=True)
class EvalOptions(HeldOutOptions, CsvOptions):
    tiers: str = flag("all", "'all' or comma-separated tier names and capacity fractions in (0, 1] (T1,0.45,T10)")
    lengths: str | None = flag(None, "evaluate at several sequence lengths instead of --seq_len: multiples of the "
                                     "training length (1x,2x,4x,8x) and/or token counts (1024,4096)")
    train_len: int | None = flag(None, "training sequence length for --lengths Nx (default: train.seq_len of the "
                                       "run.yaml above the model directory)", minimum=1)
    write_quality: bool = flag(False, "also record the per-tier quality in the model directory's "
                                      "tier_quality.json, which select_tier and serve --tier auto read (off: eval "
                                      "writes only where --csv says)")
    quality_metric: Literal["bpb", "loss", "perplexity", "accuracy"] = flag(
        "bpb", "the quality tier_quality.json records")


@dataclass(kw_only=True)
class ImportanceOptions(HeldOutOptions, PrecisionOptions):
    tier: str = flag("full", "tier whose channels are measured ('full', T4, or a fraction)")
    first: int = flag(8, "channels counted in the first-N share (Table 31: 8)", minimum=1)
    out: str | None = flag(None, "folder for channel_importance.csv/.json/.png (default: MODEL_DIR/importance)",
                           output="folder")
    overwrite: bool = flag(False, "replace the channel_importance.* files an earlier run left in --out (refused "
                                  "otherwise)")


@dataclass(kw_only=True)
class GenerateOptions(ModelDirOptions, TokenizerOptions, DeviceOptions, DtypeOptions, TierBudgetOptions):
    tier: str = flag("full", "tier to load ('full', T1..T10, 'auto'; ES-SSM: a budget 8 or K8)")
    prompt: str = flag(help="text to continue")
    max_new_tokens: int = flag(200, "tokens to sample", minimum=0)
    temperature: float = flag(0.8, "0 = greedy")
    top_k: int | None = flag(None, "sample from the k most likely tokens")
    top_p: float | None = flag(None, "nucleus sampling mass")
    seed: int = flag(0, "sampling seed")


@dataclass(kw_only=True)
class LmEvalOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                    QuietOptions):
    tasks: str = flag(help="comma-separated lm-eval task names (piqa,hellaswag,...)")
    batch_size: int = flag(8, "sequences per forward pass", minimum=1)
    max_length: int = flag(2048, "longest scored input in tokens", minimum=1)
    num_fewshot: int | None = flag(None, "few-shot examples (default: the task's)", minimum=0)
    limit: float | None = flag(None, "documents per task (>= 1) or a fraction (< 1): a smoke run, not a paper number",
                               above=0)
    include_path: str | None = flag(None, "folder of extra task YAML files (local tasks)")


@dataclass(kw_only=True)
class NiahOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                  QuietOptions):
    """``niah``: the fields of ``eval.needle.NeedleConfig`` the command line sets, under their own names."""

    data: str = flag("stdlib", "filler text source (as for eval)")
    split: str = flag("validation", "split of the filler source")
    context_len: int = flag(2048, "tokens per trial before the answer", minimum=1)
    n_pairs: int = flag(256, "key pairs (each runs at every depth)", minimum=1)
    depths: str = flag("0.1,0.3,0.5,0.7,0.9", "comma-separated relative needle depths in [0, 1]")
    condition: Literal["counterfactual", "planted"] = flag(
        "counterfactual", "which key of a pair is inserted and expected (the paper's tables: counterfactual)")
    seed: int = flag(0, "keys, filler windows and bootstrap")
    batch_size: int = flag(8, "sequences per forward pass", minimum=1)


@dataclass(kw_only=True)
class PrepareOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = flag(
        help="'stdlib', a file or folder (txt/jsonl/parquet), or hf:<name>[:cfg][:split]", metavar="SOURCE")
    out: Annotated[str, Positional, arg(metavar="OUT")] = flag(
        help="output token file, e.g. data/train.bin", metavar="OUT", output="file")
    tokenizer: str = flag("bytes", "'bytes' or a tokenizer.json")
    split: str | None = flag(None, "train / validation split of the source (default: all)")
    text_field: str = flag("text", "JSONL/Parquet/HF text field")
    max_tokens: int = flag(0, "stop after this many tokens (0: all)", minimum=0)
    overwrite: bool = flag(False, "replace an existing OUT (and its .json sidecar); refused otherwise")


@dataclass(kw_only=True)
class TokenizerTrainOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = flag(
        help="corpus source (as for prepare)", metavar="SOURCE")
    vocab_size: int = flag(8192, "vocabulary size", minimum=1)
    out: str = flag(help="output tokenizer.json", output="file")
    max_bytes: int = flag(0, "cap on training text (0: all)", minimum=0)
    overwrite: bool = flag(False, "replace an existing --out file; refused otherwise")


@dataclass(kw_only=True)
class RecoverOptions(TiersOptions, DeviceOptions, QuietOptions):
    """``recover``: the protocol and its knobs (data and training settings: --config, --train.*, --data.*)."""

    parent: Annotated[str, Positional, arg(metavar="PARENT")] = flag(
        help="model directory of the trained (e.g. dense) ESSH", metavar="PARENT")
    protocol: Literal["refine", "label_only", "posthoc"] = flag(   # = train/recover.PROTOCOLS (tested)
        "refine", "refine: shared refinement of the truncated model (Tables 33/43); label_only: "
                  "each tier at its fixed shape with CE only (Table 43); posthoc: E.7 ranking + masked recovery")
    config: str | None = flag(None, "run YAML for data and training settings (default: the quickstart's)")
    steps: int = flag(0, "recovery steps (0: train.refine.steps of the run file)", minimum=0)
    tiers: str = flag("all", "'all' or comma-separated tiers to evaluate (label_only: train)")
    masks: tuple[float, ...] | None = flag(None, "posthoc: mask capacity fractions, full first "
                                                 "(default train.mixing.capacities)")
    calibration_batches: int = flag(16, "posthoc: training micro-batches for the ranking (E.7: 2M tokens)", minimum=1)
    channel_order: Literal["original", "energy"] = flag(
        "original", "posthoc: keep the spectral channels' order (E.7) or rank them by output energy")
    overwrite: bool = flag(False, "move another run in train.out_dir aside")


@dataclass(kw_only=True)
class ServeOptions(ModelDirOptions, TokenizerOptions, TierBudgetOptions, DtypeOptions, DeviceOptions):
    """``serve``: one checkpoint, every tier a prefix view of the same weights (``serve/app.py``)."""

    checkpoint: ModelDir = flag(help="model directory (with its tokenizer)", metavar="MODEL_DIR")
    tiers: str = flag("all", "'all' or comma-separated tiers to serve (T1,T4,T10)")
    tier: str | None = flag(None, "default tier (model id without '@'): one of --tiers or 'auto' (es.select_tier "
                                  "under the budget flags; served too if --tiers lacks it); default: the largest")
    name: str | None = flag(None, "model name in the API (default: the directory's name)")
    host: str = flag("127.0.0.1", "address to bind (default: local only)")
    port: int = flag(8000, "TCP port (0: any free port, named in the start line)", minimum=0, maximum=65535)
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' (or set ELASTIC_SSM_API_KEY)")
    max_batch: int = flag(16, "slots of the one pool every served tier shares: its decode batch", minimum=1)
    max_prefill: int = flag(0, "most waiting prompts (similar lengths, left-padded) prefilled in one forward (0: "
                               "--max_batch; lower bounds the scratch cache of scattered free slots)", minimum=0)
    max_prefill_tokens: int = flag(32768, "most prompt tokens (padding included) in one prefill forward, bounding its "
                                          "memory and the stall of running streams (a longer prompt goes alone)",
                                   minimum=1)
    prefill_wait_ms: float = flag(50.0, "longest (ms) a waiting request is held for more arrivals to share its "
                                        "prefill, unless min(--max_prefill, free slots) wait (0: at once)", minimum=0)
    prefill_graphs: bool = flag(True, "on CUDA, replay prefills of up to --prefill_graph_tokens from CUDA graphs, "
                                      "one per (prompts, length) bucket, captured at its second use")
    prefill_graph_tokens: int = flag(2048, "the largest graphed prefill, in padded prompt tokens (larger ones run "
                                           "eagerly, faster for them: docs/serving.md)", minimum=1)
    attended_spans: bool = flag(True, "while every sequence is shorter than a power of two below the attention "
                                      "window, decode steps read only that prefix of the window caches")
    max_queue: int = flag(64, "requests waiting (all tiers together) before 503", minimum=0)
    max_prompt_tokens: int = flag(8192, "longest prompt accepted", minimum=1)
    max_tokens_limit: int = flag(4096, "largest max_tokens accepted", minimum=1)
    max_body_bytes: int = flag(1 << 20, "largest request body accepted", minimum=1)
    max_connections_per_client: int = flag(32, "concurrent requests per address", minimum=1)
    chat_template: str | None = flag(None, "chat template for /v1/chat/completions: 'chatml', 'plain' or a Jinja "
                                           "file (default: the model directory's own; without one chat is a 400)")
    max_connections: int = flag(1024, "concurrent requests from all clients (503 beyond); open connections are "
                                      "capped at twice this", minimum=1)
    timeout: float = flag(30.0, "seconds a client may take to send its headers, its body, or to read pending "
                                "output before its request is dropped (408) and its slot freed", above=0)
    max_header_bytes: int = flag(65536, "largest request line and headers of one request, in bytes (431 and the "
                                        "connection closed beyond)", minimum=1024)
    allowed_hosts: str | None = flag(None, "comma-separated Host names accepted without --api_key besides "
                                           "localhost, the loopback addresses and --host ('*': any; others: 421)")
    forwarded_allow_ips: str | None = flag(None, "comma-separated addresses of trusted reverse proxies whose "
                                                 "X-Forwarded-For/-Proto name the client ('*': any; default: "
                                                 "none, the headers are ignored)")

@dataclass(kw_only=True)
class CalibrateOptions(ModelDirOptions, TiersOptions, DtypeOptions, DeviceOptions, QuietOptions):
    batches: str = flag("1,16,128", "comma-separated decode batch sizes to time")
    warmup: int = flag(5, "untimed steps per entry", minimum=0)
    iters: int = flag(20, "timed steps per entry", minimum=1)


@dataclass(kw_only=True)
class QuickstartOptions(QuietOptions):
    out: str = flag("runs/quickstart", "output folder", output="folder")
    steps: int = flag(0, "override the training steps (0: config default)", minimum=0)
    config: str | None = flag(None, "run YAML (default: the embedded quickstart config)")
    control: bool = flag(True, "also train the dense control (full capacity only) and truncate it to T1")
    overwrite: bool = flag(False, "move the outputs of an earlier quickstart in --out (runs, exports, report) aside")
    resume: Literal["yes", "auto"] | None = flag(
        None, "continue a stopped quickstart in --out ('--resume' alone is '--resume yes'): finished runs are loaded, "
              "an interrupted one continues from its checkpoint (same --steps / --config); exports and report are "
              "redone; '--resume auto' starts fresh when --out holds no quickstart run")
