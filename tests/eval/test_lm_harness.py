"""lm-evaluation-harness adapter (``eval/lm_harness.py``): scores equal the model's own log-probabilities,
padding and batching change nothing, rolling windows cover every token, generation equals
``ESSH.generate``, and a local multiple-choice task runs end to end per tier (API and CLI), offline."""

import copy
import csv
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is installed by the dev extra; CI runs these")
from lm_eval.api.instance import Instance  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.cli import main  # noqa: E402
from elastic_ssm.eval.lm_harness import ElasticLM, evaluate_tiers_on_tasks  # noqa: E402
from elastic_ssm.models.essh import randomize_selective  # noqa: E402

BOS = 257


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    return randomize_selective(model, ffn_out_std=0.1)


def _req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _direct(model, tier, context: bytes, continuation: bytes, max_length=10_000):
    """sum log p(continuation | context) from one forward of the model (byte ids)."""
    ids = (list(context) if context else [BOS]) + list(continuation)
    ids = ids[-(max_length + 1):]
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(x, tier=tier).float(), -1)[0]
    n = len(continuation)
    tgt = torch.tensor(ids[-n:])
    return logp[-n:].gather(-1, tgt[:, None]).sum().item(), bool((logp[-n:].argmax(-1) == tgt).all())


PAIRS = [("The quick brown", " fox"), ("def main(", "):\n    return 0"), ("", "hello"), ("x", "y")]


@pytest.mark.parametrize("tier", ["T1", "T6", "T10"])
def test_loglikelihood_equals_the_models_log_probabilities(tiny, tier):
    lm = ElasticLM(tiny, tier=tier, batch_size=3)
    got = lm.loglikelihood([_req("loglikelihood", c, x) for c, x in PAIRS])
    for (ctx, cont), (score, greedy) in zip(PAIRS, got):
        want, want_greedy = _direct(tiny, tier, ctx.encode(), cont.encode())
        assert score == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    one = ElasticLM(tiny, tier=tier, batch_size=1).loglikelihood([_req("loglikelihood", c, x) for c, x in PAIRS])
    assert [s for s, _ in one] == pytest.approx([s for s, _ in got], abs=1e-4)   # padding changes nothing


def test_trailing_context_space_is_scored_with_the_continuation(tiny):
    lm = ElasticLM(tiny, tier="T4")
    (score, _), = lm.loglikelihood([_req("loglikelihood", "answer: ", "yes")])
    want, _ = _direct(tiny, "T4", b"answer:", b" yes")
    assert score == pytest.approx(want, abs=1e-4)


def test_long_inputs_keep_their_last_max_length_tokens(tiny):
    lm = ElasticLM(tiny, tier="T10", max_length=12)
    ctx, cont = "a long context that does not fit", " end"
    (score, _), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    assert score == pytest.approx(_direct(tiny, "T10", ctx.encode(), cont.encode(), max_length=12)[0], abs=1e-4)
    with pytest.raises(ValueError, match="longer than max_length"):
        lm.loglikelihood([_req("loglikelihood", "c", "x" * 13)])


def test_rolling_loglikelihood_scores_every_token_once(tiny):
    doc = "import os\nprint(os.getcwd())\n"
    n = len(doc.encode())
    full = ElasticLM(tiny, tier="T5", max_length=n).loglikelihood_rolling([_req("loglikelihood_rolling", doc)])[0]
    assert full == pytest.approx(_direct(tiny, "T5", b"", doc.encode())[0], abs=1e-4)   # one window
    windowed = ElasticLM(tiny, tier="T5", max_length=8).loglikelihood_rolling(
        [_req("loglikelihood_rolling", doc)])[0]
    # windows of 8 tokens, each scored once with less context: a different, finite, negative total
    assert windowed < 0 and windowed != pytest.approx(full, abs=1e-3)
    per_byte = ElasticLM(tiny, tier="T5", max_length=1).loglikelihood_rolling([_req("loglikelihood_rolling", doc)])[0]
    want = sum(_direct(tiny, "T5", doc.encode()[i - 1:i] if i else b"", doc.encode()[i:i + 1])[0]
               for i in range(n))                              # max_length 1: each byte given only the previous
    assert per_byte == pytest.approx(want, abs=1e-3)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(tiny):
    lm = ElasticLM(tiny, tier="T7", max_gen_toks=24)
    prompt = "for i in range("
    ids = torch.tensor([list(prompt.encode())])
    out = tiny.generate(ids, max_new_tokens=24, tier="T7", temperature=0, eos=258)[0, ids.shape[1]:].tolist()
    text = bytes(t for t in out if t < 256).decode("utf-8", errors="replace")
    got, = lm.generate_until([_req("generate_until", prompt, {"until": [], "max_gen_toks": 24})])
    assert got == text
    stop = text[5:7]
    got, = lm.generate_until([_req("generate_until", prompt, {"until": [stop], "max_gen_toks": 24})])
    assert got == text.split(stop)[0] and len(got) <= 5


