"""``prepare`` edges (issue 40 items 9-11): one writer per output, stale temporaries of dead writers cleaned, and a
token file corrupted without a change of size or a damaged sidecar refused before training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
from harness import REPO

import elastic_ssm as es
from elastic_ssm.cli import main

HOLD = """
import sys, time
from elastic_ssm.train.rundir import RunLock
RunLock(sys.argv[1], owner="prepare writing train.bin", flag="OUT", name=".train.bin.lock").acquire()
print("held", flush=True)
time.sleep(120)
"""


def _err_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and "/s]" not in line and "tok/" not in line]


def _corpus(root):
    src = root / "corpus.txt"
    src.write_text("".join(f"line {i} of the corpus\n" for i in range(2000)))
    return src


def test_second_prepare_into_one_output_is_refused_naming_the_holder(tmp_path, capsys):
    src, out = _corpus(tmp_path), tmp_path / "data" / "train.bin"
    out.parent.mkdir()
    stale = out.parent / ".train.bin.live.tmp"          # the live writer's temporary file: never touched
    stale.write_bytes(b"x")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out.parent)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = main(["prepare", str(src), str(out)])
        err = _err_lines(capsys.readouterr().err)
        assert rc == 2 and len(err) == 1, err
        assert f"pid {holder.pid}" in err[0] and "prepare writing train.bin" in err[0], err
        assert not out.exists() and stale.exists()
        rc = main(["prepare", str(src), str(out.parent / "validation.bin")])   # another output of the folder: free
        assert rc == 0
    finally:
        holder.kill()
        holder.wait()
    assert main(["prepare", str(src), str(out)]) == 0      # the holder is gone: its lock went with it
    assert out.is_file() and not stale.exists()
    assert main(["prepare", str(src), str(tmp_path / "new" / "sub" / "x.bin"), "--tokenizer", "missing.json"]) == 2
    assert not (tmp_path / "new").exists()                  # a refused prepare leaves no folder and no lock file


def test_prepare_removes_temporaries_of_an_interrupted_prepare(tmp_path, capsys):
    src, out = _corpus(tmp_path), tmp_path / "train.bin"
    left = [tmp_path / ".train.bin.k3j2_x.tmp", tmp_path / ".train.bin.json.q9w8.tmp"]
    other = tmp_path / ".validation.bin.a1.tmp"             # another output's: not this prepare's to remove
    for p in [*left, other]:
        p.write_bytes(b"\0" * 100)
    old = time.time() - 3600
    os.utime(left[0], (old, old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["prepare", str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert not any(p.exists() for p in left) and other.exists()
    notices = [line for line in err.splitlines() if line.startswith("[prepare] removed")]
    assert len(notices) == 2 and all("interrupted prepare of train.bin" in n for n in notices), err


def test_a_token_file_corrupted_in_place_is_refused_before_training(tmp_path, capsys):
    import harness

    cfg = harness.write_run(tmp_path, steps=2)
    out = tmp_path / "data" / "train.bin"
    assert main(["prepare", str(tmp_path / "corpus.txt"), str(out)]) == 0
    size = out.stat().st_size
    with open(out, "r+b") as f:                          # flip bytes in the middle; the size stays
        f.seek(size // 2)
        b = f.read(8)
        f.seek(size // 2)
        f.write(bytes(x ^ 0x5A for x in b))
    assert out.stat().st_size == size
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "corpus.txt"), str(out)))
    capsys.readouterr()
    for extra, words in (([], ("sampled fingerprint",)), (["--verify_data"], ("sha256 mismatch",))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = main(["train", "--config", str(cfg), "--train.out_dir", str(tmp_path / "run"), *extra])
        err = _err_lines(capsys.readouterr().err)
        assert rc == 2 and len(err) == 1, err
        assert str(out) in err[0] and "re-run elastic-ssm prepare" in err[0] and all(w in err[0] for w in words), err
        assert not (tmp_path / "run" / "pretrain").exists()


def test_jsonl_rows_without_text_are_one_line_user_errors(tmp_path, capsys):
    """A JSONL row lacking the text field, or holding a number or list there, is the user's data, not a bug: one
    line naming the file and line and ``--text_field``, exit code 2 (was a KeyError / TypeError called a bug)."""
    for name, rows, said in (("missing", '{"body": "x"}\n', "no 'text' field"),
                             ("number", '{"text": "ok"}\n{"text": 1}\n', "holds int"),
                             ("list", '[1, 2]\n', "no 'text' field")):
        src = tmp_path / f"{name}.jsonl"
        src.write_text(rows)
        rc = main(["prepare", str(src), str(tmp_path / f"{name}.bin"), "--quiet"])
        err = _err_lines(capsys.readouterr().err)
        assert rc == 2 and len(err) == 1, err
        assert said in err[0] and f"{src}:" in err[0] and "--text_field" in err[0], err
        assert "probably a bug" not in err[0], err
        assert not (tmp_path / f"{name}.bin").exists()


def _edit(key, value):
    def edit(meta):
        meta.pop(key) if value is None else meta.__setitem__(key, value)
        return meta
    return edit


@pytest.mark.parametrize("edit,needles", [
    (lambda meta: [1], ["not an elastic_ssm token sidecar", "[1]"]),
    (_edit("dtype", "foo"), ["dtype is 'foo'", "'uint16' or 'uint32'"]),
    (_edit("dtype", "float32"), ["dtype is 'float32'"]),             # same bytes read as floats: never used
    (_edit("dtype", None), ["it has no dtype"]),
    (_edit("count", "abc"), ["count is 'abc'", "an integer"]),
    (_edit("vocab_size", None), ["it has no vocab_size"]),
])
def test_a_damaged_sidecar_is_one_line_naming_it_in_train_and_eval(tmp_path, capsys, edit, needles):
    """A sidecar that is not an object or lacks / mistypes dtype, count or vocab_size is a user error naming the
    sidecar and the key (it was an "unexpected KeyError / TypeError / AttributeError ... probably a bug", exit 1,
    or an int() message without a file)."""
    out = tmp_path / "x.bin"
    assert main(["prepare", str(_corpus(tmp_path)), str(out)]) == 0
    sidecar = out.with_name("x.bin.json")
    sidecar.write_text(json.dumps(edit(json.loads(sidecar.read_text()))))
    model = tmp_path / "model"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(model)
    capsys.readouterr()
    for argv in (["train", "--model.preset", "tiny", "--data.source", str(out), "--train.out_dir",
                  str(tmp_path / "run"), "--train.steps", "1", "--train.device", "cpu"],
                 ["eval", str(model), "--data", str(out), "--seq_len", "16", "--batch_size", "1", "--n_batches", "1",
                  "--device", "cpu"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(argv) == 2
        err = _err_lines(capsys.readouterr().err)
        assert len(err) == 1 and str(sidecar) in err[0] and "re-run elastic-ssm prepare" in err[0], err
        assert all(n in err[0] for n in needles), err
        assert not (tmp_path / "run" / "pretrain").exists()


def test_compressed_sources_are_read_by_their_bytes_not_their_name(tmp_path, capsys):
    """A gzip file named ``.GZ`` is decompressed (its compressed bytes were tokenized as text), and a zstd / bzip2 /
    xz file is refused in one line rather than tokenized as text."""
    import bz2
    import gzip
    import lzma
    (tmp_path / "t.TXT.GZ").write_bytes(gzip.compress(b"hello text\n"))
    assert main(["prepare", str(tmp_path / "t.TXT.GZ"), str(tmp_path / "t.bin")]) == 0
    assert bytes(es.data.TokenFile(tmp_path / "t.bin").tokens[:-1].astype("uint8")) == b"hello text\n"
    for name, data in [("a.jsonl.zst", b"(\xb5/\xfd\x04X"), ("b.txt.bz2", bz2.compress(b"x")),
                       ("c.txt", lzma.compress(b"x"))]:
        (tmp_path / name).write_bytes(data)
        capsys.readouterr()
        assert main(["prepare", str(tmp_path / name), str(tmp_path / f"{name}.bin")]) == 2
        err = _err_lines(capsys.readouterr().err)
        assert len(err) == 1 and "-compressed" in err[0] and "decompress it first" in err[0], err
        assert not (tmp_path / f"{name}.bin").exists()


def test_damaged_gzip_or_parquet_source_is_named_in_one_line(tmp_path, capsys):
    """A truncated gzip file was an 'unexpected EOFError' (a bug report), a damaged Parquet file in a folder an
    error naming no file."""
    import gzip
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("fine\n")
    (tmp_path / "d" / "b.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(b"hello text\n" * 50)[:20])
    for src, what in [(tmp_path / "t.txt.gz", "damaged gzip data"), (tmp_path / "d", "not a readable Parquet")]:
        capsys.readouterr()
        assert main(["prepare", str(src), str(tmp_path / "out.bin")]) == 2
        err = _err_lines(capsys.readouterr().err)
        assert len(err) == 1 and what in err[0] and src.name in err[0] and "error:" in err[0], err
