"""``checked_device`` and ``auto_device`` (issue 41 item 9): mps is refused in one line that says what would not run
(the spectral layers' float64), whether or not this machine has it; other kinds and absent devices keep their lines.
``auto`` on a machine with MPS and no CUDA (monkeypatched) picks cpu and says why not mps in one line."""

import pytest

from elastic_ssm.utils.environment import auto_device, checked_device


@pytest.mark.parametrize("spec", ["mps", "mps:0"])
def test_mps_is_refused_naming_what_would_not_run(spec):
    with pytest.raises(ValueError, match=r"MPS backend has no float64.*use cpu") as e:
        checked_device(spec, "--device")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--device '{spec}'")


def test_cpu_passes_and_other_kinds_are_named():
    assert checked_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="only cpu and cuda are supported"):
        checked_device("xpu")
    with pytest.raises(ValueError, match="is not a device"):
        checked_device("gpu0")


@pytest.fixture
def mac(monkeypatch):
    """A machine with MPS and no CUDA."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)


def test_auto_picks_cpu_over_mps_and_says_why(mac):
    device, note = auto_device()
    assert device == "cpu" and note.startswith("device auto: cpu, not mps") and "float64" in note
    assert "\n" not in note


def test_auto_without_mps_says_nothing(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert auto_device() == ("cpu", None)


def test_the_cli_says_it_once_on_stderr(mac, capsys):
    from elastic_ssm.cli_util import resolve_device

    assert resolve_device("auto") == "cpu"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not mps" in err
    assert resolve_device("cpu") == "cpu" and not capsys.readouterr().err    # an explicit device: no note


def test_a_training_run_picks_cpu_and_its_first_line_says_why(mac, monkeypatch):
    from elastic_ssm.train.dist import _pick_device
    from elastic_ssm.utils.environment import cpu_threads_for

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _pick_device("auto", 0).type == "cpu"
    line = cpu_threads_for("auto")
    assert line.startswith("cpu threads:") and "not mps" in line and "\n" not in line


def test_hf_device_map_auto_is_cpu(mac):
    pytest.importorskip("transformers")
    from elastic_ssm.hf.modeling import _device

    assert _device("auto") == "cpu"
