"""Bad tensor input to a model, in every architecture: ``forward`` and ``generate`` raise a ValueError (a
TypeError for a list instead of a tensor) that names the argument: empty or non-integer ids, ids outside the
vocabulary, attention masks of the wrong shape or values, a mask that is not a tensor."""

import pytest
import torch

import elastic_ssm as es


@pytest.mark.parametrize("make,match", [
    (lambda: dict(input_ids=torch.zeros(0, 8, dtype=torch.long)), "is empty"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(1, 8)), r"\[B, T\]"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 7)), r"\[B, T\]"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(8)), "never broadcast"),
    (lambda: dict(input_ids=torch.full((1, 4), 999)), "vocab_size"),
    (lambda: dict(input_ids=torch.zeros(1, 4)), "integer"),
])
def test_model_inputs_are_checked(make, match):
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(ValueError, match=match):
        model(**make())


MASKS = [
    (torch.full((2, 8), 0.5), "only 0 .padding. and 1"),                # not a mask: never silently rounded
    (torch.tensor([[1] * 8, [0] * 8]), "at least one real token"),      # a row with nothing to predict from
]


@pytest.mark.parametrize("arch", ["essh", "transformer", "es_ssm"])
def test_attention_masks_are_checked_in_every_architecture(arch):
    """Mask values, rows without a real token and (for the baselines too) the [B, T] shape; a cache prefill
    needs left padding. Ids out of the vocabulary and a list instead of a tensor are named, not an IndexError."""
    from elastic_ssm.models import build_model

    cfg = {"essh": es.ESSHConfig, "transformer": es.config.TransformerConfig, "es_ssm": es.ESSSMConfig}[arch]
    model = build_model(cfg.preset("tiny"), seed=0)
    ids = torch.randint(0, 200, (2, 8))
    for mask, match in [*MASKS, (torch.ones(1, 8), "attention_mask must")]:
        with pytest.raises(ValueError, match=match):
            model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="vocab"):
        model(torch.full((1, 4), 10_000))
    with pytest.raises(TypeError, match="torch.Tensor"):
        model([[1, 2, 3]])
    right = torch.tensor([[1] * 6 + [0] * 2, [1] * 8])
    model(ids, attention_mask=right)                 # no cache: causal, the padding after the tokens is harmless
    if arch == "essh":
        with pytest.raises(ValueError, match="LEFT padding"):
            model(ids, attention_mask=right, cache=model.allocate_cache(2))


def test_generate_names_a_mask_that_is_not_a_tensor():
    """It was ``AttributeError: 'list' object has no attribute 'dim'``."""
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model.generate(torch.tensor([[1, 2, 3]]), 2, attention_mask=[[1, 1, 1]])