def test_generate_until_samples_as_the_task_asks_and_names_what_it_cannot_do(tiny):
    """A task's ``do_sample: true`` without a temperature decoded greedily (temperature 0), and ``top_k`` /
    ``top_p`` / ``repetition_penalty`` were silently dropped; now sampling is at temperature 1 with the task's
    top-k / top-p cut (as ``ESSH.generate`` and transformers sample), ``max_new_tokens`` and ``num_beams: 1`` are
    taken as lm-eval's hf model takes them, and an option ours lacks (more beams, a penalty) is one line."""
    lm = ElasticLM(tiny, tier="T7", max_gen_toks=16)
    ids = torch.tensor([list(b"for i in range(")])
    for args in ({"do_sample": True}, {"do_sample": True, "temperature": 0.9, "top_k": 5, "top_p": 0.8}):
        torch.manual_seed(4)
        got, = lm.generate_until([_req("generate_until", "for i in range(", {"until": [], **args})])
        torch.manual_seed(4)
        want = tiny.generate(ids, max_new_tokens=16, tier="T7", eos=258, **args)[0, ids.shape[1]:].tolist()
        assert got == bytes(t for t in want if t < 256).decode("utf-8", errors="replace"), args
    want = tiny.generate(ids, max_new_tokens=6, tier="T7", eos=258)[0, ids.shape[1]:].tolist()
    got, = lm.generate_until([_req("generate_until", "for i in range(",     # greedy: no do_sample, one beam
                                   {"until": [], "num_beams": 1, "max_new_tokens": 6, "temperature": 0.5})])
    assert got == bytes(t for t in want if t < 256).decode("utf-8", errors="replace")
    for bad in ({"repetition_penalty": 1.2}, {"num_beams": 4}):
        with pytest.raises(TypeError, match=rf"unsupported argument\(s\) \['{next(iter(bad))}'\]"):
            lm.generate_until([_req("generate_until", "x", {"until": [], **bad})])


def test_batched_generation_equals_one_request_at_a_time(tiny):
    model = copy.deepcopy(tiny).double()         # float64: no near-tie argmax can flip between batch shapes
    reqs = [_req("generate_until", p, {"until": ["\n\n"], "max_gen_toks": 12})
            for p in ("a", "while True:", "x = [1, 2, 3]\nprint(")]
    reqs.append(_req("generate_until", "import", {"until": [], "max_gen_toks": 5}))
    batched = ElasticLM(model, tier="T3", batch_size=3).generate_until(reqs)
    single = ElasticLM(model, tier="T3", batch_size=1).generate_until(reqs)
    assert batched == single and len(batched) == 4


def test_bad_arguments_are_named(tiny):
    with pytest.raises(ValueError, match="T11"):
        ElasticLM(tiny, tier="T11")
    with pytest.raises(ValueError, match="batch_size"):
        ElasticLM(tiny, batch_size="many")
    with pytest.raises(ValueError, match="precision"):
        ElasticLM(tiny, precision="fp8")
    clf = es.ESSSM(es.ESSSMConfig.preset("tiny", task="classify", num_classes=3))
    with pytest.raises(ValueError, match="classifier"):
        ElasticLM(clf)
    from elastic_ssm.models import build_model

    baseline = ElasticLM(build_model(es.config.MatFormerConfig.preset("tiny"), seed=0))
    with pytest.raises(NotImplementedError, match=r"MatFormer does not have \(ESSH and ES-SSM do\)"):
        baseline.generate_until([_req("generate_until", "a", {"until": []})])


