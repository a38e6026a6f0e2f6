"""Standard modules, standard tools (issue #13 part 4): projections are ``nn.Linear`` and the embedding an
``nn.Embedding``, so torchao (int8 dynamic, int8 weight-only) and PEFT LoRA work on an exported tier (and torchao on
the shared model at every tier); files written in
the layout before ``nn.Linear`` (``tests/fixtures/legacy_layout``, written by commit 3d59bf4) are refused in one
line."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import elastic_ssm as es
from elastic_ssm.config import model_config_from_dict
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.model_dir import CheckpointError

LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_layout"
PROJECTIONS = ("in_proj", "out_proj", "qkv", "out", "w_in", "w_out")


@pytest.fixture(scope="module")
def export():
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()   # as initialised
    return model, es.export_tier(model, "T4").eval(), torch.randint(0, 260, (2, 20))


def test_every_projection_is_an_nn_linear_and_counts_stay_exact(export):
    model, small, _ = export
    kinds = {type(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    assert kinds == {nn.Linear} and type(model.embed) is nn.Embedding
    essm = es.ESSSM(es.ESSSMConfig.preset("tiny"))
    assert all(type(b.mixer.proj) is nn.Linear for b in essm.blocks)
    assert sum(p.numel() for p in small.parameters()) == model.num_parameters("T4")


def _int8_dynamic(model):
    """torchao's int8 dynamic quantization (int8 weights, activations quantized per call): the successor of the
    deprecated ``torch.ao.quantization.quantize_dynamic``; the modules stay ``nn.Linear``."""
    pytest.importorskip("torchao", reason="torchao is in the dev extra")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    q = copy.deepcopy(model)
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    return q


def test_int8_dynamic_changes_the_logits_a_little_and_decodes(export):
    model, small, ids = export
    q = _int8_dynamic(small)
    w = q.blocks[0].mixer.in_proj.weight
    assert type(q.blocks[0].mixer.in_proj) is nn.Linear and type(w) is not torch.Tensor and type(w.data) is not \
        torch.Tensor                                           # int8 weights inside the standard module
    with torch.no_grad():
        ref, out = small(ids), q(ids)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel                                 # int8: a small, measurable change
    gen = q.generate(ids[:, :6], max_new_tokens=4)            # the reference step runs the quantized modules
    assert gen.shape == (2, 10) and torch.equal(gen[:, :6], ids[:, :6])
    with pytest.raises(ValueError, match="fast=True: the fused decoder reads nn.Linear weights"):
        q.generate(ids[:, :6], max_new_tokens=2, fast=True)


def test_the_shared_model_quantized_by_torchao_still_slices_its_tiers():
    """torchao keeps nn.Linear and slices its int8 weights by rows and columns: the shared model runs at every
    tier, near the float model at that tier."""
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny"))).eval()
    ids = torch.randint(0, 260, (2, 16))
    shared = _int8_dynamic(model)
    with torch.no_grad():
        for tier in ("T2", "T6", "T10"):
            ref, out = model(ids, tier=tier), shared(ids, tier=tier)
            assert 0 < ((out - ref).norm() / ref.norm()).item() < 0.05, tier


class _Wrapped(nn.Module):
    """A projection swapped for a module that is not ``nn.Linear`` (what eager-mode quantization tools do)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features   # as quantized modules keep

    def forward(self, x):
        return self.inner(x)


def test_a_projection_that_is_not_nn_linear_runs_only_at_full_width(export):
    model, _, ids = export
    shared = copy.deepcopy(model)
    shared.blocks[0].mixer.in_proj = _Wrapped(shared.blocks[0].mixer.in_proj)
    with torch.no_grad():
        torch.testing.assert_close(shared(ids), model(ids))    # full width: the module computes
        with pytest.raises(ValueError, match="runs only at the full width of the model; export the tier first"):
            shared(ids, tier="T2")


def test_int8_dynamic_on_an_es_ssm_export():
    torch.manual_seed(0)
    small = es.export_tier(es.ESSSM(es.ESSSMConfig.preset("tiny")).eval(), 4).eval()
    ids = torch.randint(0, 260, (2, 16))
    q = _int8_dynamic(small)
    with torch.no_grad():
        ref, out = small(ids), q(ids)
    assert 0 < ((out - ref).norm() / ref.norm()).item() < 0.05
    assert q.generate(ids[:, :4], max_new_tokens=3).shape == (2, 7)


