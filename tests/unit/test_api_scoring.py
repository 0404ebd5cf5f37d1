"""Scoring prompts through the real HTTP front door, as evaluation harnesses do: completions
``echo`` with ``logprobs`` (OpenAI's legacy shape), ``max_tokens: 0``, vLLM's
``prompt_logprobs`` on completions and chat, and the tokenizer endpoints. Every logprob is
checked against the full-sequence reference forward of the served model (no cache, one
sequence), on an engine whose prefill runs in 32-token chunks, so a prompt's logprobs come in
several deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from app.api import FrontDoor, build_api
from app.config import EngineConfig
from app.deployments.engine_host import LocalEngineClient
from app.engine.engine import AsyncEngine
from app.engine.request import RequestOutput, TokenLogprob
from tests.support.reference import sequence_logits
from tests.unit.test_api import MODEL, NO_THINK, Server

CHUNK = 32  # the engine's prefill chunk (max_num_batched_tokens)
TOL = 2e-4  # logprob agreement with the reference (batched vs single-sequence fp32)
TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps. " * 4


@pytest.fixture(scope="module")
def engine(tiny_ckpt) -> Iterator[AsyncEngine]:
    cfg = EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 24,
                                    max_num_batched_tokens=CHUNK)  # fmt: skip
    eng = AsyncEngine(cfg)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(tiny_ckpt, engine) -> Iterator[Server]:
    door = FrontDoor(served_model_names=(MODEL,),
                     tokenizer_path=f"{tiny_ckpt('v41')}/tokenizer.json",
                     context_limit=engine.core.max_model_len)  # fmt: skip
    client = LocalEngineClient(engine)
    with Server(build_api(door, client)) as srv:
        srv.client = client
        yield srv


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server):
    return server.server.config.app.state.api.completions.tokenizer


def reference(engine: AsyncEngine, ids: list[int]) -> torch.Tensor:
    """[L, V]: log-softmax of the reference forward's next-token logits at each position."""
    logits = sequence_logits(engine.core.model, torch.tensor(ids))
    return torch.log_softmax(logits.float(), dim=-1)


def prompt_ids(tok, text: str = TEXT) -> list[int]:
    """``text`` as /v1/completions tokenizes it: BOS first."""
    return [tok.token_to_id("<｜begin▁of▁sentence｜>"), *tok.encode(text).ids]


def test_echo_logprobs_with_max_tokens_0_match_the_reference(http, engine, tok):
    """lm-eval's loglikelihood call (a batch of one token-id prompt, echo, logprobs, max_tokens
    0): the prompt's text and every prompt token's logprob (the first null) and top
    alternatives, as the reference computes them; nothing generated."""
    ids = prompt_ids(tok)
    assert len(ids) > 3 * CHUNK  # several prefill chunks
    body = {"model": MODEL, "prompt": [ids], "echo": True, "logprobs": 3, "max_tokens": 0,
            "temperature": 0}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert out["usage"] == {**out["usage"], "prompt_tokens": len(ids), "completion_tokens": 0}
    lp = choice["logprobs"]
    ref = reference(engine, ids)
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp["token_logprobs"][1:])
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    for p in range(1, len(ids)):
        top = lp["top_logprobs"][p]
        t = torch.topk(ref[p - 1], 3)
        expect = {lp["tokens"][p]: float(want[p - 1])}  # the token, then the top 3 (texts
        for i, v in zip(t.indices.tolist(), t.values.tolist(), strict=True):  # can repeat)
            expect.setdefault(tok.decode([i], skip_special_tokens=False), v)
        assert top.keys() == expect.keys(), p
        assert all(abs(top[k] - v) < TOL for k, v in expect.items()), p
    # text_offset: where each token's text starts in the returned text (BOS takes no room)
    assert lp["text_offset"][:2] == [0, 0]
    for p in range(1, len(ids) - 1):
        assert TEXT[lp["text_offset"][p] :].startswith(lp["tokens"][p])


def test_echo_with_generation_streamed_and_not(http, tok):
    """Echo before generated tokens (a text prompt as sent): the same text and logprobs
    streamed (the echo first) and not; generated tokens' offsets continue the prompt's."""
    prompt = "Once upon a time"
    n = len(prompt_ids(tok, prompt))
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    whole = http.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n + 4 and whole["usage"]["completion_tokens"] == 4
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert lp["text_offset"][n] == len(prompt)
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])  # the token + top 2
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    parts = [json.loads(c)["choices"][0] for c in chunks[:-1]]
    assert parts[0]["text"] == prompt and len(parts[0]["logprobs"]["tokens"]) == n
    assert "".join(p["text"] for p in parts) == choice["text"]
    streamed = {k: [v for p in parts if p["logprobs"] for v in p["logprobs"][k]] for k in lp}
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=TOL)