def _local_task(tmp_path):
    """A 6-question multiple-choice task in lm-eval's YAML format over a local JSONL file."""
    docs = [{"question": f"{a} + {b} =", "choices": [str(a + b), str(a + b + 1), "cat"], "label": 0}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4)]]
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "tiny_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    return docs


def test_local_task_per_tier_through_the_api_and_the_cli(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    docs = _local_task(tmp_path / "tasks")
    tiny.save_pretrained(tmp_path / "model")
    rows = evaluate_tiers_on_tasks(tmp_path / "model", ["tiny_choice"], tiers=["T1", "T10"],
                                   include_path=str(tmp_path / "tasks"), bootstrap_iters=0)
    acc = {r["tier"]: r["value"] for r in rows if r["metric"] == "acc"}
    assert set(acc) == {"T1", "T10"}
    for tier, value in acc.items():   # the harness's accuracy = argmax of our own log-likelihoods
        right = 0
        for d in docs:
            scores = [_direct(tiny, tier, d["question"].encode(), (" " + c).encode())[0] for c in d["choices"]]
            right += int(max(range(3), key=scores.__getitem__) == d["label"])
        assert value == pytest.approx(right / len(docs))
    out = tmp_path / "lm_eval.csv"
    assert main(["lm-eval", str(tmp_path / "model"), "--tasks", "tiny_choice", "--tiers", "T10",
                 "--include_path", str(tmp_path / "tasks"), "--csv", str(out)]) == 0
    with open(out) as f:
        got = {r["metric"]: float(r["value"]) for r in csv.DictReader(f)}
    assert got["acc"] == pytest.approx(acc["T10"])
    assert main(["lm-eval", str(tmp_path / "model"), "--tasks", ""]) == 2
    # by registry name with string model_args, as lm-eval's own entry points build models
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model="elastic-ssm", model_args=f"pretrained={tmp_path / 'model'},tier=T10",
                                  tasks=["tiny_choice"], batch_size=2, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    assert res["results"]["tiny_choice"]["acc,none"] == pytest.approx(acc["T10"])


def test_console_script_runs_lm_evals_own_cli_per_tier(tiny, tmp_path, monkeypatch):
    """``elastic-ssm-lm-eval``: lm-eval's own flags (--include_path, --batch_size auto, --output_path,
    --log_samples), one lm-eval results JSON per tier and our CSV summary, offline."""
    from pathlib import Path

    from elastic_ssm import cli_lm_eval as harness

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '\nelastic-ssm-lm-eval = "elastic_ssm.cli_lm_eval:main"\n' in pyproject      # the console script
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    docs = _local_task(tmp_path / "tasks")
    tiny.save_pretrained(tmp_path / "model")
    out = tmp_path / "results"
    assert harness.main(["--model_args", f"pretrained={tmp_path / 'model'},tier=T1+T10", "--tasks", "tiny_choice",
                         "--include_path", str(tmp_path / "tasks"), "--batch_size", "auto",
                         "--output_path", str(out), "--log_samples"]) == 0
    with open(out / "tiers.csv") as f:
        summary = {r["tier"]: float(r["value"]) for r in csv.DictReader(f) if r["metric"] == "acc"}
    assert set(summary) == {"T1", "T10"}
    for tier in ("T1", "T10"):
        (result_file,) = (out / tier).glob("*/results_*.json")
        res = json.loads(result_file.read_text())
        assert res["config"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
        assert res["results"]["tiny_choice"]["acc,none"] == pytest.approx(summary[tier])
        (samples,) = (out / tier).glob("*/samples_tiny_choice_*.jsonl")
        assert len(samples.read_text().splitlines()) == len(docs)
        right = 0
        for d in docs:
            scores = [_direct(tiny, tier, d["question"].encode(), (" " + c).encode())[0] for c in d["choices"]]
            right += int(max(range(3), key=scores.__getitem__) == d["label"])
        assert summary[tier] == pytest.approx(right / len(docs))


def test_console_script_reads_lm_evals_short_flags():
    from elastic_ssm.cli_lm_eval import _own_flags

    argv = ["-M", "elastic-ssm", "-a", "pretrained=m,tier=all", "-o=res", "--csv", "s.csv", "--tasks", "t",
            "--overwrite", "--limit", "-1"]
    own, rest = _own_flags(argv)
    assert (own.model, own.model_args, own.output_path, own.csv, own.device, own.overwrite) == \
        ("elastic-ssm", "pretrained=m,tier=all", "res", "s.csv", None, True)
    assert rest == ["--tasks", "t", "--limit", "-1"]                   # lm-eval's own flags, as they were


def test_console_script_refuses_an_existing_csv_before_running(tiny, tmp_path, monkeypatch, capsys):
    """``elastic-ssm-lm-eval``: an existing ``--csv`` or ``<output_path>/tiers.csv`` is refused before lm-eval runs;
    ``--overwrite`` (ours) replaces a CSV, never a model's file."""
    from elastic_ssm import cli_lm_eval as harness
    from elastic_ssm.eval import lm_harness

    ran = []
    monkeypatch.setattr(harness, "_run_lm_eval", lambda argv, indexes: ran.append(argv) or {})
    monkeypatch.setattr(lm_harness, "result_rows", lambda res, tier: [{"tier": tier.name, "value": 0.5}])
    monkeypatch.delenv("ELASTIC_SSM_DEBUG", raising=False)
    tiny.save_pretrained(tmp_path / "model")
    base = ["--model_args", f"pretrained={tmp_path / 'model'},tier=T1", "--tasks", "t", "--device", "cpu"]
    mine, out = tmp_path / "mine.csv", tmp_path / "res"
    mine.write_text("mine")
    out.mkdir()
    (out / "tiers.csv").write_text("earlier run")
    config = (tmp_path / "model" / "config.json").read_bytes()
    for flags, named in [(["--csv", str(mine)], f"--csv {mine} already exists"),
                         (["--output_path", str(out)], f"{out / 'tiers.csv'} already exists"),
                         (["--csv", str(tmp_path / "model" / "config.json"), "--overwrite"], "not a .csv file")]:
        capsys.readouterr()
        assert harness.main([*base, *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err
    assert ran == []                                       # refused before lm-eval ran a task
    assert mine.read_text() == "mine" and (out / "tiers.csv").read_text() == "earlier run"
    assert (tmp_path / "model" / "config.json").read_bytes() == config
    assert harness.main([*base, "--csv", str(mine), "--overwrite"]) == 0
    assert "--overwrite" not in ran[0]                     # ours: not passed on to lm-eval
    assert mine.read_text().splitlines() == ["tier,value", "T1,0.5"]


def test_console_script_reports_bad_input_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    """``elastic-ssm-lm-eval`` reports a user's mistake as ``elastic-ssm lm-eval`` does: one line, exit 2."""
    from elastic_ssm import cli_lm_eval as harness

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("ELASTIC_SSM_DEBUG", raising=False)
    _local_task(tmp_path / "tasks")
    tiny.save_pretrained(tmp_path / "model")
    model, tasks = str(tmp_path / "model"), str(tmp_path / "tasks")
    cases = [(f"pretrained={model},tier=T11", "tiny_choice", "tier=T11"),
             (f"pretrained={model}", "no_such_task", "no_such_task"),
             (f"pretrained={tmp_path / 'missing'}", "tiny_choice", "missing does not exist"),
             ("pretrained", "tiny_choice", "is not key=value"),
             ("tier=all", "tiny_choice", "needs pretrained=DIR"),
             (f"pretrained={model},bogus=1", "tiny_choice", "unknown key(s) bogus; the elastic-ssm model takes "
                                                            "pretrained, tier,"),
             (f"pretrained={model},batch_size=2", "tiny_choice", "from its own --batch_size flag"),
             (f"pretrained={model},tier=4", "tiny_choice", "tier=4: unknown tier 4 for ESSHConfig")]
    for model_args, task, named in cases:
        capsys.readouterr()
        code = harness.main(["--model_args", model_args, "--tasks", task, "--include_path", tasks, "--device", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, model_args
        assert len(err) == 1 and err[0].startswith("elastic-ssm lm-eval: error: ") and named in err[0], err
        assert "Traceback" not in err[0]
    with pytest.raises(ValueError, match="T11"):       # --debug: the exception itself, with its traceback
        harness.main(["--model_args", f"pretrained={model},tier=T11", "--tasks", "tiny_choice", "--debug"])


def test_es_ssm_budgets_and_generation_through_every_lm_eval_entry(tmp_path, monkeypatch, capsys):
    """An ES-SSM budget ``4`` is its tier K4 in ``lm-eval --tiers``, in ``tier=`` of ``elastic-ssm-lm-eval`` and of
    lm-eval's own registry path; ``generate_until`` runs ES-SSM's cached generation (the model's own greedy tokens)."""
    from elastic_ssm import cli_lm_eval as harness

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _local_task(tmp_path / "tasks")
    torch.manual_seed(0)
    model = es.ESSSM(es.ESSSMConfig.preset("tiny")).eval()
    model.save_pretrained(tmp_path / "model")
    path, tasks = str(tmp_path / "model"), str(tmp_path / "tasks")
    out = tmp_path / "rows.csv"
    assert main(["lm-eval", path, "--tasks", "tiny_choice", "--tiers", "4,K8", "--include_path", tasks,
                 "--limit", "2", "--csv", str(out)]) == 0
    with open(out) as f:
        assert sorted({r["tier"] for r in csv.DictReader(f)}) == ["K4", "K8"]
    assert harness.main(["--model_args", f"pretrained={path},tier=4", "--tasks", "tiny_choice", "--include_path",
                         tasks, "--limit", "2", "--csv", str(out), "--overwrite"]) == 0
    with open(out) as f:
        assert {r["tier"] for r in csv.DictReader(f)} == {"K4"}
    assert ElasticLM.create_from_arg_string(f"pretrained={path},tier=4").tier == 4        # lm-eval makes it an int
    assert ElasticLM(model, tier="4").tier == 4                                           # quoted: a word
    with pytest.raises(ValueError, match="unknown key.s. colour"):
        ElasticLM.create_from_arg_obj({"pretrained": path, "colour": "red"}, {"batch_size": 2})
    prompt = "for i in "
    ids = torch.tensor([list(prompt.encode())])
    want = model.generate(ids, max_new_tokens=6, tier=4, temperature=0, eos=258)[0, ids.shape[1]:].tolist()
    got, = ElasticLM(model, tier=4).generate_until([_req("generate_until", prompt, {"until": [], "max_gen_toks": 6})])
    assert got == bytes(t for t in want if t < 256).decode("utf-8", errors="replace")


def test_result_rows_keep_scores_and_drop_bookkeeping():
    from elastic_ssm.elastic.tiers import Tier
    from elastic_ssm.eval.lm_harness import result_rows

    tier = Tier(name="T4", index=4, xi=0.3125, K=18, n_ff=768, params=1000)
    res = {"results": {"piqa": {"alias": "piqa", "sample_len": 1838, "acc,none": 0.6, "acc_stderr,none": 0.01,
                                "acc_norm,none": 0.61, "acc_norm_stderr,none": "N/A"}}}
    rows = result_rows(res, tier)
    assert [(r["metric"], r["value"], r["stderr"]) for r in rows] == [("acc", 0.6, 0.01), ("acc_norm", 0.61, None)]


def test_lm_eval_bars_go_to_stderr_and_quiet_removes_them(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("ELASTIC_SSM_PROGRESS", "always")       # stands in for a terminal
    _local_task(tmp_path / "tasks")
    tiny.save_pretrained(tmp_path / "model")
    argv = ["lm-eval", str(tmp_path / "model"), "--tasks", "tiny_choice", "--tiers", "T1,T10", "--include_path",
            str(tmp_path / "tasks")]
    assert main(argv) == 0
    loud = capsys.readouterr()
    assert main([*argv, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert "lm-eval tiers" in loud.err and "scoring" in loud.err
    assert "lm-eval tiers" not in quiet.err and "scoring" not in quiet.err
    assert loud.out and loud.out == quiet.out
