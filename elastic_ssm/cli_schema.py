"""The options of every ``elastic-ssm`` verb, as keyword-only dataclasses built from shared groups; tyro derives
the flags. Types, ranges and choices are declared on the annotations (the ``Annotated`` aliases of
``config/base.py``) and checked by pydantic in ``cli.check_options`` before a verb runs, with ``flag``'s ``output``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Interval
from tyro.conf import Positional, arg

from .cli_util import DEVICE_HELP
from .config.base import AtLeast1, NonNeg, NonNegF, Pos
from .config.run import DEFAULT_RUN

MODEL_DIR = "model directory (save_pretrained / a run's final/)"
TOKENIZER_HELP = ("default: the tokenizer saved with the model (bytes when it has none); 'bytes', a tokenizer.json "
                  "or folder names one for a model saved without one; one that differs from the saved one is refused")
ModelDir = Annotated[str, Positional, arg(metavar="MODEL_DIR")]
Port = Annotated[int, Interval(ge=0, le=65535)]


def flag(default: Any = dataclasses.MISSING, help: str = "", *, output: str | None = None,
         metavar: str | None = None) -> Any:
    """A verb option: its default (none: required), a one-line ``help``, ``output`` "file" / "folder" (a path checked
    before the verb runs, ``utils.files.check_output_path``); ``metavar`` names a positional argument in messages."""
    return dataclasses.field(default=default, metadata={"help": help, "output": output, "metavar": metavar})


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
    seq_len: AtLeast1 | None = flag(None, "tokens per evaluation sequence (default: 512, or the model's longest "
                                          "sequence when that is shorter: an ES-SSM's filter length seq_len)")
    batch_size: AtLeast1 = flag(8, "sequences per batch")
    n_batches: AtLeast1 = flag(16, "number of batches (fixed windows)")
    bytes_per_token: NonNegF = flag(0.0, "divisor of bits per byte (0: 1 for bytes, measured on the data for BPE)")


@dataclass(kw_only=True)
class TierBudgetOptions:
    """The budgets ``--tier auto`` is chosen under (``es.select_tier``)."""

    max_ms_per_token: Pos | None = flag(None, "--tier auto: latency budget per stream (needs tier_profile.json: "
                                              "elastic-ssm calibrate)")
    max_state_bytes: AtLeast1 | None = flag(None, "--tier auto: state budget per sequence")
    max_params: AtLeast1 | None = flag(None, "--tier auto: parameter budget")
    budget_batch: AtLeast1 = flag(1, "--tier auto: decode batch the budget is for")


# ---- commands --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class InfoOptions:
    """``info``: no options."""


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
    stop_after: NonNeg = flag(0, "end this call at step N of the current stage with a checkpoint there and no final "
                                 "model (continue with --resume; 0: run to the end)")
    verify_data: bool = flag(False, "re-hash every prepared token file (*.bin) whole against its sidecar's sha256 "
                                    "before training (by default a sampled fingerprint is checked)")


@dataclass(kw_only=True)
class ExportOptions(ModelDirOptions, TiersOptions, DeviceOptions, QuietOptions):
    tiers: str = flag("all", "'all' or comma-separated tier names to export (T1,T4; ES-SSM K8 or a budget 8)")
    out: str = flag(help="output folder; one sub-folder per tier", output="folder")
    check_len: AtLeast1 = flag(128, "tokens per sequence of the export check (an ES-SSM: at most its filter length, "
                                    "the default when shorter)")
    overwrite: bool = flag(False, "replace tier folders under --out that already hold files (refused otherwise, "
                                  "even for the same model)")


@dataclass(kw_only=True)
class EvalOptions(HeldOutOptions, CsvOptions):
    tiers: str = flag("all", "'all' or comma-separated tier names and capacity fractions in (0, 1] (T1,0.45,T10)")
    lengths: str | None = flag(None, "evaluate at several sequence lengths instead of --seq_len: multiples of the "
                                     "training length (1x,2x,4x,8x) and/or token counts (1024,4096)")
    train_len: AtLeast1 | None = flag(None, "training sequence length for --lengths Nx (default: train.seq_len of the "
                                            "run.yaml above the model directory)")
    write_quality: bool = flag(False, "also record the per-tier quality in the model directory's "
                                      "tier_quality.json, which select_tier and serve --tier auto read (off: eval "
                                      "writes only where --csv says)")
    quality_metric: Literal["bpb", "loss", "perplexity", "accuracy"] = flag(
        "bpb", "the quality tier_quality.json records")


@dataclass(kw_only=True)
class ImportanceOptions(HeldOutOptions, PrecisionOptions):
    tier: str = flag("full", "tier whose channels are measured ('full', T4, or a fraction)")
    first: AtLeast1 = flag(8, "channels counted in the first-N share (Table 31: 8)")
    out: str | None = flag(None, "folder for channel_importance.csv/.json/.png (default: MODEL_DIR/importance)",
                           output="folder")
    overwrite: bool = flag(False, "replace the channel_importance.* files an earlier run left in --out (refused "
                                  "otherwise)")


@dataclass(kw_only=True)
class GenerateOptions(ModelDirOptions, TokenizerOptions, DeviceOptions, DtypeOptions, TierBudgetOptions):
    tier: str = flag("full", "tier to load ('full', T1..T10, 'auto'; ES-SSM: a budget 8 or K8)")
    prompt: str = flag(help="text to continue")
    max_new_tokens: NonNeg = flag(200, "tokens to sample")
    temperature: float = flag(0.8, "0 = greedy")
    top_k: int | None = flag(None, "sample from the k most likely tokens")
    top_p: float | None = flag(None, "nucleus sampling mass")
    seed: Annotated[int, Interval(ge=-(1 << 63), le=(1 << 64) - 1)] = flag(0, "sampling seed (torch's range: a "
                                                                               "64-bit integer)")


@dataclass(kw_only=True)
class LmEvalOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                    QuietOptions):
    tasks: str = flag(help="comma-separated lm-eval task names (piqa,hellaswag,...)")
    batch_size: AtLeast1 = flag(8, "sequences per forward pass")
    max_length: AtLeast1 = flag(2048, "longest scored input in tokens")
    num_fewshot: NonNeg | None = flag(None, "few-shot examples (default: the task's)")
    limit: Pos | None = flag(None, "documents per task (>= 1) or a fraction (< 1): a smoke run, not a paper number")
    include_path: str | None = flag(None, "folder of extra task YAML files (local tasks)")


@dataclass(kw_only=True)
class NiahOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                  QuietOptions):
    """``niah``: the fields of ``eval.perplexity.NeedleConfig`` the command line sets, under their own names."""

    data: str = flag("stdlib", "filler text source (as for eval)")
    split: str = flag("validation", "split of the filler source")
    context_len: AtLeast1 = flag(2048, "tokens per trial before the answer")
    n_pairs: AtLeast1 = flag(256, "key pairs (each runs at every depth)")
    depths: str = flag("0.1,0.3,0.5,0.7,0.9", "comma-separated relative needle depths in [0, 1]")
    condition: Literal["counterfactual", "planted"] = flag(
        "counterfactual", "which key of a pair is inserted and expected (the paper's tables: counterfactual)")
    seed: NonNeg = flag(0, "keys, filler windows and bootstrap")
    batch_size: AtLeast1 = flag(8, "sequences per forward pass")


@dataclass(kw_only=True)
class PrepareOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = flag(
        help="'stdlib', a file or folder (txt/jsonl/parquet), or hf:<name>[:cfg][:split]", metavar="SOURCE")
    out: Annotated[str, Positional, arg(metavar="OUT")] = flag(
        help="output token file, e.g. data/train.bin", metavar="OUT", output="file")
    tokenizer: str = flag("bytes", "'bytes' or a tokenizer.json")
    split: str | None = flag(None, "train / validation split of the source (default: all)")
    text_field: str = flag("text", "JSONL/Parquet/HF text field")
    max_tokens: NonNeg = flag(0, "stop after this many tokens (0: all)")
    overwrite: bool = flag(False, "replace an existing OUT (and its .json sidecar); refused otherwise")


@dataclass(kw_only=True)
class TokenizerTrainOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = flag(
        help="corpus source (as for prepare)", metavar="SOURCE")
    vocab_size: AtLeast1 = flag(8192, "vocabulary size")
    out: str = flag(help="output tokenizer.json", output="file")
    max_bytes: NonNeg = flag(0, "cap on training text (0: all)")
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
    steps: NonNeg = flag(0, "recovery steps (0: train.refine.steps of the run file)")
    tiers: str = flag("all", "'all' or comma-separated tiers to evaluate (label_only: train)")
    masks: tuple[float, ...] | None = flag(None, "posthoc: mask capacity fractions, full first "
                                                 "(default train.mixing.capacities)")
    calibration_batches: AtLeast1 = flag(16, "posthoc: training micro-batches for the ranking (E.7: 2M tokens)")
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
    port: Port = flag(8000, "TCP port (0: any free port, named in the start line)")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' (or set ELASTIC_SSM_API_KEY)")
    max_batch: AtLeast1 = flag(16, "slots of the one pool every served tier shares: its decode batch")
    max_prefill: NonNeg = flag(0, "most waiting prompts (similar lengths, left-padded) prefilled in one forward (0: "
                                  "--max_batch; lower bounds the scratch cache of scattered free slots)")
    max_prefill_tokens: AtLeast1 = flag(32768, "most prompt tokens (padding included) in one prefill forward, "
                                               "bounding its memory and the stall of running streams (a longer prompt "
                                               "goes alone)")
    prefill_wait_ms: NonNegF = flag(150.0, "longest (ms) a waiting request is held for more arrivals to share its "
                                           "prefill, unless min(--max_prefill, free slots) wait or arrivals pause "
                                           "10 ms (0: at once)")
    prefill_graphs: bool = flag(True, "on CUDA, replay prefills of up to --prefill_graph_tokens from CUDA graphs, "
                                      "one per (prompts, length) bucket, captured at its second use")
    prefill_graph_tokens: AtLeast1 = flag(2048, "the largest graphed prefill, in padded prompt tokens (larger ones "
                                                "run eagerly, faster for them: docs/serving.md)")
    attended_spans: bool = flag(True, "while every sequence is shorter than a power of two below the attention "
                                      "window, decode steps read only that prefix of the window caches")
    max_queue: NonNeg = flag(64, "requests waiting (all tiers together) before 503")
    max_prompt_tokens: AtLeast1 = flag(8192, "longest prompt accepted")
    max_tokens_limit: AtLeast1 = flag(4096, "largest max_tokens accepted (and a chat's default)")
    max_body_bytes: AtLeast1 = flag(1 << 20, "largest request body accepted")
    max_connections_per_client: AtLeast1 = flag(32, "concurrent requests per address")
    chat_template: str | None = flag(None, "chat template for /v1/chat/completions: 'chatml', 'plain' or a Jinja "
                                           "file (default: the model directory's own; without one chat is a 400)")
    max_connections: AtLeast1 = flag(1024, "concurrent requests from all clients (503 beyond); open connections are "
                                           "capped at twice this")
    timeout: Pos = flag(30.0, "seconds a client may take to send its headers, its body, or to read pending output "
                              "before its request is dropped (408) and its slot freed")
    max_header_bytes: Annotated[int, Ge(1024)] = flag(65536, "largest request line and headers of one request, in "
                                                             "bytes (431 and the connection closed beyond)")
    allowed_hosts: str | None = flag(None, "comma-separated Host names accepted without --api_key besides "
                                           "localhost, the loopback addresses and --host ('*': any; others: 421)")
    forwarded_allow_ips: str | None = flag(None, "comma-separated addresses of trusted reverse proxies whose "
                                                 "X-Forwarded-For/-Proto name the client ('*': any; default: "
                                                 "none, the headers are ignored)")

@dataclass(kw_only=True)
class CalibrateOptions(ModelDirOptions, TiersOptions, DtypeOptions, DeviceOptions, QuietOptions):
    batches: str = flag("1,16,128", "comma-separated decode batch sizes to time")
    warmup: NonNeg = flag(5, "untimed steps per entry")
    iters: AtLeast1 = flag(20, "timed steps per entry")


@dataclass(kw_only=True)
class QuickstartOptions(QuietOptions):
    out: str = flag("runs/quickstart", "output folder", output="folder")
    steps: NonNeg = flag(0, "override the training steps (0: config default)")
    config: str | None = flag(None, "run YAML (default: the embedded quickstart config)")
    control: bool = flag(True, "also train the dense control (full capacity only) and truncate it to T1")
    overwrite: bool = flag(False, "move the outputs of an earlier quickstart in --out (runs, exports, report) aside")
    resume: Literal["yes", "auto"] | None = flag(
        None, "continue a stopped quickstart in --out ('--resume' alone is '--resume yes'): finished runs are loaded, "
              "an interrupted one continues from its checkpoint (same --steps / --config); exports and report are "
              "redone; '--resume auto' starts fresh when --out holds no quickstart run")
