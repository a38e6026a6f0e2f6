"""Outputs that would land on what a command reads or on a path that is not what it seems: ``export --overwrite``
never replaces the model it exports, an output path that is a broken symbolic link is one line before any work,
a source that is a pipe or device is named as such, and every figure or report is written whole or not at all."""

import errno
import os

import pytest
from test_cli_outputs import one_error_line  # tests/ is on sys.path (its conftest.py)

import elastic_ssm as es
from elastic_ssm.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("own") / "T3"          # a full model in a folder named like a tier
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(path)
    return path


@pytest.mark.parametrize("where", ["its own folder", "a folder holding it"])
def test_export_overwrite_never_replaces_the_model_it_exports(model_dir, tmp_path, capsys, where):
    """``export T3 --out . --tiers T3 --overwrite`` replaced the full model by its T3 export (the model is lost)."""
    source, out = model_dir, model_dir.parent          # out/T3 is the model itself
    if where == "a folder holding it":                 # out/T1/full is the model: replacing out/T1 deletes it
        import shutil

        out = tmp_path
        source = out / "T1" / "full"
        shutil.copytree(model_dir, source)
    weights = (source / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["export", str(source), "--out", str(out), "--tiers", "T3,T1", "--check_len", "8",
                 "--overwrite"]) == 2
    line = one_error_line(capsys)
    assert "the model being exported" in line and "--out" in line, line
    assert (source / "model.safetensors").read_bytes() == weights
    assert es.ESSH.from_pretrained(source).config.d_model == 64


@pytest.mark.parametrize("target", ["missing", "itself"])
def test_an_output_that_is_a_broken_symlink_is_one_line_before_any_work(model_dir, tmp_path, capsys, target):
    """A link to nothing (or to itself) was 'File exists' / 'Symlink loop' after the model was built."""
    link = tmp_path / "out"
    os.symlink(tmp_path / "missing" if target == "missing" else link, link)
    for argv in (["export", str(model_dir), "--out", str(link), "--tiers", "T1"],
                 ["train", "--model.preset", "tiny", "--train.out_dir", str(link)],
                 ["train", "--model.preset", "tiny", "--train.out_dir", str(link / "run")],
                 ["tokenizer", "train", str(model_dir / "configuration_essh.py"), "--vocab_size", "300", "--out",
                  str(link)]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        line = [x for x in captured.err.splitlines() if x.startswith("elastic-ssm ")]
        assert len(line) == 1 and f"{link} is a symbolic link" in line[0] and "remove the link" in line[0], captured
        assert "parameters" not in captured.out + captured.err      # refused before the model was built
    assert os.path.islink(link)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_source_that_is_a_pipe_or_device_is_named_as_such(tmp_path, capsys, kind):
    """A FIFO or /dev/zero as the source was 'data source not found'."""
    source = "/dev/zero"
    if kind == "fifo":
        source = str(tmp_path / "fifo")
        os.mkfifo(source)
    for argv in (["prepare", source, str(tmp_path / "t.bin")],
                 ["tokenizer", "train", source, "--vocab_size", "300", "--out", str(tmp_path / "t.json")]):
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert source in line and "not a regular file" in line and "not found" not in line, line


@pytest.fixture
def full_disk_png(monkeypatch):
    """Matplotlib's PNG writer writes half a file, then the disk is full."""
    import matplotlib.image

    def imsave(fname, *a, **kw):
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(b"\x89PNG half")
        else:
            fname.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.image, "imsave", imsave)


@pytest.mark.parametrize("figure", ["importance", "quickstart"])
def test_a_figure_cut_short_keeps_the_old_one(tmp_path, full_disk_png, figure):
    """``importance --overwrite`` and the quickstart: a full disk while the PNG was written left a torn file in place
    of the old figure."""
    from elastic_ssm.eval.importance import ChannelImportance, ImportanceResult, plot_importance
    from elastic_ssm.eval.perplexity import TierEval
    from elastic_ssm.quickstart import _plot

    png = tmp_path / "figure.png"
    png.write_bytes(b"the old figure")
    res = ImportanceResult("T10", 3, 1, 1.0, 2.7, 1.0, 10, 2, 1.0, 1.0, 0.5, 0.5,
                           [ChannelImportance(k, 1.0, 0.1, 1.0 / k, 0.1, 1.0 / k) for k in (1, 2, 3)])
    rows = [TierEval(f"T{k}", k, 16, 1000 * k, 2.0 - k / 10, 64, 1.0) for k in (1, 2)]
    with pytest.raises(OSError):
        plot_importance(res, png) if figure == "importance" else _plot(rows, None, png)
    assert png.read_bytes() == b"the old figure"
    assert os.listdir(tmp_path) == ["figure.png"]


def test_export_checks_a_short_es_ssm_at_its_filter_length_by_default(tmp_path, capsys):
    """An ES-SSM built for 64 tokens failed ``export`` without ``--check_len`` (the default 128 exceeded its filters,
    and the error said to rebuild the model); the default check now runs at the model's filter length."""
    from elastic_ssm.config import model_config_from_dict
    from elastic_ssm.models import build_model

    model = build_model(model_config_from_dict({"arch": "es_ssm", "preset": "tiny", "seq_len": 64}), seed=0)
    model.save_pretrained(tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), "--out", str(tmp_path / "ex"), "--tiers", "2", "--quiet"]) == 0
    assert "K2: OK" in capsys.readouterr().out and (tmp_path / "ex" / "K2" / "config.json").is_file()
