"""``checked_device`` (issue 41 item 9): mps is refused in one line that says what would not run (the spectral
layers' float64), whether or not this machine has it; other kinds and absent devices keep their lines."""

import pytest

from elastic_ssm.utils.devices import checked_device


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
