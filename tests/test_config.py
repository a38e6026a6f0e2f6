import dataclasses
from pathlib import Path

import pytest

import elastic_ssm as es
from elastic_ssm.config import ConfigError


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
    for cls in (es.ESSHConfig, es.ESSSMConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_every_yaml_in_configs_loads():
    root = Path(__file__).resolve().parents[1]
    files = sorted([*root.glob("configs/*.yaml"), *root.glob("elastic_ssm/configs/*.yaml")])
    assert files, "configs/ holds no YAML files"
    from elastic_ssm.config import load_any_config

    for f in files:
        load_any_config(f)


def test_exponent_floats_written_without_a_dot_load_from_yaml(tmp_path):
    from elastic_ssm.run_config import RunConfig

    path = tmp_path / "run.yaml"
    path.write_text("model: {arch: essh, preset: tiny}\ntrain: {lr: 3e-4, weight_decay: 1E-2}\n")
    run = RunConfig.from_yaml(path)                  # PyYAML reads both as strings (YAML 1.1)
    assert run.train.lr == 3e-4 and run.train.weight_decay == 1e-2
    path.write_text("model: {arch: essh, preset: tiny}\ntrain: {lr: fast}\n")
    with pytest.raises(es.ConfigError, match="lr: expected float, got 'fast'"):
        RunConfig.from_yaml(path)
