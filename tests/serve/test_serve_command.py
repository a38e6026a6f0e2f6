"""The ``serve`` command: its flags, key and non-local warning, ``--tier full``, port 0, names it refuses at start
(a directory with an at sign, other architectures), batches no machine holds, and an export written before
tier names served under both names."""

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402

KEY = {"Authorization": "Bearer s3cret"}


def test_serve_command_wires_flags_key_and_the_non_local_warning(model_dir, monkeypatch, caplog):
    import uvicorn

    from elastic_ssm.cli import main
    from elastic_ssm.serve import app as app_module

    runs, settings = [], []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    create_app = app_module.create_app
    monkeypatch.setattr(app_module, "create_app",
                        lambda model, s, **kw: settings.append(s) or create_app(model, s, **kw))
    monkeypatch.delenv("ELASTIC_SSM_API_KEY", raising=False)
    with caplog.at_level("WARNING", logger="elastic_ssm.serve"):
        assert main(["serve", str(model_dir), "--tiers", "T1,T4", "--host", "0.0.0.0", "--port", "1234",
                     "--device", "cpu", "--max-batch", "2"]) == 0
    assert "without an API key" in caplog.text
    app, kw = runs[-1]
    assert (kw["host"], kw["port"]) == ("0.0.0.0", 1234)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    assert issubclass(kw["http"], AutoHTTPProtocol) and kw["http"].__name__.startswith("HeaderDeadline")
    assert kw["http"].deadline_s == 30.0                                      # --timeout's default
    assert (kw["http"].max_header_bytes, kw["http"].write_timeout_s) == (65536, 30.0)
    assert kw["proxy_headers"] is False and settings[-1].allowed_hosts == ("0.0.0.0",)   # no proxy trusted
    kw["http"].count_refusal("http_408")                                      # a connection closed by it
    assert (settings[-1].slots, settings[-1].max_prefill) == (2, 2)           # --max-prefill 0: --max-batch
    with TestClient(app, base_url="http://localhost") as c:       # no key: the Host must be a local name
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny@T1", "tiny@T4"]
        assert 'elastic_ssm_rejected_total{reason="http_408"} 1' in c.get("/metrics").text
    caplog.clear()
    monkeypatch.setenv("ELASTIC_SSM_API_KEY", "s3cret")
    t3 = es.tier_table(es.ESSHConfig.preset("tiny"))[2].params
    with caplog.at_level("WARNING", logger="elastic_ssm.serve"):
        assert main(["serve", str(model_dir), "--tiers", "T1", "--tier", "auto", "--max-params", str(t3),
                     "--device", "cpu", "--max_batch", "1", "--max_prefill", "4", "--max_header_bytes", "4096",
                     "--forwarded_allow_ips", "10.0.0.1", "--allowed_hosts", "a.lan,b.lan"]) == 0
    assert settings[-1].max_prefill == 1                                       # at most --max-batch
    assert (runs[-1][1]["proxy_headers"], runs[-1][1]["forwarded_allow_ips"]) == (True, "10.0.0.1")
    assert runs[-1][1]["http"].max_header_bytes == 4096
    assert settings[-1].allowed_hosts == ("127.0.0.1", "a.lan", "b.lan")
    assert "without an API key" not in caplog.text and runs[-1][1]["host"] == "127.0.0.1"
    with TestClient(runs[-1][0]) as c:
        assert c.get("/v1/models").status_code == 401
        models = c.get("/v1/models", headers=KEY).json()["data"]
        assert [(m["id"], m["tier"]) for m in models] == [("tiny", "T3"), ("tiny@T1", "T1"), ("tiny@T3", "T3")]
    served = len(runs)
    assert main(["serve", str(model_dir), "--tiers", "T1, T4", "--tier", "T10", "--device", "cpu"]) == 2
    assert len(runs) == served                              # an explicit default outside --tiers: refused, not added
    for flag, bad in (("--timeout", "0"), ("--max_header_bytes", "1000")):     # the connection limits' bounds
        assert main(["serve", str(model_dir), flag, bad, "--device", "cpu"]) == 2 and len(runs) == served


def test_serve_tier_full_is_the_whole_model_as_in_tiers_full(model_dir, monkeypatch):
    """``--tier full`` names the whole model, as ``--tiers full`` and generate's ``--tier full`` do; it was refused
    with "unknown tier 'full' ... or the full model (None in Python, 'full' on the command line)"."""
    import uvicorn

    from elastic_ssm.cli import main
    from elastic_ssm.serve import app as app_module

    settings = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    create_app = app_module.create_app
    monkeypatch.setattr(app_module, "create_app",
                        lambda model, s, **kw: settings.append(s) or create_app(model, s, **kw))
    assert main(["serve", str(model_dir), "--tiers", "T1,T10", "--tier", "full", "--port", "0", "--device", "cpu",
                 "--max-batch", "1"]) == 0
    assert (settings[-1].tiers, settings[-1].default_tier) == (["T1", "T10"], "T10")


