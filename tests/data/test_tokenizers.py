"""A model whose recorded tokenizer lost its files says so (and what to do), not that a package is missing."""

import pytest

import elastic_ssm as es
from elastic_ssm.data import ByteTokenizer
from elastic_ssm.data.tokenizers import resolve_tokenizer
from elastic_ssm.models import load_pretrained


def test_missing_tokenizer_files_are_named_with_the_fix(tmp_path):
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.tokenizer = ByteTokenizer()
    model.save_pretrained(tmp_path / "m")
    saved = [p.name for p in (tmp_path / "m").iterdir() if "tokenizer" in p.name and p.suffix == ".json"]
    assert resolve_tokenizer(load_pretrained(tmp_path / "m")).vocab_size == ByteTokenizer.vocab_size
    for name in saved:
        (tmp_path / "m" / name).unlink()
    bare = load_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="has no files in .*copy them back.*--tokenizer") as err:
        resolve_tokenizer(bare)
    assert "tokenizers` package" not in str(err.value)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from elastic_ssm.data.tokenizers import train_bpe

    d = tmp_path_factory.mktemp("bpe")
    (d / "c.txt").write_text("def main():\n    return 1\n" * 50)
    return train_bpe([str(d / "c.txt")], 280, d / "tokenizer.json")


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_encode_names_a_document_that_is_not_text(request, which):
    """ByteTokenizer().encode(5) was five zero bytes, [0, 0, 0, 0, 0]; a lone surrogate was a UnicodeEncodeError
    (bytes) or the tokenizers library's 'TextInputSequence must be str' (BPE), naming neither character nor place."""
    tok = ByteTokenizer() if which == "bytes" else request.getfixturevalue("bpe")
    for doc in (5, None, [1, 2]):
        with pytest.raises(TypeError, match="encode takes a str .or UTF-8 bytes., got"):
            tok.encode(doc)
    for call in (tok.encode, tok.encode_np, lambda d: tok.encode_batch_np(["ok", d])):
        with pytest.raises(ValueError, match="lone surrogate U.DC80 at character 1, not valid UTF-8"):
            call("a\udc80b")
    assert tok.encode("") == [] and tok.decode(tok.encode("def x")) == "def x"
    assert tok.encode(b"def") == tok.encode("def")


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_decode_drops_ids_outside_the_vocabulary_and_names_ids_that_are_not_integers(request, which):
    """decode([104.7]) truncated the float to 104 ('h'); an id beyond 64 bits was numpy's OverflowError traceback
    (bytes). Ids outside the vocabulary are dropped, of any size; a float or a string is a one-line TypeError."""
    np, torch = pytest.importorskip("numpy"), pytest.importorskip("torch")
    tok = ByteTokenizer() if which == "bytes" else request.getfixturevalue("bpe")
    ids = tok.encode("def x")
    for given in (ids, np.asarray([ids], dtype=np.uint16), torch.tensor(ids), list(torch.tensor(ids)), iter(ids)):
        assert tok.decode(given) == "def x"
    assert tok.decode([-1, *ids, 2**70, tok.vocab_size]) == "def x"
    for bad in ([ids[0] + 0.7], [ids[0], "a"], np.asarray(ids, dtype=float), torch.tensor([1.0])):
        with pytest.raises(TypeError, match=r"^decode takes integer token ids \('(float|str)' object .*round or cast"):
            tok.decode(bad)
