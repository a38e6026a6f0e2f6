"""Token streams packed into training windows, with resumable shuffled batching.

Window ``i`` = ``stream[i*stride : i*stride + L + 1]`` of ``d0 SEP d1 SEP ...``, input ``w[:-1]`` and labels
``w[1:]`` ([L] each; training: ``stride = L``). Windows, evaluation windows (Appendix E), the shuffled order, the
per-rank blocks and the resume rules: docs/data.md, "Packing" and "Resume and data parallelism"."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import islice

import numpy as np
import torch

CHUNK_DOCS = 256


class TokenArray:
    """A token stream: ``tokens`` is a 1-D numpy integer array ``[N]`` (in memory; ``TokenFile``: memory-mapped)."""

    def __init__(self, tokens, vocab_size: int | None = None, meta: dict | None = None):
        arr = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asanyarray(tokens)   # a memmap stays one
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        self.tokens = arr
        self.vocab_size = vocab_size
        self.meta = dict(meta or {})

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx):
        return self.tokens[idx]

    def __repr__(self) -> str:
        return f"TokenArray(n={len(self)}, dtype={self.tokens.dtype}, vocab_size={self.vocab_size})"


def iter_token_chunks(docs: Iterable[str | bytes], tokenizer) -> Iterator[np.ndarray]:
    """Tokenize ``docs`` in groups of ``CHUNK_DOCS``; yield int64 arrays ``[n]`` of ``doc SEP doc SEP``."""
    sep = np.array([tokenizer.sep_id], dtype=np.int64)
    nonempty = (d for d in docs if d)
    while group := list(islice(nonempty, CHUNK_DOCS)):
        parts = [x for ids in tokenizer.encode_batch_np(group) if len(ids) for x in (ids, sep)]
        if parts:
            yield np.concatenate(parts)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def pack_documents(docs: Iterable[str | bytes], tokenizer) -> TokenArray:
    """Tokenize and concatenate ``docs`` in memory (for small corpora; use ``prepare`` for large ones)."""
    chunks = list(iter_token_chunks(docs, tokenizer))
    if not chunks:
        raise ValueError("no non-empty documents to pack")
    return TokenArray(np.concatenate(chunks).astype(token_dtype(tokenizer.vocab_size)), tokenizer.vocab_size)


def _as_array(tokens):
    if hasattr(tokens, "tokens"):
        return tokens.tokens
    return tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)


def tokens_fingerprint(tokens, samples: int = 64, width: int = 4096) -> str:
    """The length and SHA-256 of ``samples`` evenly spaced runs of ``width`` tokens (about 2 MB read): a resume
    compares it with its checkpoint's, catching replaced or edited data (not an edit between the runs)."""
    arr = _as_array(tokens)
    n = len(arr)
    digest = hashlib.sha256(f"{n}:".encode())
    if n <= samples * width:
        starts, width = [0], n
    else:
        starts = np.linspace(0, n - width, samples).astype(np.int64)
    for lo in starts:
        digest.update(np.ascontiguousarray(arr[int(lo):int(lo) + width], dtype=np.int64).tobytes())
    return digest.hexdigest()


def num_windows(n_tokens: int, seq_len: int, stride: int | None = None) -> int:
    """Number of complete ``seq_len + 1`` windows at ``stride`` (default ``seq_len``) in ``n_tokens``."""
    stride = seq_len if stride is None else stride
    return 0 if n_tokens < seq_len + 1 else (n_tokens - seq_len - 1) // stride + 1


