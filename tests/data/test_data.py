"""Tests of elastic_ssm.data: corpora, tokenizers, packing, resumable batches, token files, tasks."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elastic_ssm import data
from elastic_ssm.data import corpora, pysrc


def test_stdlib_split_deterministic_disjoint_by_file():
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f for f in files)
    train, val = data.stdlib_split_files("train"), data.stdlib_split_files("validation")
    assert set(train).isdisjoint(val) and sorted(train + val) == files
    assert len(val) >= pysrc.STDLIB_MIN_VAL_FILES and len(train) > 10 * len(val)
    pysrc._stdlib_files.cache_clear()
    assert data.stdlib_split_files("validation") == val  # recomputed from disk: same split
    docs = list(corpora.cap_bytes(data.iter_documents("stdlib", "validation"), 5000))
    assert sum(map(len, docs)) == 5000 and all(isinstance(d, bytes) for d in docs)
    assert docs[0] == (data.stdlib_root() / val[0]).read_bytes()[: len(docs[0])]
    with pytest.raises(ValueError, match="unknown split"):
        data.stdlib_split_files("dev")


def test_split_by_path_is_per_file_and_tops_up():
    paths = [f"f{i}.txt" for i in range(200)]
    train, val = data.split_by_path(paths, 0.1)
    tr2, val2 = data.split_by_path(paths[:100], 0.1)
    assert set(val2) == set(val) & set(paths[:100])  # membership does not depend on the other files
    _, few = data.split_by_path(paths[:5], 0.0, min_val=2)
    assert len(few) == 2
    with pytest.raises(ValueError, match="cannot split"):
        data.split_by_path(["only.txt"])


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "héllo, wörld ✓\n\tend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.encode(text.encode()) == ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.sep_id, tok.pad_id]) == text
    assert tok.decode([0xFF, 65]) == "\ufffdA"
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id) == (260, 256, 257, 258, 259)
    assert data.load_tokenizer("bytes").vocab_size == 260


def test_bpe_train_round_trip_and_save(tmp_path):
    docs = corpora.cap_bytes(data.iter_documents("stdlib", "train"), 300_000)
    tok = data.train_bpe(docs, 600, tmp_path / "bpe" / "tokenizer.json")
    assert tok.vocab_size == 600 and (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id) == (0, 1, 2, 3)
    text = "def f(x):\n    return {'ü': x ** 2}  # ✓\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.sep_id]) == text
    assert tok.decode([-1, *ids, 600, 10**12]) == text        # was OverflowError: dropped, as ByteTokenizer does
    loaded = data.load_tokenizer(tmp_path / "bpe" / "tokenizer.json")
    assert loaded.encode(text) == ids and loaded.sha256 == tok.sha256
    tok.save(tmp_path / "ckpt")
    assert data.load_tokenizer(tmp_path / "ckpt").encode(text) == ids
    data.ByteTokenizer().save(tmp_path / "bytes_ckpt")
    assert isinstance(data.load_tokenizer(tmp_path / "bytes_ckpt"), data.ByteTokenizer)
    with pytest.raises(ValueError, match="too small"):
        data.train_bpe(docs, 100, tmp_path / "x.json")
    # bits-per-byte divisor: decoded UTF-8 bytes per token, separators counted as tokens without bytes
    from elastic_ssm.eval.perplexity import measured_bytes_per_token

    stream = [*ids, tok.sep_id, *ids]
    assert measured_bytes_per_token(tok, stream) == pytest.approx(2 * len(text.encode()) / len(stream))
    assert measured_bytes_per_token(data.ByteTokenizer(), list(b"abc") + [259]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="no tokens"):
        measured_bytes_per_token(tok, [])


def _write_sources(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha doc\n")
    (root / "sub" / "b.md").write_text("# beta\n")
    (root / ".hidden.txt").write_text("never read")
    (root / "skip.bin").write_bytes(b"\x00\x01")
    with open(root / "c.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"json {i}", "id": i}) + "\n\n")
    with gzip.open(root / "sub" / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "x"}) + "\n")
    table = pa.table({"text": [f"row {i}" for i in range(2500)], "n": list(range(2500))})
    pq.write_table(table, root / "sub" / "e.parquet", row_group_size=1000)


def test_readers_text_jsonl_parquet_folder(tmp_path):
    _write_sources(tmp_path)
    assert list(data.iter_documents(tmp_path / "a.txt")) == [b"alpha doc\n"]
    assert list(data.iter_documents(tmp_path / "c.jsonl")) == ["json 0", "json 1", "json 2"]
    rows = list(data.iter_documents(tmp_path / "sub" / "e.parquet"))
    assert rows == [f"row {i}" for i in range(2500)]
    assert list(data.iter_documents(tmp_path / "sub" / "d.jsonl.gz", text_field="body")) == ["x"]
    with pytest.raises(ValueError, match="no 'text' field"):
        list(data.iter_documents(tmp_path / "sub" / "d.jsonl.gz"))
    with pytest.raises(ValueError, match="no column 'body'"):
        list(data.iter_documents(tmp_path / "sub" / "e.parquet", text_field="body"))
    assert data.folder_files(tmp_path) == ["a.txt", "c.jsonl", "sub/b.md", "sub/d.jsonl.gz", "sub/e.parquet"]
    (tmp_path / "sub" / "d.jsonl.gz").unlink()
    docs = list(data.iter_documents(tmp_path))
    assert docs[:5] == [b"alpha doc\n", "json 0", "json 1", "json 2", b"# beta\n"] and len(docs) == 2505
    train = list(data.iter_documents(tmp_path, "train"))
    val = list(data.iter_documents(tmp_path, "validation"))
    assert len(train) + len(val) == 2505 and val
    # parquet rows split by row hash: disjoint and complete
    ptr = data.iter_documents(tmp_path / "sub" / "e.parquet", "train")
    pva = list(data.iter_documents(tmp_path / "sub" / "e.parquet", "validation"))
    assert sorted([*ptr, *pva]) == sorted(rows) and 10 < len(pva) < 150
    with pytest.raises(FileNotFoundError, match="data source not found"):
        list(data.iter_documents(tmp_path / "missing"))


def test_single_text_file_split_at_line_break(tmp_path):
    lines = [f"line {i}\n" for i in range(1000)]
    (tmp_path / "t.txt").write_text("".join(lines))
    train = b"".join(data.iter_documents(tmp_path / "t.txt", "train"))
    val = b"".join(data.iter_documents(tmp_path / "t.txt", "validation"))
    assert train + val == "".join(lines).encode() and val.startswith(b"line ") and train.endswith(b"\n")
    assert 0 < len(val) < 0.05 * len(train)


def test_large_text_file_streams_in_line_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "MAX_TEXT_DOC_BYTES", 64)
    text = "".join(f"line {i} {'x' * (i % 30)}\n" for i in range(400)).encode()
    (tmp_path / "big.txt").write_bytes(text)
    pieces = list(data.iter_documents(tmp_path / "big.txt"))
    assert b"".join(pieces) == text and len(pieces) > 50 and all(p.endswith(b"\n") for p in pieces)
    train = list(data.iter_documents(tmp_path / "big.txt", "train"))
    val = list(data.iter_documents(tmp_path / "big.txt", "validation"))
    assert b"".join(train + val) == text and len(val) >= 1 and all(p.endswith(b"\n") for p in train)


def test_packing_windows_and_sep():
    tok = data.ByteTokenizer()
    arr = data.pack_documents([b"ab", b"", "cde"], tok)
    assert arr.tokens.tolist() == [97, 98, tok.sep_id, 99, 100, 101, tok.sep_id]
    assert data.num_windows(7, 3) == 2 and data.num_windows(7, 3, stride=4) == 1
    x, y = data.gather_windows(arr, np.array([0, 3]), 3)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (2, 3)
    assert x.tolist() == [[97, 98, 259], [99, 100, 101]] and y.tolist() == [[98, 259, 99], [100, 101, 259]]


def _stream(n=10_000):
    return data.TokenArray(np.random.default_rng(0).integers(0, 260, n).astype(np.uint16), 260)


def test_packed_batches_epoch_cover_and_determinism():
    toks = _stream(2001)
    b = data.PackedBatches(toks, seq_len=10, batch_size=4, seed=3, num_epochs=2)
    assert b.num_windows == 200 and b.num_batches == len(b) == 50
    got = list(b)
    assert len(got) == 100
    ids = data.PackedBatches(data.TokenArray(np.arange(2001)), seq_len=10, batch_size=4, seed=3)
    starts = torch.cat([next(ids)[0][:, 0] for _ in range(50)]).tolist()
    assert sorted(starts) == list(range(0, 2000, 10))  # one epoch visits every window once
    again = list(data.PackedBatches(toks, seq_len=10, batch_size=4, seed=3, num_epochs=2))
    assert all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) for a, c in zip(got, again))
    assert not torch.equal(got[0][0], got[50][0])  # a new permutation in epoch 1
    seq = data.PackedBatches(toks, seq_len=10, batch_size=4, shuffle=False)
    x, y = next(seq)
    assert torch.equal(x[1], torch.from_numpy(toks.tokens[10:20].astype(np.int64)))
    assert torch.equal(y[1], torch.from_numpy(toks.tokens[11:21].astype(np.int64)))
    with pytest.raises(ValueError, match="corpus too small"):
        data.PackedBatches(toks, seq_len=1000, batch_size=4)


def test_packed_batches_resume_bit_exact():
    toks = _stream()
    ref = data.PackedBatches(toks, seq_len=16, batch_size=8, seed=7)
    expected = [next(ref) for _ in range(200)]  # crosses several epochs (78 batches each)
    for cut in (0, 5, 77, 78, 150):
        run = data.PackedBatches(toks, seq_len=16, batch_size=8, seed=7)
        for _ in range(cut):
            next(run)
        state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
        resumed = data.PackedBatches(toks, seq_len=16, batch_size=8, seed=7)
        resumed.load_state_dict(state)
        for i in range(cut, cut + 20):
            x, y = next(resumed)
            assert torch.equal(x, expected[i][0]) and torch.equal(y, expected[i][1])
    with pytest.raises(ValueError, match="seq_len"):
        data.PackedBatches(toks, seq_len=32, batch_size=8, seed=7).load_state_dict(state)


def test_rank_sharding_disjoint_and_world_size_resume():
    toks = data.TokenArray(np.arange(4001, dtype=np.int64))  # window start = first token
    world = [data.PackedBatches(toks, 10, 4, seed=1, rank=r, world_size=3) for r in range(3)]
    single = data.PackedBatches(toks, 10, 12, seed=1)
    assert world[0].num_batches == single.num_batches == 33
    seen = []
    for _ in range(33):
        rows = [next(w)[0][:, 0] for w in world]
        assert torch.equal(torch.cat(rows), next(single)[0][:, 0])  # same global batch, split by rank
        seen += torch.cat(rows).tolist()
    assert len(seen) == len(set(seen)) == 396
    # resume a 3-rank run on one rank with a 3x larger batch: continues at the same windows
    run = data.PackedBatches(toks, 10, 4, seed=1, rank=0, world_size=3)
    for _ in range(5):
        next(run)
    one = data.PackedBatches(toks, 10, 12, seed=1)
    one.load_state_dict(run.state_dict())
    ref = data.PackedBatches(toks, 10, 12, seed=1)
    for _ in range(5):
        next(ref)
    assert torch.equal(next(one)[0], next(ref)[0])
    odd = data.PackedBatches(toks, 10, 7, seed=1)
    with pytest.raises(ValueError, match="global batch"):
        odd.load_state_dict(run.state_dict())
    with pytest.raises(ValueError, match="rank"):
        data.PackedBatches(toks, 10, 4, rank=3, world_size=3)


def test_drop_last_false_wraps_and_evaluation_batches():
    toks = data.TokenArray(np.arange(101, dtype=np.int64))
    b = data.PackedBatches(toks, 10, 3, shuffle=False, drop_last=False, num_epochs=1)
    out = [x[:, 0].tolist() for x, _ in b]
    assert b.num_batches == 4 and out[-1] == [90, 0, 10]
    ev = list(data.evaluation_batches(toks, 10, 4))  # stride 11: 9 windows
    assert [x.shape[0] for x, _ in ev] == [4, 4, 1] and ev[0][0][:, 0].tolist() == [0, 11, 22, 33]
    capped = list(data.evaluation_batches(toks, 10, 2, max_batches=1))
    assert capped[0][0][:, 0].tolist() == [0, 88]  # spread over the stream
    assert [x[:, 0].tolist() for x, _ in data.evaluation_batches(toks, 10, 8, rank=1, world_size=2)] == [
        [11, 33, 55, 77]]


def test_prepare_tokenfile_round_trip_and_errors(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} ü"}) + "\n" for i in range(300)))
    tok = data.ByteTokenizer()
    tf = data.prepare(src, tmp_path / "out" / "train.bin", "bytes", show_progress=False)
    expect = data.pack_documents(data.iter_documents(src), tok).tokens
    assert tf.dtype == np.uint16 and isinstance(tf.tokens, np.memmap)
    assert np.array_equal(np.asarray(tf.tokens), expect) and tf.meta["num_documents"] == 300
    tf.verify()
    assert not list((tmp_path / "out").glob(".*tmp*"))  # temporary file renamed away
    again = data.load_corpus(tmp_path / "out", tok, split="train")
    assert isinstance(again, data.TokenFile) and len(again) == len(expect)
    x, _ = next(data.PackedBatches(again, 16, 4, seed=0))
    assert x.shape == (4, 16)
    small = data.prepare(src, tmp_path / "cap.bin", "bytes", max_tokens=1000, show_progress=False)
    assert len(small) == 1000 and np.array_equal(np.asarray(small.tokens), expect[:1000])
    raw = (tmp_path / "out" / "train.bin").read_bytes()
    (tmp_path / "out" / "train.bin").write_bytes(raw[:-10])
    with pytest.raises(ValueError, match=f"file truncated: expected {len(expect)} tokens, found "
                                         f"{len(expect) - 5}; re-run elastic-ssm prepare"):
        data.TokenFile(tmp_path / "out" / "train.bin")
    (tmp_path / "out" / "train.bin").write_bytes(raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
    with pytest.raises(ValueError, match="sha256 mismatch"):
        data.TokenFile(tmp_path / "out" / "train.bin").verify()
    (tmp_path / "out" / "train.bin.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing sidecar"):
        data.TokenFile(tmp_path / "out" / "train.bin")


def test_load_corpus_stdlib_in_memory():
    arr = data.load_corpus("stdlib", "bytes", split="validation", max_bytes=20_000)
    assert isinstance(arr, data.TokenArray) and arr.vocab_size == 260
    seps = int((arr.tokens == 259).sum())
    assert seps >= 1 and len(arr) == 20_000 + seps


def test_mqar_shapes_and_labels():
    x, y = data.mqar(16, 64, num_pairs=8, vocab_size=128, seed=0)
    assert x.shape == y.shape == (16, 64) and x.dtype == y.dtype == torch.int64
    assert ((y != data.IGNORE).sum(1) == 8).all()
    for row_x, row_y in zip(x, y):
        pairs = dict(zip(row_x[0:16:2].tolist(), row_x[1:16:2].tolist()))
        assert len(pairs) == 8 and all(k < 64 <= v for k, v in pairs.items())
        scored = (row_y != data.IGNORE).nonzero().flatten()
        assert (scored >= 16).all()
        assert all(pairs[int(row_x[t])] == int(row_y[t]) for t in scored)
    x2, y2 = data.mqar(16, 64, num_pairs=8, vocab_size=128, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="too short"):
        data.mqar(1, 20, num_pairs=8)


def test_palindrome_and_stream():
    x, y = data.palindrome(4, 20, vocab_size=10, seed=1)
    assert x.shape == y.shape == (4, 20) and ((y != data.IGNORE).sum(1) == 10).all()
    assert (x[:, 10] == 1).all() and torch.equal(y[:, 10:20], x[:, :10].flip(1))
    logits = torch.nn.functional.one_hot(y.clamp(min=0), 10).float()
    assert data.masked_accuracy(logits, y) == 1.0
    s1 = data.synthetic_batches("mqar", 4, 32, seed=5, num_pairs=4, vocab_size=64)
    s2 = data.synthetic_batches("mqar", 4, 32, seed=5, start_step=1, num_pairs=4, vocab_size=64)
    next(s1)
    assert torch.equal(next(s1)[0], next(s2)[0])
    with pytest.raises(ValueError, match="unknown synthetic task"):
        next(data.synthetic_batches("listops", 1, 8))


def test_cap_bytes_cuts_exactly_and_reads_nothing_past_the_cap():
    from elastic_ssm.data.corpora import cap_bytes

    pulled = []

    def docs():
        for d in (b"abc", b"defg", b"hi"):
            pulled.append(d)
            yield d

    assert list(cap_bytes(docs(), 5)) == [b"abc", b"de"] and pulled == [b"abc", b"defg"]
    assert list(cap_bytes(["ab", "c"], None)) == ["ab", "c"] and list(cap_bytes([b"x"], 0)) == []


def test_bpe_trains_on_a_list_of_long_document_strings(tmp_path):
    """A list of texts longer than a file name may be (or holding a NUL byte) is read as documents, not refused by
    the OS as a path."""
    docs = [("def f(x):\n    return x * 2\n" * 200) + str(i) for i in range(20)] + ["a\0b " * 50]
    tok = data.train_bpe(docs, 300, tmp_path / "long.json")
    assert 260 < tok.vocab_size <= 300 and tok.decode(tok.encode(docs[0])) == docs[0]   # merges learned from them


def test_a_validation_source_of_its_own_is_read_whole(tmp_path):
    """data.val_source naming a text file of its own: all of it is validation (only its last 2% were read, as if it
    were the training source's split); a prepared folder's or named corpus's validation split stays the split."""
    from types import SimpleNamespace

    from elastic_ssm.config import RunConfig
    from elastic_ssm.pipeline import _validation_split, build_data

    text = "".join(f"line {i} of the held-out text, all of it validation\n" for i in range(400))
    (tmp_path / "val.txt").write_text(text)
    (tmp_path / "train.txt").write_text(text.upper() * 4)
    run = RunConfig(model={"arch": "essh", "preset": "tiny"})
    run.train.seq_len, run.train.micro_batch_size, run.train.eval.batches = 64, 1, 10_000
    run.data.source, run.data.val_source = str(tmp_path / "train.txt"), str(tmp_path / "val.txt")
    windows = len(build_data(run).val_batches)       # one window of 64 (+1) tokens a batch, bytes tokenizer
    assert len(text) // 65 - 1 <= windows <= len(text) // 65 + 1         # the 2% split held 6
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "validation.bin").write_bytes(b"")
    for v, want in (("", "validation"), ("stdlib", "validation"), ("hf:x", "validation"), ("pysrc", "validation"),
                    (str(tmp_path / "prepared"), "validation"), (str(tmp_path / "val.txt"), None)):
        assert _validation_split(SimpleNamespace(val_source=v, source="stdlib")) == want
