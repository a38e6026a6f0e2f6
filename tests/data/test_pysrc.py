"""The ``pysrc`` source: Python files under roots, deduplicated by content, split by file, cached as tokens."""

import subprocess
import sys

import numpy as np
import pytest

from elastic_ssm import data
from elastic_ssm.data import pysrc


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """Two roots of .py files: 40 distinct files, a copy of one of them in the second root, a cache folder."""
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    for i in range(40):
        f = a / f"pkg{i % 4}" / f"mod{i}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"def f{i}():\n    return {i} * {i}\n" * (1 + i % 3))
    (a / "pkg0" / "__pycache__").mkdir()
    (a / "pkg0" / "__pycache__" / "mod0.py").write_text("skipped\n")
    (a / "notes.txt").write_text("not python\n")
    (b / "vendored").mkdir(parents=True)
    (b / "vendored" / "copy.py").write_bytes((a / "pkg1" / "mod5.py").read_bytes())
    (b / "vendored" / "own.py").write_text("x = 1\n")
    return a, b


def test_split_by_file_dedup_and_sizes(roots):
    a, b = roots
    spec = f"pysrc:{a},{b}"
    m = pysrc.manifest(spec)
    assert len(m.files) == 41 and m.duplicates == 1                 # 40 + own.py; copy.py dropped
    assert "root1/vendored/copy.py" not in m.files and "root0/pkg1/mod5.py" in m.files
    assert not any("__pycache__" in n or n.endswith(".txt") for n in m.files)
    train, val = m.splits["train"], m.splits["validation"]
    assert sorted(train + val) == sorted(m.files) and not set(train) & set(val) and len(val) >= 8
    docs = {s: b"".join(data.iter_documents(spec, s)) for s in ("train", "validation")}
    want = {s: b"".join(open(m.files[n], "rb").read() for n in m.splits[s]) for s in docs}
    assert docs == want                                             # whole files, name order
    tokens = {s: data.load_corpus(spec, "bytes", split=s) for s in ("train", "validation")}
    for s, tf in tokens.items():
        assert isinstance(tf, data.TokenFile)                       # prepared into the cache, memory-mapped
        assert len(tf) == len(docs[s]) + len(m.splits[s])           # a SEP after every file
        assert tf.meta["pysrc"]["files"] == len(m.splits[s]) and tf.meta["pysrc"]["bytes"] == len(docs[s])
    from elastic_ssm.data.pysrc import describe_split_files

    line = describe_split_files(tokens["train"].meta, tokens["validation"].meta)
    assert f"train {len(train):,} files" in line and "1 duplicate files" in line


def test_deterministic_and_membership_stable(roots, tmp_path):
    a, b = roots
    spec = f"pysrc:{a},{b}"
    first = pysrc.manifest(spec, cache=False)
    again = pysrc.manifest(spec)                                    # through the on-disk manifest cache
    assert (first.splits, first.key) == (again.splits, again.key)
    before = data.load_corpus(spec, "bytes", split="validation")
    (a / "pkg9").mkdir()
    (a / "pkg9" / "new.py").write_text("y = 2\n")                   # a new file moves no other file
    grown = pysrc.manifest(spec)
    for s in ("train", "validation"):
        assert set(first.splits[s]) <= set(grown.splits[s])
    assert grown.key != first.key
    after = data.load_corpus(spec, "bytes", split="train")          # a new cache entry, not the stale one
    assert after.meta["pysrc"]["files"] == len(grown.splits["train"])
    assert np.array_equal(np.asarray(before.tokens), np.asarray(data.load_corpus(spec, "bytes",
                                                                                   split="validation").tokens))


def test_default_spec_names_stdlib_and_site_packages():
    labels = [lab for lab, _ in pysrc.pysrc_roots("pysrc")]
    assert labels[0] == "stdlib" and labels[1].startswith("site-packages")


@pytest.mark.parametrize("spec, message", [("pysrc:/no/such/folder", "is not a folder"),
                                           ("pysrc:", "give folders after 'pysrc:'")])
def test_bad_root_is_one_line(spec, message):
    with pytest.raises(FileNotFoundError, match=message):
        pysrc.manifest(spec)


def test_bad_root_on_the_command_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "elastic_ssm.cli", "train", "--config", "configs/tiny.yaml",
                        "--data.source", f"pysrc:{tmp_path / 'missing'}", "--train.out_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=pysrc.Path(__file__).resolve().parents[2])
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "is not a folder" in p.stderr and len(p.stderr.strip().splitlines()) == 1