def gather_windows(tokens, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], labels [B, L])`` int64 from the windows starting at ``starts`` ``[B]``."""
    arr = _as_array(tokens)
    w = np.stack([np.asarray(arr[s : s + seq_len + 1], dtype=np.int64) for s in starts.tolist()])
    w = torch.from_numpy(w)  # [B, L + 1]
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class PackedBatches:
    """Shuffled, sharded, resumable batches ``(input_ids [B, L], labels [B, L])`` (int64 CPU tensors) of
    ``tokens`` [N] (``TokenArray``, ``TokenFile``, array or tensor). ``seed`` and the epoch fix the permutation
    (``shuffle``); without ``drop_last`` the last global batch is completed from the start of the epoch's order;
    rank ``r`` takes rows ``r*B:(r+1)*B`` of each global batch; ``num_epochs`` None iterates forever."""

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1, num_epochs: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.rank, self.world_size, self.num_epochs = rank, world_size, num_epochs
        self.num_windows = num_windows(len(_as_array(tokens)), seq_len)
        self.global_batch = batch_size * world_size
        if self.num_windows < (self.global_batch if drop_last else 1):
            raise ValueError(
                f"corpus too small: {len(_as_array(tokens))} tokens give {self.num_windows} windows of "
                f"{seq_len + 1} tokens, fewer than one global batch of {self.global_batch}; lower "
                "seq_len/batch_size or use more data")
        self.epoch, self.consumed = 0, 0  # consumed: windows (all ranks) used in this epoch
        self._perm_epoch, self._perm = -1, None
        self._fingerprint: str | None = None

    @property
    def num_batches(self) -> int:
        """Batches per epoch (the same on every rank)."""
        full, rest = divmod(self.num_windows, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.num_batches

    def order(self, epoch: int) -> np.ndarray:
        """Window indices of ``epoch`` in visiting order ``[num_windows]`` (same on every rank)."""
        if epoch != self._perm_epoch:
            n = self.num_windows
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.consumed // self.global_batch >= self.num_batches:
            self.epoch, self.consumed = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        order = self.order(self.epoch)
        lo = self.consumed + self.rank * self.batch_size
        idx = np.arange(lo, lo + self.batch_size) % self.num_windows
        self.consumed += self.global_batch
        return gather_windows(self.tokens, order[idx] * self.seq_len, self.seq_len)

    def fingerprint(self) -> str:
        """``tokens_fingerprint`` of the stream (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = tokens_fingerprint(self.tokens)
        return self._fingerprint

    def state_dict(self) -> dict:
        """Position to resume from: the next ``__next__`` after ``load_state_dict`` gives the next batch."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "seq_len": self.seq_len, "num_windows": self.num_windows, "drop_last": self.drop_last,
                "tokens": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "num_windows", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: checkpoint data {key}={state[key]} but this loader has "
                                 f"{getattr(self, key)}; the corpus, seq_len or seed changed since the save")
        if "tokens" in state and state["tokens"] != self.fingerprint():      # checkpoints before it: not checked
            raise ValueError("cannot resume: the training tokens differ from those the checkpoint was trained on "
                             f"(fingerprint {str(state['tokens'])[:16]} saved, {self.fingerprint()[:16]} now): the "
                             "data source's files changed since the save; restore them, or start a new "
                             "--train.out_dir")
        if state["consumed"] % self.global_batch and state["consumed"] < self.num_windows:
            raise ValueError(f"cannot resume: {state['consumed']} windows consumed is not a multiple of the "
                             f"global batch {self.global_batch} (batch_size x world_size changed)")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def evaluation_batches(tokens, seq_len: int, batch_size: int, max_batches: int | None = None, rank: int = 0,
                       world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches ``(input_ids [b, L], labels [b, L])`` (only the last has b < B) of non-overlapping
    windows (``stride = L + 1``), never shuffled; ``max_batches`` spreads its windows evenly over the whole
    stream; rank ``r`` gets every ``world_size``-th window."""
    stride = seq_len + 1
    n = num_windows(len(_as_array(tokens)), seq_len, stride)
    if n == 0:
        raise ValueError(f"evaluation corpus too small: {len(_as_array(tokens))} tokens, need at least "
                         f"{seq_len + 1} for one window of {seq_len}; use a shorter sequence length or more "
                         "validation text")
    idx = np.arange(n)
    if max_batches is not None and max_batches * batch_size * world_size < n:
        idx = np.linspace(0, n - 1, max_batches * batch_size * world_size).round().astype(np.int64)
    idx = idx[rank::world_size]
    for lo in range(0, len(idx), batch_size):
        yield gather_windows(tokens, idx[lo : lo + batch_size] * stride, seq_len)
