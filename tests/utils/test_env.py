"""Environment variables the library reads: garbage is a one-line error naming the variable, never a traceback
(WORLD_SIZE=abc used to crash the error reporter itself; ELASTIC_SSM_DEBUG=false used to turn debugging on)."""

import pytest

from elastic_ssm.cli import main as cli_main
from elastic_ssm.config import ConfigError
from elastic_ssm.train.dist import init_distributed
from elastic_ssm.utils.environment import env_flag, env_int


def test_env_int_and_flag_parse_or_name_the_variable(monkeypatch):
    monkeypatch.setenv("X_INT", " 3 ")
    assert env_int("X_INT", 1) == 3
    monkeypatch.setenv("X_INT", "")
    assert env_int("X_INT", 1) == 1
    monkeypatch.setenv("X_INT", "abc")
    with pytest.raises(ConfigError, match="X_INT='abc' is not an integer"):
        env_int("X_INT", 1)
    for off in ("", "0", "false", "No", "OFF"):
        monkeypatch.setenv("X_FLAG", off)
        assert env_flag("X_FLAG") is False
    for on in ("1", "true", "Yes", "on"):
        monkeypatch.setenv("X_FLAG", on)
        assert env_flag("X_FLAG") is True
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ConfigError, match="X_FLAG='maybe' is not a switch"):
        env_flag("X_FLAG")


@pytest.mark.parametrize("name,value,message", [
    ("WORLD_SIZE", "abc", "WORLD_SIZE='abc' is not an integer"),
    ("ELASTIC_SSM_DEBUG", "maybe", "ELASTIC_SSM_DEBUG='maybe' is not a switch"),
])
def test_cli_says_one_line_for_a_garbage_variable(tmp_path, monkeypatch, capsys, name, value, message):
    monkeypatch.setenv(name, value)
    assert cli_main(["eval", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (message in err[0] or "does not exist" in err[0]), err


def test_debug_false_means_off_and_world_size_garbage_stops_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ELASTIC_SSM_DEBUG", "false")          # off: a mistake is one line, not a traceback
    assert cli_main(["eval", str(tmp_path / "nothing")]) == 2
    assert "--debug shows the traceback" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ConfigError, match="WORLD_SIZE='abc'"):
        init_distributed(device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="RANK is not set"):
        init_distributed(device="cpu")


def test_progress_and_pdl_switches_read_every_spelling_and_refuse_garbage(monkeypatch):
    """ELASTIC_SSM_PROGRESS=1 did nothing (only 'always' was read) and ELASTIC_SSM_PDL=false left PDL on (only '0'
    was read): both take the switches env_flag takes, and garbage is a ConfigError naming the variable."""
    from elastic_ssm.ops.gemv import pdl_supported
    from elastic_ssm.utils.progress import _disable

    for value, disable in (("", None), ("auto", None), ("always", False), ("1", False), ("true", False),
                           ("0", True), ("off", True)):
        monkeypatch.setenv("ELASTIC_SSM_PROGRESS", value)
        assert _disable(True) is disable, value
    monkeypatch.setenv("ELASTIC_SSM_PROGRESS", "sometimes")
    with pytest.raises(ConfigError, match="ELASTIC_SSM_PROGRESS='sometimes' is not a switch"):
        _disable(True)
    monkeypatch.setenv("ELASTIC_SSM_PDL", "maybe")
    with pytest.raises(ConfigError, match="ELASTIC_SSM_PDL='maybe' is not a switch"):
        pdl_supported("cuda")
    monkeypatch.setenv("ELASTIC_SSM_PDL", "false")
    assert pdl_supported("cuda") is False       # off before any CUDA query: no GPU is needed to say so


def test_an_unknown_swa_kernel_is_named_and_auto_is_used(caplog):
    from elastic_ssm.layers.attention import swa_kernel

    assert (swa_kernel(None), swa_kernel(" Masked "), swa_kernel("")) == ("auto", "masked", "auto")
    with caplog.at_level("WARNING", logger="elastic_ssm"):
        assert swa_kernel("flash") == "auto"
    assert "ELASTIC_SSM_SWA_KERNEL='flash'" in caplog.text