def test_echo_without_logprobs_and_max_tokens_0_without_echo(http, tok):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["hi there"], "echo": True,
                                           "max_tokens": 0}).json()  # fmt: skip
    assert r["choices"][0]["text"] == "hi there" and r["choices"][0]["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 0
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_openai_sdk_reads_echoed_logprobs(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="hello world", echo=True, logprobs=1,
                                  max_tokens=0)  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "hello world" and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.prompt_tokens


def _check_vllm_prompt_logprobs(plp, ids: list[int], ref: torch.Tensor, k: int, tok) -> None:
    """vLLM's shape: None, then per token {id: {logprob, rank, decoded_token}}, the token first
    (its vocabulary rank), then the top k (ranks 1..k)."""
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], plp[p]
        tid = ids[p]
        first = next(iter(entry))
        assert first == str(tid)
        assert abs(entry[first]["logprob"] - float(row[tid])) < TOL
        assert entry[first]["rank"] == int((row > row[tid]).sum()) + 1
        assert entry[first]["decoded_token"] == tok.decode([tid], skip_special_tokens=False)
        top = torch.topk(row, k)
        want = dict(zip(map(str, top.indices.tolist()), top.values.tolist(), strict=True))
        assert set(entry) == want.keys() | {str(tid)}
        for r, (i, v) in enumerate(want.items(), start=1):
            assert abs(entry[i]["logprob"] - v) < TOL
            if i != str(tid):
                assert entry[i]["rank"] == r


def test_completions_prompt_logprobs_match_the_reference(http, engine, tok):
    ids = prompt_ids(tok)[:50]
    body = {"model": MODEL, "prompt": ids, "prompt_logprobs": 2, "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None  # only asked for the prompt's
    _check_vllm_prompt_logprobs(choice["prompt_logprobs"], ids, reference(engine, ids), 2, tok)


def test_chat_prompt_logprobs_match_the_reference(server, http, engine, tok):
    """Chat's prompt_logprobs (top level, as vLLM's) cover the rendered conversation."""
    spy: list = []
    real = server.client.generate

    def generate(req):
        spy.append(req)
        return real(req)

    server.client.generate = generate
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}],
                "max_tokens": 3, "prompt_logprobs": 1, **NO_THINK}  # fmt: skip
        r = http.post("/v1/chat/completions", json=body)
    finally:
        del server.client.generate
    assert r.status_code == 200, r.text
    out = r.json()
    ids = list(spy[0].prompt_token_ids)
    assert out["usage"]["prompt_tokens"] == len(ids)
    _check_vllm_prompt_logprobs(out["prompt_logprobs"], ids, reference(engine, ids), 1, tok)


def test_bad_scoring_requests_name_the_field(http):
    """400s name the field (the messages: tests/unit/test_api_errors.py's table)."""
    for path, body, param in [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ]:  # fmt: skip
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/completions", json={"model": "nope", "prompt": "hi", "echo": True,
                                           "logprobs": 1, "max_tokens": 0})  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenizer_endpoints(http, tok, engine):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)."""
    ids = prompt_ids(tok, "hello there")
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello there"}).json()
    assert r == {"count": len(ids), "max_model_len": engine.core.max_model_len, "tokens": ids}
    bare = http.post("/tokenize", json={"prompt": "hello there", "add_special_tokens": False})
    assert bare.json()["tokens"] == ids[1:]
    info = http.get("/tokenizer_info").json()
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [1]
    assert info["bos_token"] == tok.id_to_token(ids[0])
    back = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == info["bos_token"] + "hello there"
    assert http.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    r = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/tokenize", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_merged_deltas_keep_every_prompt_logprob():
    """A long prompt's logprobs come with each prefill chunk; a stream that merges deltas which
    piled up keeps them all, in order."""
    a = RequestOutput("r", prompt_logprobs=[None, TokenLogprob(5, -1.0)])
    b = RequestOutput("r", token_ids=[7], prompt_logprobs=[TokenLogprob(6, -2.0)])
    merged = a.merged(b)
    assert merged.prompt_logprobs == [None, TokenLogprob(5, -1.0), TokenLogprob(6, -2.0)]
    assert merged.token_ids == [7]
    assert RequestOutput("r").merged(b).prompt_logprobs == b.prompt_logprobs
