"""elastic_ssm.data: corpora, tokenizers, packed batches, prepared token files and synthetic tasks.

Typical use::

    from elastic_ssm import data
    tok = data.load_tokenizer("bytes")                       # or a tokenizer.json path
    train = data.load_corpus("stdlib", tok, split="train")   # or a prepared *.bin file
    batches = data.PackedBatches(train, seq_len=512, batch_size=8, seed=0)
    input_ids, labels = next(batches)                        # [B, L] int64 each

See docs/data.md for sources, ``elastic-ssm prepare``, BPE training and resume semantics.
"""

from .corpora import folder_files, iter_documents, stdlib_corpus
from .packing import (
    PackedBatches,
    TokenArray,
    evaluation_batches,
    gather_windows,
    iter_token_chunks,
    num_windows,
    pack_documents,
)
from .splits import VAL_FRACTION, split_by_path, stdlib_files, stdlib_root, stdlib_split_files
from .synthetic import IGNORE, masked_accuracy, mqar, palindrome, synthetic_batches
from .tokenfile import TokenFile, load_corpus, prepare, sidecar_path, token_dtype
from .tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "ByteTokenizer", "IGNORE", "PackedBatches", "TokenArray", "TokenFile", "Tokenizer",
    "VAL_FRACTION", "evaluation_batches", "folder_files", "gather_windows", "iter_documents",
    "iter_token_chunks", "load_corpus", "load_tokenizer", "masked_accuracy", "mqar", "num_windows",
    "pack_documents", "palindrome", "prepare", "sidecar_path", "split_by_path", "stdlib_corpus",
    "stdlib_files", "stdlib_root", "stdlib_split_files", "synthetic_batches", "token_dtype", "train_bpe",
]
