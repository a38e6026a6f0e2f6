"""A real ``elastic-ssm serve`` process on a free port, driven by the official ``openai`` client.

Two tiers served from one saved checkpoint; requests at both tiers run concurrently, streamed and not; greedy
text equals ``model.generate`` at the same tier; bad requests get 400 and the server answers afterwards; a
client that leaves in the middle of a stream frees its slot at once.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from served import serve_process  # noqa: E402

import elastic_ssm as es  # noqa: E402

PROMPTS = ["def main():", "The capital of", "ab"]
N = 24


@pytest.fixture(scope="module")
def server(tiny_dir):
    with serve_process(tiny_dir, "--tiers", "T1,T10", "--host", "127.0.0.1", "--max_batch", "4") as port:
        yield f"http://127.0.0.1:{port}", tiny_dir


def _expected(path, prompt: str, tier: str) -> str:
    model = es.ESSH.from_pretrained(path)
    ids = model.tokenizer.encode(prompt)
    out = model.generate(torch.tensor([ids]), N, tier=tier)[0, len(ids):]
    return model.tokenizer.decode(out.tolist())


def test_models_lists_every_served_tier(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny", "tiny@T1", "tiny@T10"]
    card = client.models.retrieve("tiny@T1")                      # GET /v1/models/{id}: it was a 404
    assert (card.id, card.tier, card.created) == ("tiny@T1", "T1", client.models.list().data[0].created)
    with pytest.raises(openai.NotFoundError, match="unknown model 'tiny@T4'"):
        client.models.retrieve("tiny@T4")


def test_concurrent_tiers_streamed_and_not_equal_generate(server):
    base, path = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

    def plain(prompt, tier):
        r = client.completions.create(model=f"tiny@{tier}", prompt=prompt, max_tokens=N, temperature=0)
        assert r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"
        return r.choices[0].text

    def streamed(prompt, tier):
        chunks = client.completions.create(model=f"tiny@{tier}", prompt=prompt, max_tokens=N, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    jobs = [(fn, p, t) for p in PROMPTS for t in ("T1", "T10") for fn in (plain, streamed)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: j[0](j[1], j[2]), jobs))
    want = {(p, t): _expected(path, p, t) for p in PROMPTS for t in ("T1", "T10")}
    for (_, p, t), text in zip(jobs, got):
        assert text == want[(p, t)], (p, t)
    assert want[(PROMPTS[0], "T1")] != want[(PROMPTS[0], "T10")]      # the tiers are different models


def test_bad_requests_then_still_answers(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.completions.create(model="tiny@T4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=1.5)
    assert httpx.post(f"{base}/v1/completions", content=b"\x00garbage").status_code == 400
    r = client.completions.create(model="tiny@T1", prompt="x", max_tokens=2, extra_body={"top_k": 5}, seed=3)
    assert r.usage.completion_tokens == 2


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    base, _ = server

    def busy() -> int:
        return httpx.get(f"{base}/health").json()["tiers"]["T10"]["busy"]

    body = {"model": "tiny@T10", "prompt": "go on", "max_tokens": 4000, "stream": True, "temperature": 0.7}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert busy() == 1
    deadline = time.time() + 10                      # 4000 tokens would take far longer than this
    while busy() and time.time() < deadline:
        time.sleep(0.1)
    assert busy() == 0
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    assert client.completions.create(model="tiny@T10", prompt="x", max_tokens=3).usage.completion_tokens == 3