def test_serve_port_0_names_the_port_it_listens_on(model_dir, monkeypatch, caplog):
    """``--port 0`` (any free port): the start line names the port uvicorn gets, not 0."""
    import uvicorn

    from elastic_ssm.cli import main

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    with caplog.at_level("INFO", logger="elastic_ssm.serve"):
        assert main(["serve", str(model_dir), "--port", "0", "--device", "cpu", "--max-batch", "1"]) == 0
    port = runs[-1]["port"]
    assert port > 0 and f"on http://127.0.0.1:{port} " in caplog.text


def test_a_directory_named_with_an_at_sign_is_refused_at_start_naming_the_name_flag(model_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    """The name defaults to the directory's: 'run@1000' was served, and every id /v1/models listed ('run@1000',
    'run@1000@T1') was a 404, as ids are read as NAME@TIER at the first '@'."""
    import shutil

    import uvicorn

    from elastic_ssm.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)

    shutil.copytree(model_dir, tmp_path / "run@1000")
    assert main(["serve", str(tmp_path / "run@1000"), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'run@1000'" in err and "'@'" in err and "--name" in err and len(err.splitlines()) == 1


def test_serve_refuses_other_architectures_with_what_they_offer(tmp_path, capsys):
    from elastic_ssm.cli import main
    from elastic_ssm.config import TransformerConfig
    from elastic_ssm.models import build_model

    build_model(TransformerConfig.preset("tiny")).save_pretrained(tmp_path / "tf")
    assert main(["serve", str(tmp_path / "tf"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "arch 'transformer'; `elastic-ssm serve` runs ESSH models only" in err and "elastic-ssm eval" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [["calibrate", "--batches", "1,100000000000"], ["serve", "--max-batch", "10**11"]])
def test_a_batch_no_machine_holds_is_named_by_its_flag_before_any_allocation(model_dir, capsys, argv):
    """The decode state of 10^11 sequences (Table 53's bytes) exceeds any device's memory: one line naming the
    flag, exit 2 (it was the allocator's error, or 'cannot fit int into an index-sized integer')."""
    from elastic_ssm.cli import main

    verb, flag, value = argv
    value = str(10**11) if value == "10**11" else value
    port = ["--port", "0"] if verb == "serve" else []           # any free port: the check comes after the bind's
    assert main([verb, str(model_dir), flag, value, "--device", "cpu", *port]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} {value}: the decode state of" in err and "GiB" in err, err


def test_a_batch_that_fits_alone_but_not_beside_the_weights_is_named(monkeypatch):
    """The check counts the weights too: a decode state of 60% of the device's memory beside weights of 60%
    is refused, naming both; the same state beside small weights passes."""
    from elastic_ssm.config.base import ConfigError
    from elastic_ssm.elastic.tiers import state_bytes
    from elastic_ssm.serve import cli as serve_cli

    config = es.ESSHConfig.preset("tiny")
    state = state_bytes(config, "T4", 1000)["total"]
    have = int(state / 0.6)
    monkeypatch.setattr(serve_cli, "_device_memory", lambda device: have)
    serve_cli.check_state_fits(config, "T4", 1000, "cpu", "--max-batch 1000", weights=int(0.3 * have))
    with pytest.raises(ConfigError) as e:
        serve_cli.check_state_fits(config, "T4", 1000, "cpu", "--max-batch 1000", weights=int(0.6 * have))
    msg = str(e.value)
    assert msg.startswith("--max-batch 1000: the decode state of 1000 sequences at T4") and "beside the weights'" in msg
    with torch.device("meta"):
        model = es.ESSH(config)
    n = sum(p.numel() for p in model.parameters())
    assert serve_cli.weight_bytes(model, torch.bfloat16) == 2 * n and serve_cli.weight_bytes(model) == 4 * n


def test_an_export_written_before_tier_names_is_served_under_both_names():
    """``tests/fixtures/legacy_export/T4`` (an export of T4 written before ``tier_names``; its one tier is T1):
    eval, generate and ``serve --tiers`` took T4 as its name, a request's ``model: "T4@T4"`` was refused."""
    from pathlib import Path

    from elastic_ssm.models.model_dir import export_tier_aliases

    path = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_export" / "T4"
    model = es.ESSH.from_pretrained(path)
    assert export_tier_aliases(model) == {"T4": "T1"}
    assert export_tier_aliases(es.ESSH(es.ESSHConfig.preset("tiny"))) == {}
    settings = ServerSettings(name="T4", tiers=["T1"], default_tier="T1", slots=1, allowed_hosts=("testserver",))
    with TestClient(create_app(model, settings)) as c:
        for fields in ({"model": "T4@T4"}, {"model": "T4@t4"}, {"model": "T4@T1"}, {"tier": "T4"}, {"model": "T4"}):
            r = c.post("/v1/completions", json={"prompt": "de", "max_tokens": 2, **fields})
            assert r.status_code == 200 and r.json()["model"] == "T4@T1", (fields, r.text)
        r = c.post("/v1/completions", json={"prompt": "de", "max_tokens": 2, "model": "T4@T6"})
        assert r.status_code == 400 and "not served here" in r.json()["error"]["message"]
