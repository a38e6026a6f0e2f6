"""elastic_ssm.data: corpora, tokenizers, packed batches, prepared token files and synthetic tasks
(docs/data.md): ``PackedBatches(load_corpus("stdlib", load_tokenizer("bytes")), seq_len=512, batch_size=8)``
yields ``(input_ids, labels)``, [B, L] int64 each."""

from .corpora import folder_files, iter_documents
from .packing import (
    PackedBatches,
    TokenArray,
    evaluation_batches,
    gather_windows,
    iter_token_chunks,
    num_windows,
    pack_documents,
)
from .pysrc import VAL_FRACTION, split_by_path, stdlib_files, stdlib_root, stdlib_split_files
from .synthetic import IGNORE, masked_accuracy, mqar, palindrome, synthetic_batches
from .tokenfile import TokenFile, load_corpus, prepare, sidecar_path, token_dtype
from .tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "ByteTokenizer", "IGNORE", "PackedBatches", "TokenArray", "TokenFile", "Tokenizer",
    "VAL_FRACTION", "evaluation_batches", "folder_files", "gather_windows", "iter_documents",
    "iter_token_chunks", "load_corpus", "load_tokenizer", "masked_accuracy", "mqar", "num_windows",
    "pack_documents", "palindrome", "prepare", "sidecar_path", "split_by_path", "stdlib_files", "stdlib_root",
    "stdlib_split_files", "synthetic_batches", "token_dtype", "train_bpe",
]
