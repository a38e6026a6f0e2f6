import dataclasses
import re
from pathlib import Path

import pytest

import elastic_ssm as es
from elastic_ssm.config import ConfigError, TrainConfig


@pytest.mark.parametrize("name", ["370m", "1.5b", "tiny", "small"])
def test_essh_preset_yaml_round_trip(name, tmp_path):
    cfg = es.ESSHConfig.preset(name)
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert es.ESSHConfig.from_yaml(path) == cfg
    assert es.ESSHConfig.from_dict(cfg.to_dict()) == cfg


def test_table7_shapes():
    c = es.ESSHConfig.preset("370m")
    assert (c.n_layers, c.d_model, c.d_ff, c.value_width, c.n_heads) == (22, 896, 4608, 28, 14)
    assert c.layout.count("A") == 3 and c.layout[12] == "A"
    b = es.ESSHConfig.preset("1.5b")
    assert (b.n_layers, b.d_model, b.d_ff, b.value_width, b.vocab_size) == (28, 2048, 5632, 64, 128256)


def test_validation_names_the_field():
    with pytest.raises(ConfigError, match="divisible by n_channels"):
        es.ESSHConfig.preset("tiny", d_model=63)
    with pytest.raises(ConfigError, match="swa_layers"):
        es.ESSHConfig.preset("tiny", swa_layers=(7,))
    with pytest.raises(ConfigError, match="unknown field"):
        es.ESSHConfig.from_dict({"d_modle": 3})
    with pytest.raises(ConfigError, match="budgets"):
        es.ESSSMConfig(n_channels=8, budgets=(2, 4, 16))
    with pytest.raises(ConfigError, match="unknown ESSH preset"):
        es.ESSHConfig.preset("7b")


def test_every_field_has_help():
    from elastic_ssm import config

    classes = [getattr(config, n) for n in config.__all__ if n.endswith("Config") and n != "ModelConfig"]
    assert len(classes) >= 15
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_every_yaml_in_configs_loads():
    root = Path(__file__).resolve().parents[2]
    files = sorted([*root.glob("configs/*.yaml"), *root.glob("configs/replication/*.yaml"),
                    *root.glob("elastic_ssm/configs/*.yaml")])
    assert files, "configs/ holds no YAML files"
    from elastic_ssm.config import load_any_config

    for f in files:
        load_any_config(f)


def test_exponent_floats_written_without_a_dot_load_from_yaml(tmp_path):
    from elastic_ssm.config import RunConfig

    path = tmp_path / "run.yaml"
    path.write_text("model: {arch: essh, preset: tiny}\ntrain: {optim: {lr: 3e-4, weight_decay: 1E-2}}\n")
    run = RunConfig.from_yaml(path)                  # PyYAML reads both as strings (YAML 1.1)
    assert run.train.optim.lr == 3e-4 and run.train.optim.weight_decay == 1e-2
    path.write_text("model: {arch: essh, preset: tiny}\ntrain: {optim: {lr: fast}}\n")
    with pytest.raises(es.ConfigError, match="lr: Input should be a valid number, .*, got 'fast'"):
        RunConfig.from_yaml(path)


@pytest.mark.parametrize("text, unknown", [("train: {1: 3}", "[1]"), ("train: {~: 3, x: 1}", "[None, 'x']"),
                                           ("model: {preset: tiny, 7: 1}", "[7]"), ("3: {}\nfoo: {}", "[3, 'foo']")])
def test_a_key_that_is_not_a_string_is_named_as_unknown(tmp_path, text, unknown):
    from elastic_ssm.config import RunConfig

    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")                     # YAML reads 1, ~ and 7 as a number and null
    with pytest.raises(es.ConfigError, match=rf"unknown (field|section)\(s\) {re.escape(unknown)}"):
        RunConfig.from_yaml(path)


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd")
def test_a_run_file_from_a_pipe_or_dev_null_is_read(tmp_path):
    import os

    from elastic_ssm.config import RunConfig

    r, w = os.pipe()                                 # what --config /dev/stdin or --config <(...) names
    os.write(w, b"model: {arch: essh, preset: tiny}\ntrain: {steps: 3}\n")
    os.close(w)
    try:
        assert RunConfig.from_yaml(f"/dev/fd/{r}").train.steps == 3
    finally:
        os.close(r)
    with pytest.raises(es.ConfigError, match="/dev/null is empty"):
        RunConfig.from_yaml("/dev/null")
    with pytest.raises(es.ConfigError, match="does not exist"):
        RunConfig.from_yaml(tmp_path / "missing.yaml")


