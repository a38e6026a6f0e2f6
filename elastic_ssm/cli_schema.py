"""The options of every ``elastic-ssm`` verb, as keyword-only dataclasses built from shared groups; tyro derives
the flags. Types, ranges and choices are declared on the annotations (the ``Annotated`` aliases of
``config/base.py``) and checked by pydantic in ``cli.check_options`` before a verb runs, with ``opt``'s ``output``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Interval
from tyro.conf import Positional, arg

from .cli_util import DEVICE_HELP
from .config.base import AtLeast1, NonNeg, NonNegF, Pos, opt
from .config.run import DEFAULT_RUN

MODEL_DIR = "model directory (save_pretrained / a run's final/)"
TOKENIZER_HELP = ("default: the tokenizer saved with the model (bytes when it has none); 'bytes', a tokenizer.json "
                  "or folder names one for a model saved without one; one that differs from the saved one is refused")
ModelDir = Annotated[str, Positional, arg(metavar="MODEL_DIR")]
Port = Annotated[int, Interval(ge=0, le=65535)]


# ---- shared groups ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DeviceOptions:
    device: str = opt("auto", DEVICE_HELP)


@dataclass(kw_only=True)
class DtypeOptions:
    dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "auto", "weights: auto = bfloat16 on CUDA (the fused decoder's format), float32 on CPU")


@dataclass(kw_only=True)
class PrecisionOptions:
    precision: Literal["fp32", "bf16"] = opt("fp32", "fp32, or bf16 = autocast of the float32 weights")


@dataclass(kw_only=True)
class TokenizerOptions:
    tokenizer: str | None = opt(None, TOKENIZER_HELP)


@dataclass(kw_only=True)
class TiersOptions:
    tiers: str = opt("all", "'all' or comma-separated tier names (T1,T4,T10; ES-SSM K8 or a budget 8)")


@dataclass(kw_only=True)
class QuietOptions:
    quiet: bool = opt(False, "no progress bars on stderr (they show only when stderr is a terminal; the results "
                              "on stdout are the same either way)")


@dataclass(kw_only=True)
class CsvOptions:
    csv: str | None = opt(None, "also write the rows as CSV to this file (an existing one is refused without "
                                 "--overwrite)", output="file")
    overwrite: bool = opt(False, "replace an existing --csv file; refused otherwise (a file not named *.csv, such "
                                  "as a model's config.json, never is)")


@dataclass(kw_only=True)
class ModelDirOptions:
    checkpoint: ModelDir = opt(help=MODEL_DIR, metavar="MODEL_DIR")


@dataclass(kw_only=True)
class HeldOutOptions(ModelDirOptions, TokenizerOptions, DeviceOptions, QuietOptions):
    """A model directory scored on fixed held-out windows of a text source (``eval``, ``importance``)."""

    data: str = opt("stdlib", "source (see `elastic-ssm train --help`, data.source)")
    split: str = opt("validation", "split of the source to evaluate")
    seq_len: AtLeast1 | None = opt(None, "tokens per evaluation sequence (default: 512, or the model's longest "
                                          "sequence when that is shorter: an ES-SSM's filter length seq_len)")
    batch_size: AtLeast1 = opt(8, "sequences per batch")
    n_batches: AtLeast1 = opt(16, "number of batches (fixed windows)")
    bytes_per_token: NonNegF = opt(0.0, "divisor of bits per byte (0: 1 for bytes, measured on the data for BPE)")


@dataclass(kw_only=True)
class TierBudgetOptions:
    """The budgets ``--tier auto`` is chosen under (``es.select_tier``)."""

    max_ms_per_token: Pos | None = opt(None, "--tier auto: latency budget per stream (needs tier_profile.json: "
                                              "elastic-ssm calibrate)")
    max_state_bytes: AtLeast1 | None = opt(None, "--tier auto: state budget per sequence")
    max_params: AtLeast1 | None = opt(None, "--tier auto: parameter budget")
    budget_batch: AtLeast1 = opt(1, "--tier auto: decode batch the budget is for")


# ---- commands --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class InfoOptions:
    """``info``: no options."""


@dataclass(kw_only=True)
class TrainOptions(QuietOptions):
    """``train``: the run file and how the run directory is treated (settings: --model.* --train.* --data.*)."""

    config: str | None = opt(None, f"run YAML (model/train/data sections); default: {DEFAULT_RUN.name}, the "
                                      "quickstart's run file (the defaults --help shows below)")
    resume: Literal["yes", "auto"] | None = opt(
        None, "continue from the latest checkpoint in train.out_dir ('--resume' alone is '--resume yes'); "
              "'--resume auto' starts fresh when there is none yet (for jobs requeued with the same command)")
    overwrite: bool = opt(False, "start fresh in a train.out_dir that holds another run or other files (they are "
                           "moved aside, never deleted)")
    stop_after: NonNeg = opt(0, "end this call at step N of the current stage with a checkpoint there and no final "
                                 "model (continue with --resume; 0: run to the end)")
    verify_data: bool = opt(False, "re-hash every prepared token file (*.bin) whole against its sidecar's sha256 "
                                    "before training (by default a sampled fingerprint is checked)")


@dataclass(kw_only=True)
class ExportOptions(ModelDirOptions, TiersOptions, DeviceOptions, QuietOptions):
    tiers: str = opt("all", "'all' or comma-separated tier names to export (T1,T4; ES-SSM K8 or a budget 8)")
    out: str = opt(help="output folder; one sub-folder per tier", output="folder")
    check_len: AtLeast1 = opt(128, "tokens per sequence of the export check (an ES-SSM: at most its filter length, "
                                    "the default when shorter)")
    overwrite: bool = opt(False, "replace tier folders under --out that already hold files (refused otherwise, "
                                  "even for the same model)")


@dataclass(kw_only=True)
class EvalOptions(HeldOutOptions, CsvOptions):
    tiers: str = opt("all", "'all' or comma-separated tier names and capacity fractions in (0, 1] (T1,0.45,T10)")
    lengths: str | None = opt(None, "evaluate at several sequence lengths instead of --seq_len: multiples of the "
                                     "training length (1x,2x,4x,8x) and/or token counts (1024,4096)")
    train_len: AtLeast1 | None = opt(None, "training sequence length for --lengths Nx (default: train.seq_len of the "
                                            "run.yaml above the model directory)")
    write_quality: bool = opt(False, "also record the per-tier quality in the model directory's "
                                      "tier_quality.json, which select_tier and serve --tier auto read (off: eval "
                                      "writes only where --csv says)")
    quality_metric: Literal["bpb", "loss", "perplexity", "accuracy"] = opt(
        "bpb", "the quality tier_quality.json records")


@dataclass(kw_only=True)
class ImportanceOptions(HeldOutOptions, PrecisionOptions):
    tier: str = opt("full", "tier whose channels are measured ('full', T4, or a fraction)")
    first: AtLeast1 = opt(8, "channels counted in the first-N share (Table 31: 8)")
    out: str | None = opt(None, "folder for channel_importance.csv/.json/.png (default: MODEL_DIR/importance)",
                           output="folder")
    overwrite: bool = opt(False, "replace the channel_importance.* files an earlier run left in --out (refused "
                                  "otherwise)")


@dataclass(kw_only=True)
class GenerateOptions(ModelDirOptions, TokenizerOptions, DeviceOptions, DtypeOptions, TierBudgetOptions):
    tier: str = opt("full", "tier to load ('full', T1..T10, 'auto'; ES-SSM: a budget 8 or K8)")
    prompt: str = opt(help="text to continue")
    max_new_tokens: NonNeg = opt(200, "tokens to sample")
    temperature: float = opt(0.8, "0 = greedy")
    top_k: int | None = opt(None, "sample from the k most likely tokens")
    top_p: float | None = opt(None, "nucleus sampling mass")
    seed: Annotated[int, Interval(ge=-(1 << 63), le=(1 << 64) - 1)] = opt(0, "sampling seed (torch's range: a "
                                                                               "64-bit integer)")


@dataclass(kw_only=True)
class LmEvalOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                    QuietOptions):
    tasks: str = opt(help="comma-separated lm-eval task names (piqa,hellaswag,...)")
    batch_size: AtLeast1 = opt(8, "sequences per forward pass")
    max_length: AtLeast1 = opt(2048, "longest scored input in tokens")
    num_fewshot: NonNeg | None = opt(None, "few-shot examples (default: the task's)")
    limit: Pos | None = opt(None, "documents per task (>= 1) or a fraction (< 1): a smoke run, not a paper number")
    include_path: str | None = opt(None, "folder of extra task YAML files (local tasks)")


@dataclass(kw_only=True)
class NiahOptions(ModelDirOptions, TiersOptions, TokenizerOptions, DeviceOptions, PrecisionOptions, CsvOptions,
                  QuietOptions):
    """``niah``: the fields of ``eval.perplexity.NeedleConfig`` the command line sets, under their own names."""

    data: str = opt("stdlib", "filler text source (as for eval)")
    split: str = opt("validation", "split of the filler source")
    context_len: AtLeast1 = opt(2048, "tokens per trial before the answer")
    n_pairs: AtLeast1 = opt(256, "key pairs (each runs at every depth)")
    depths: str = opt("0.1,0.3,0.5,0.7,0.9", "comma-separated relative needle depths in [0, 1]")
    condition: Literal["counterfactual", "planted"] = opt(
        "counterfactual", "which key of a pair is inserted and expected (the paper's tables: counterfactual)")
    seed: NonNeg = opt(0, "keys, filler windows and bootstrap")
    batch_size: AtLeast1 = opt(8, "sequences per forward pass")


@dataclass(kw_only=True)
class PrepareOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = opt(
        help="'stdlib', a file or folder (txt/jsonl/parquet), or hf:<name>[:cfg][:split]", metavar="SOURCE")
    out: Annotated[str, Positional, arg(metavar="OUT")] = opt(
        help="output token file, e.g. data/train.bin", metavar="OUT", output="file")
    tokenizer: str = opt("bytes", "'bytes' or a tokenizer.json")
    split: str | None = opt(None, "train / validation split of the source (default: all)")
    text_field: str = opt("text", "JSONL/Parquet/HF text field")
    max_tokens: NonNeg = opt(0, "stop after this many tokens (0: all)")
    overwrite: bool = opt(False, "replace an existing OUT (and its .json sidecar); refused otherwise")


@dataclass(kw_only=True)
class TokenizerTrainOptions(QuietOptions):
    source: Annotated[str, Positional, arg(metavar="SOURCE")] = opt(
        help="corpus source (as for prepare)", metavar="SOURCE")
    vocab_size: AtLeast1 = opt(8192, "vocabulary size")
    out: str = opt(help="output tokenizer.json", output="file")
    max_bytes: NonNeg = opt(0, "cap on training text (0: all)")
    overwrite: bool = opt(False, "replace an existing --out file; refused otherwise")


@dataclass(kw_only=True)
class RecoverOptions(TiersOptions, DeviceOptions, QuietOptions):
    """``recover``: the protocol and its knobs (data and training settings: --config, --train.*, --data.*)."""

    parent: Annotated[str, Positional, arg(metavar="PARENT")] = opt(
        help="model directory of the trained (e.g. dense) ESSH", metavar="PARENT")
    protocol: Literal["refine", "label_only", "posthoc"] = opt(   # = train/recover.PROTOCOLS (tested)
        "refine", "refine: shared refinement of the truncated model (Tables 33/43); label_only: "
                  "each tier at its fixed shape with CE only (Table 43); posthoc: E.7 ranking + masked recovery")
    config: str | None = opt(None, "run YAML for data and training settings (default: the quickstart's)")
    steps: NonNeg = opt(0, "recovery steps (0: train.refine.steps of the run file)")
    tiers: str = opt("all", "'all' or comma-separated tiers to evaluate (label_only: train)")
    masks: tuple[float, ...] | None = opt(None, "posthoc: mask capacity fractions, full first "
                                                 "(default train.mixing.capacities)")
    calibration_batches: AtLeast1 = opt(16, "posthoc: training micro-batches for the ranking (E.7: 2M tokens)")
    channel_order: Literal["original", "energy"] = opt(
        "original", "posthoc: keep the spectral channels' order (E.7) or rank them by output energy")
    overwrite: bool = opt(False, "move another run in train.out_dir aside")


@dataclass(kw_only=True)
class ServeOptions(ModelDirOptions, TokenizerOptions, TierBudgetOptions, DtypeOptions, DeviceOptions):
    """``serve``: one checkpoint, every tier a prefix view of the same weights (``serve/app.py``)."""

    checkpoint: ModelDir = opt(help="model directory (with its tokenizer)", metavar="MODEL_DIR")
    tiers: str = opt("all", "'all' or comma-separated tiers to serve (T1,T4,T10)")
    tier: str | None = opt(None, "default tier (model id without '@'): one of --tiers or 'auto' (es.select_tier "
                                  "under the budget flags; served too if --tiers lacks it); default: the largest")
    name: str | None = opt(None, "model name in the API (default: the directory's name)")
    host: str = opt("127.0.0.1", "address to bind (default: local only)")
    port: Port = opt(8000, "TCP port (0: any free port, named in the start line)")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' (or set ELASTIC_SSM_API_KEY)")
    max_batch: AtLeast1 = opt(16, "slots of the one pool every served tier shares: its decode batch")
    max_prefill: NonNeg = opt(0, "most waiting prompts (similar lengths, left-padded) prefilled in one forward (0: "
                                  "--max_batch; lower bounds the scratch cache of scattered free slots)")
    max_prefill_tokens: AtLeast1 = opt(32768, "most prompt tokens (padding included) in one prefill forward, "
                                               "bounding its memory and the stall of running streams (a longer prompt "
                                               "goes alone)")
    prefill_wait_ms: NonNegF = opt(150.0, "longest (ms) a waiting request is held for more arrivals to share its "
                                           "prefill, unless min(--max_prefill, free slots) wait or arrivals pause "
                                           "10 ms (0: at once)")
    prefill_graphs: bool = opt(True, "on CUDA, replay prefills of up to --prefill_graph_tokens from CUDA graphs, "
                                      "one per (prompts, length) bucket, captured at its second use")
    prefill_graph_tokens: AtLeast1 = opt(2048, "the largest graphed prefill, in padded prompt tokens (larger ones "
                                                "run eagerly, faster for them: docs/serving.md)")
    attended_spans: bool = opt(True, "while every sequence is shorter than a power of two below the attention "
                                      "window, decode steps read only that prefix of the window caches")
    max_queue: NonNeg = opt(64, "requests waiting (all tiers together) before 503")
    max_prompt_tokens: AtLeast1 = opt(8192, "longest prompt accepted")
    max_tokens_limit: AtLeast1 = opt(4096, "largest max_tokens accepted (and a chat's default)")
    max_body_bytes: AtLeast1 = opt(1 << 20, "largest request body accepted")
    max_connections_per_client: AtLeast1 = opt(32, "concurrent requests per address")
    chat_template: str | None = opt(None, "chat template for /v1/chat/completions: 'chatml', 'plain' or a Jinja "
                                           "file (default: the model directory's own; without one chat is a 400)")
    max_connections: AtLeast1 = opt(1024, "concurrent requests from all clients (503 beyond); open connections are "
                                           "capped at twice this")
    timeout: Pos = opt(30.0, "seconds a client may take to send its headers, its body, or to read pending output "
                              "before its request is dropped (408) and its slot freed")
    max_header_bytes: Annotated[int, Ge(1024)] = opt(65536, "largest request line and headers of one request, in "
                                                             "bytes (431 and the connection closed beyond)")
    allowed_hosts: str | None = opt(None, "comma-separated Host names accepted without --api_key besides "
                                           "localhost, the loopback addresses and --host ('*': any; others: 421)")
    forwarded_allow_ips: str | None = opt(None, "comma-separated addresses of trusted reverse proxies whose "
                                                 "X-Forwarded-For/-Proto name the client ('*': any; default: "
                                                 "none, the headers are ignored)")

@dataclass(kw_only=True)
class CalibrateOptions(ModelDirOptions, TiersOptions, DtypeOptions, DeviceOptions, QuietOptions):
    batches: str = opt("1,16,128", "comma-separated decode batch sizes to time")
    warmup: NonNeg = opt(5, "untimed steps per entry")
    iters: AtLeast1 = opt(20, "timed steps per entry")


@dataclass(kw_only=True)
class QuickstartOptions(QuietOptions):
    out: str = opt("runs/quickstart", "output folder", output="folder")
    steps: NonNeg = opt(0, "override the training steps (0: config default)")
    config: str | None = opt(None, "run YAML (default: the embedded quickstart config)")
    control: bool = opt(True, "also train the dense control (full capacity only) and truncate it to T1")
    overwrite: bool = opt(False, "move the outputs of an earlier quickstart in --out (runs, exports, report) aside")
    resume: Literal["yes", "auto"] | None = opt(
        None, "continue a stopped quickstart in --out ('--resume' alone is '--resume yes'): finished runs are loaded, "
              "an interrupted one continues from its checkpoint (same --steps / --config); exports and report are "
              "redone; '--resume auto' starts fresh when --out holds no quickstart run")
