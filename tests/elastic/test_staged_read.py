"""The staged whole-file read (``elastic/slicing.py``) against safetensors itself: every dtype and shape the
format holds, reads split across tensors by small chunks, and headers it must not trust (it returns None and the
caller's safetensors path reports them)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from elastic_ssm.elastic.slicing import parse_header, read_to_device


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"emb": torch.randn(37, 5, generator=g).to(torch.bfloat16), "w": torch.randn(3, 7, generator=g),
               "h": torch.randn(4, generator=g).half(), "d": torch.randn(2, 2, generator=g).double(),
               "ids": torch.arange(11), "i32": torch.arange(3, dtype=torch.int32), "flag": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("chunk,readers", [(1, 4), (7, 1), (7, 3), (64, 8), (1 << 20, 4)])
def test_every_tensor_equals_safetensors_own_load(saved, chunk, readers):
    """Pieces split across tensors, read by several threads into reused buffers, land where they belong."""
    want = load_file(saved)
    got = read_to_device(saved, "cpu", chunk=chunk, readers=readers)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def _rewrite(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    header, body = edit(header, body)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + body)


@pytest.mark.parametrize("edit", [
    lambda h, b: (h, b[:-1]),                                                     # truncated data
    lambda h, b: (h, b + b"\0"),                                                  # bytes past the last tensor
    lambda h, b: ({**h, "w": {**h["w"], "dtype": "F8_E4M3"}}, b),                 # a dtype it does not read
    lambda h, b: ({**h, "w": {**h["w"], "shape": [3, 8]}}, b),                    # size and shape disagree
    lambda h, b: ({**h, "h": {**h["h"], "data_offsets": [h["h"]["data_offsets"][0] + 1,
                                                         h["h"]["data_offsets"][1] + 1]}}, b),   # a gap, misaligned
], ids=["truncated", "trailing", "dtype", "shape", "gap"])
def test_a_header_it_cannot_trust_is_left_to_safetensors(saved, edit):
    _rewrite(saved, edit)
    assert parse_header(saved) is None and read_to_device(saved, "cpu") is None


def test_garbage_and_a_huge_header_length_are_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    assert read_to_device(bad, "cpu") is None
    bad.write_bytes(struct.pack("<Q", 8) + b"not json")
    assert read_to_device(bad, "cpu") is None


def test_a_file_that_shrinks_after_its_header_was_read_is_left_to_safetensors(saved, monkeypatch):
    """The readers meet the end of the file early (another process truncated it): None, every thread joined."""
    import threading

    import elastic_ssm.elastic.slicing as staged

    parsed = parse_header(saved)
    monkeypatch.setattr(staged, "parse_header", lambda path: parsed)
    saved.write_bytes(saved.read_bytes()[:parsed[0] + 40])
    before = threading.active_count()
    assert read_to_device(saved, "cpu", chunk=8, readers=3) is None
    assert threading.active_count() == before
