"""The sha256 checks of a saved model's weights: per-piece digests name a corrupted byte range, and a deferred
check (``from_pretrained(defer_verify=True)``) refuses every output of corrupted weights."""

import pytest
import torch

import elastic_ssm as es


def test_weight_piece_digests_find_a_flipped_byte(tmp_path):
    """``config.json`` carries per-piece sha256 digests; loading verifies them in parallel and names the
    corrupted byte range (``models/model_dir.py``)."""
    import json

    from elastic_ssm.models.model_dir import CheckpointError, file_piece_digests

    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    rec = meta["weights_sha256_pieces"]
    assert rec["digests"] == file_piece_digests(tmp_path / "model.safetensors", rec["piece_bytes"])
    es.ESSH.from_pretrained(tmp_path)
    small = {**rec, "piece_bytes": 4096, "digests": file_piece_digests(tmp_path / "model.safetensors", 4096)}
    meta["weights_sha256_pieces"] = small
    (tmp_path / "config.json").write_text(json.dumps(meta))
    blob = bytearray((tmp_path / "model.safetensors").read_bytes())
    blob[10000] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"model.safetensors: sha256 checksum mismatch in bytes 8192\.\.12288"):
        es.ESSH.from_pretrained(tmp_path)
    es.ESSH.from_pretrained(tmp_path, verify=False)         # the caller's choice: no check


def test_a_deferred_check_refuses_every_output_of_corrupted_weights(tmp_path):
    """``from_pretrained(defer_verify=True)`` (the default on CUDA) returns while the checksum runs; the first output
    (forward, generate, the fused decoder's step, save_pretrained) waits for it, and a mismatch is the same
    ``CheckpointError``, raised again on every later call. Good weights load, verify and answer as a blocking load."""
    import copy
    import pickle

    from elastic_ssm.models.fast_decode import FastDecoder
    from elastic_ssm.models.model_dir import CheckpointError

    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.save_pretrained(tmp_path / "good")
    ids = torch.tensor([[1, 2, 3]])
    good = es.ESSH.from_pretrained(tmp_path / "good", defer_verify=True)
    twin = copy.deepcopy(good)                               # copies share the pending check
    assert torch.equal(good(ids), es.ESSH.from_pretrained(tmp_path / "good")(ids))
    assert good._weights_check is None and pickle.loads(pickle.dumps(twin._weights_check)) is None
    model.save_pretrained(tmp_path / "bad")
    blob = bytearray((tmp_path / "bad" / "model.safetensors").read_bytes())
    blob[-5] ^= 1                                            # a bit of a weight: the values stay finite
    (tmp_path / "bad" / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
        es.ESSH.from_pretrained(tmp_path / "bad")            # blocking (the CPU default)
    bad = es.ESSH.from_pretrained(tmp_path / "bad", defer_verify=True)
    calls = [lambda: bad(ids), lambda: bad.hidden_states(ids), lambda: bad.generate(ids, 2),
             lambda: FastDecoder(bad, "T1", 1, backend="torch").step(torch.tensor([1])),
             lambda: bad.save_pretrained(tmp_path / "copy")]
    for call in calls:
        with pytest.raises(CheckpointError, match="model.safetensors: sha256 checksum mismatch"):
            call()
    assert not (tmp_path / "copy" / "model.safetensors").exists()
