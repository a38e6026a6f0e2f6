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