def test_torchao_int8_weight_only_runs_and_decodes_with_the_reference_step(export):
    pytest.importorskip("torchao", reason="torchao is in the dev extra")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    _, small, ids = export
    q = copy.deepcopy(small)
    quantize_(q, Int8WeightOnlyConfig())
    with torch.no_grad():
        ref, out = small(ids), q(ids)
    assert 0 < ((out - ref).norm() / ref.norm()).item() < 0.05
    assert q.generate(ids[:, :6], max_new_tokens=3).shape == (2, 9)


def _train_two_steps(model, step_loss):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        step_loss().backward()
        opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if "lora_" in n}
    return changed, adapters


def test_peft_lora_on_an_export_trains_only_the_adapters(export):
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    _, small, ids = export
    pm = peft.get_peft_model(copy.deepcopy(small), peft.LoraConfig(r=4, target_modules=list(PROJECTIONS)))
    changed, adapters = _train_two_steps(
        pm, lambda: F.cross_entropy(pm(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    assert len(adapters) == 2 * 2 * len(PROJECTIONS) and changed == adapters   # A and B of every target
    pm.eval()
    with torch.no_grad():
        assert not torch.allclose(pm(ids), small(ids))
    assert pm.generate(ids[:, :6], max_new_tokens=2).shape == (2, 8)


def test_peft_lora_through_the_transformers_adapter(export, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import elastic_ssm.hf  # noqa: F401  (registers the Auto classes)

    _, small, ids = export
    small.save_pretrained(tmp_path / "t4")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "t4")
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["in_proj", "out_proj", "w_in", "w_out"])
    pm = peft.get_peft_model(hf, cfg)
    changed, adapters = _train_two_steps(pm, lambda: pm(input_ids=ids, labels=ids).loss)
    assert adapters and changed == adapters
    pm.eval()
    assert pm.generate(input_ids=ids[:, :6], max_new_tokens=2, do_sample=False).shape == (2, 8)


@pytest.mark.parametrize("cls,name", [(es.ESSH, "essh"), (es.ESSSM, "es_ssm")])
def test_a_directory_of_the_old_layout_is_refused_in_one_line(cls, name):
    """Files of the layout before ``nn.Linear`` (commit 3d59bf4) are not converted any more (issue 38: no
    compatibility code before 1.0); loading one, whole or at a tier, and ``load_state_dict`` of its tensors (how a
    training checkpoint resumes) each fail in one line that names the layout and the commits that convert it."""
    path = LEGACY / name
    for tier in (None, 2 if cls is es.ESSSM else "T2"):
        with pytest.raises(CheckpointError, match=r"written before the projections became nn.Linear.*5572818") as e:
            cls.from_pretrained(path, tier=tier)
        assert "\n" not in str(e.value) and str(path / "model.safetensors") in str(e.value)
    saved = json.loads((path / "config.json").read_text())
    fresh = cls(model_config_from_dict({"arch": saved["arch"], **saved["config"]}))
    with pytest.raises(ValueError, match=r"the state dict holds blocks\.0\..* before the projections became") as e:
        fresh.load_state_dict(load_file(str(path / "model.safetensors")))
    assert "\n" not in str(e.value)


@pytest.mark.gpu
def test_torchao_int8_weight_only_on_cuda_at_370m():
    """Part 4: torchao int8 weight-only quantization runs on GPU on a 370m T4 export (bf16): the logits move
    by a small measured amount and the quantized model generates through the reference step."""
    torchao = pytest.importorskip("torchao", reason="torchao is in the dev extra; carry its wheel to the GPU")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = es.ESSH(es.ESSHConfig.preset("370m")).cuda().to(torch.bfloat16).eval()
    small = es.export_tier(model, "T4").eval()
    del model
    ids = torch.randint(0, small.config.vocab_size, (2, 64), device="cuda")
    q = copy.deepcopy(small)
    quantize_(q, Int8WeightOnlyConfig())
    assert type(q.blocks[0].mixer.in_proj.weight) is not nn.Parameter   # torchao's int8 tensor subclass
    with torch.no_grad():
        ref, out = small(ids).float(), q(ids).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"torchao {torchao.__version__} int8 weight-only, 370m T4, cuda bf16: relative logit change {rel:.4f}")
    assert 0 < rel < 0.15, rel   # H200, random init, bf16 against bf16: 0.063 measured (docs/benchmarks.md)
    gen = q.generate(ids[:, :8], max_new_tokens=8)
    assert gen.shape == (2, 16) and torch.equal(gen[:, :8], ids[:, :8])