# ---- one torch-free config tree ----------------------------------------------------------------------------
_NO_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _Block())
from elastic_ssm.config import ESSHConfig, ESSSMConfig, RunConfig, TrainConfig, load_any_config
run = RunConfig()
t = TrainConfig.preset("370m")
table = ESSHConfig.preset("1.5b").tier_table()
run2 = load_any_config("configs/essh-370m-train.yaml")
spec = RunConfig.from_dict({"model": {"arch": "es_ssm", "preset": "tiny", "tier_config": "K4"}})
assert "torch" not in sys.modules
print(run.arch, t.optim.lr, table[-1].params, run2.train.refine.steps, spec.model.budgets)
"""


def test_config_package_builds_runs_presets_and_tier_tables_without_torch():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=root, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["essh", "0.0012", str(es.ESSHConfig.preset("1.5b").tier_table()[-1].params),
                                "2060", "(4,)"]


def test_run_config_is_a_typed_config_base():
    from elastic_ssm.config import ConfigBase, DataConfig, ModelConfig, RunConfig, TrainConfig, model_configs

    run = RunConfig.from_dict({"model": {"arch": "transformer", "preset": "tiny", "d_ff": 96},
                               "train": {"steps": 3, "optim": {"lr": 2e-3}}, "data": {"tokenizer": "bytes"}})
    assert isinstance(run, ConfigBase) and isinstance(run.model, ModelConfig)
    assert isinstance(run.train, TrainConfig) and isinstance(run.data, DataConfig)
    assert run.arch == "transformer" and run.model.d_ff == 96 and run.explicit_model_fields == {"d_ff"}
    assert set(model_configs()) == {"essh", "es_ssm", "transformer", "matformer"}
    back = RunConfig.from_dict(run.to_dict())
    assert back == run and back.to_dict() == run.to_dict()
    new = run.with_overrides({"n_layers": 1}, {"optim.weight_decay": 0.0, "refine.steps": 2}, {})
    assert (new.model.n_layers, new.train.optim.weight_decay, new.train.optim.lr, new.train.refine.steps) == (
        1, 0.0, 2e-3, 2)
    with pytest.raises(ConfigError, match="--train.optim.lrr"):
        run.with_overrides({}, {"optim.lrr": 1.0}, {})
    with pytest.raises(ConfigError, match="--model.d_model_x"):
        run.with_overrides({"d_model_x": 1}, {}, {})


# ---- renamed train settings ------------------------------------------------------------------------------
def _flat(train: dict) -> dict:
    from elastic_ssm.config.train import RECORD_RENAMES

    out = {k: v for k, v in train.items() if not isinstance(v, dict) or k == "refine"}
    for old, path in RECORD_RENAMES.items():
        sec, sub = path.split(".")
        out[old] = train[sec][sub]
    return out


def test_an_old_flat_train_name_is_an_unknown_key_naming_the_new_path(tmp_path):
    from elastic_ssm.config import TrainConfig

    path = tmp_path / "t.yaml"
    for old, new in [("lr", "optim.lr"), ("order_every", "ordering.every"), ("eval_every", "eval.every"),
                     ("bd_warmup_steps", "budget_dropout.warmup_steps"), ("keep_last", "checkpoint.keep_last")]:
        path.write_text(f"steps: 7\n{old}: 3\n")
        for load, arg in ((TrainConfig.from_yaml, path), (TrainConfig.from_dict, {"preset": "370m", old: 3})):
            with pytest.raises(ConfigError, match=f"unknown field.*'{old}'.*did you mean {new}[?]") as e:
                load(arg)
            assert "\n" not in str(e.value)
        with pytest.raises(TypeError):
            TrainConfig(**{old: 3})
        with pytest.raises(AttributeError):
            getattr(TrainConfig(), old)
    with pytest.raises(ConfigError, match="unknown field"):
        TrainConfig.from_dict({"lr_peak": 1e-3})
    with pytest.raises(AttributeError):
        TrainConfig().no_such_setting  # noqa: B018


def test_an_old_flat_train_record_maps_silently_to_the_sections():
    import warnings

    from elastic_ssm.config import TrainConfig

    cfg = TrainConfig.preset("370m", eval={"tiers": ("T1",)}, budget_dropout={"n_full": 4})
    old = _flat(cfg.to_dict())
    assert "optim" not in old and old["n_full"] == 4 and old["eval_tiers"] == ["T1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainConfig.upgrade_record(old) == cfg.to_dict()
    from elastic_ssm.train.preflight import config_changes

    changed = config_changes(TrainConfig.upgrade_record({**old, "kl_coef": 0.1, "eval_every": 3}), cfg.to_dict(),
                             TrainConfig.RESUME_FREE)
    assert changed == ["mixing.kl_coef: 0.1 -> 0.5"]               # eval is free, the objective is not


def test_integers_in_a_run_file_are_read_as_yaml_1_2_does(tmp_path):
    """PyYAML (YAML 1.1) read `steps: 010` as octal 8 and `1:30` as ninety, silently; a leading zero is decimal now,
    0o / 0x prefixes and digit groups (1_000) still work."""
    from elastic_ssm.config import RunConfig
    from elastic_ssm.config.base import load_yaml

    path = tmp_path / "run.yaml"
    path.write_text("model: {arch: essh, preset: tiny}\ntrain: {steps: 010, seed: 0o10, log_every: 0x10}\n")
    run = RunConfig.from_yaml(path)
    assert (run.train.steps, run.train.seed, run.train.log_every) == (10, 8, 16)
    assert load_yaml("a: 1_000\nb: 1:30\nc: -5\nd: 3e-4\ne: 1.5\nf: true", "x") == {
        "a": 1000, "b": "1:30", "c": -5, "d": "3e-4", "e": 1.5, "f": True}


@pytest.mark.parametrize("changes", [dict(grad_accum=10**12, tokens_per_step=0), dict(tokens_per_step=2**40),
                                     dict(micro_batch_size=2**20, seq_len=2**12, tokens_per_step=0)])
def test_an_optimizer_step_beyond_the_token_ceiling_is_refused_before_training(changes):
    """A flag typo (``--train.grad_accum 1000000000000``) would read for days before the first log line."""
    with pytest.raises(ConfigError, match=r"optimizer step would read [\d,]+ tokens .* more than 2,147,483,648"):
        TrainConfig(**changes)
    ok = TrainConfig(grad_accum=2**31 // (8 * 512), tokens_per_step=0, micro_batch_size=8, seq_len=512)
    assert ok.micro_batches() * 8 * 512 == 2**31
