"""The real application on Ray Serve (CPU): Ingress + Router + 2 DP ranks of the tiny V4.1
model, driven by the official openai / anthropic SDKs, a gRPC client and raw HTTP; and /health
saying ready only once a rank finished its start-up warm-up."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")

from app.builder import _ingress, _rank_deployment, app_configs, build_app  # noqa: E402
from app.cache.events import HASH_NAMESPACE  # noqa: E402
from app.deployments.engine_host import LocalRankEngine  # noqa: E402
from app.deployments.rank import DPRank  # noqa: E402
from app.deployments.router import Router  # noqa: E402
from app.engine import startup  # noqa: E402
from app.grpc import fathom_pb2 as pb  # noqa: E402
from app.grpc import fathom_pb2_grpc as pbg  # noqa: E402
from app.model.tokenizer import build_tiny_tokenizer  # noqa: E402
from app.serve_args import ServeArgs  # noqa: E402
from tests.integration.serve_util import deploy, wait_healthy, wait_until  # noqa: E402
from tests.unit.test_api_errors import CASES  # noqa: E402

MODEL = "tiny-v41"
NO_THINK = {"thinking": {"type": "disabled"}}
# the tiny model is random: at temperature 1 its first token is EOS often enough to flake a
# ">= 1 output token" check, so requests that count tokens generate through EOS
FULL = {"ignore_eos": True}
EOS = "<｜end▁of▁sentence｜>"
KEY = "serve-test-key"  # the app requires it (api.api_keys) on HTTP /v1/* and on gRPC
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_META = (("application", "fathom"), ("authorization", f"Bearer {KEY}"))


def _gated_app(args: dict, engine_cls: type) -> object:
    """``build_app(args)`` with one DP rank whose engine is ``engine_cls``."""
    sa = ServeArgs.model_validate(args)
    cfgs, obs = app_configs(sa), sa.observability
    router = Router.bind(sa.routing, obs, cfgs.engram, cfgs.block_size, HASH_NAMESPACE)
    rank = _rank_deployment(DPRank, "DPRank", sa, 1, sa.rank_num_cpus, sa.rank_num_gpus).bind(
        cfgs.engine, router, cfgs.max_pending_per_rank, cfgs.max_queued_tokens_per_rank,
        sa.rank_step_timeout_s, tracing=obs, metrics_interval_s=None, engine_cls=engine_cls,
    )  # fmt: skip
    return _ingress(sa, cfgs, obs, rank, router)


def test_health_says_ready_only_after_the_warm_up(cluster, tmp_path):
    """A rank whose warm-up waits for a file: /health answers 503 while it warms up (the
    replica's constructor has not returned, so it reports to no Router) and 200 once the
    warm-up is done; then it serves (runs first: its own app beside the module's)."""
    from ray import serve

    entered, gate = tmp_path / "warming", tmp_path / "open"

    class GatedWarmup(LocalRankEngine):
        def __init__(self, *args, **kwargs) -> None:
            real = startup.warm_up

            def gated(core):
                entered.touch()
                while not gate.exists():
                    time.sleep(0.1)
                return real(core)

            startup.warm_up = gated  # this rank process only
            try:
                super().__init__(*args, **kwargs)
            finally:
                startup.warm_up = real

    args = {"model": MODEL, "cache_dir": str(tmp_path / "cache"), "dp_size": 1,
            "engine": {"kv_cache_bytes": 1 << 22, "max_model_len": 1024}}  # fmt: skip
    base = f"{cluster.base}/warmup"
    deploying = threading.Thread(
        target=serve.run, args=(_gated_app(args, GatedWarmup),),
        kwargs={"name": "warmup", "route_prefix": "/warmup"}, daemon=True,
    )  # fmt: skip
    deploying.start()
    try:
        wait_until(entered.exists, 120, "the rank's warm-up to start")
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, 60,
                   "the ingress to answer /health")  # fmt: skip
        for _ in range(3):  # still warming up: still not ready
            r = httpx.get(f"{base}/health", timeout=5)
            assert r.status_code == 503 and r.json()["status"] == "not ready"
            time.sleep(0.5)
        assert not gate.exists() and deploying.is_alive()  # serve.run waits for the rank
        gate.touch()
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 120,
                   "/health after the warm-up")  # fmt: skip
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **FULL})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        gate.touch()
        deploying.join(timeout=120)
        serve.delete("warmup")


@pytest.fixture(scope="module")
def app_urls(tmp_path_factory, cluster):
    args = {
        "model": MODEL,
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "dp_size": 2,
        "engine": {
            "kv_cache_bytes": 1 << 24,
            "max_model_len": 8192,
            "max_num_seqs": 48,
            "max_num_batched_tokens": 512,
        },
        "api": {
            "max_prompt_tokens": 2000,
            "request_timeout_s": 120,
            "api_keys": [KEY],
            "max_pending_per_rank": 40,
        },
    }
    with deploy(build_app(args)):
        wait_healthy(cluster.base)
        yield cluster.base, cluster.grpc


@pytest.fixture(scope="module")
def oai(app_urls):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{app_urls[0]}/v1", api_key=KEY, timeout=120)


def test_chat_stream_and_non_stream(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        extra_body={**NO_THINK, **FULL},
    )
    assert r.choices[0].finish_reason == "length"  # through EOS: exactly max_tokens
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 1
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert any(c.usage for c in chunks)


def test_n_choices_and_logit_bias_through_ray(oai):
    """Through the Serve app's ranks: ``logit_bias`` +100 on a token makes every greedy token
    of every streamed choice it; +100 on EOS ends every choice at once with an empty delta
    (each still reports its own finish; usage counts the prompt once)."""
    tok = build_tiny_tokenizer()  # the tiny checkpoint's
    (x_id,), eos_id = tok.encode("x", add_special_tokens=False).ids, tok.token_to_id(EOS)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3, stream=True,
        temperature=0, logit_bias={str(x_id): 100}, stream_options={"include_usage": True},
        extra_body={**NO_THINK, **FULL}))  # fmt: skip
    text = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
    assert text == {0: "xxxx", 1: "xxxx", 2: "xxxx"}
    assert chunks[-1].usage.completion_tokens == 12
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
        temperature=0, logit_bias={str(eos_id): 100}, extra_body=NO_THINK)  # fmt: skip
    assert [(c.index, c.finish_reason, c.message.content) for c in r.choices] == [
        (i, "stop", "") for i in range(3)]  # fmt: skip


def test_json_schema_output_validates(oai):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick."}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        extra_body=NO_THINK,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_tool_call_required(oai):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=96,
        seed=1,
        extra_body=NO_THINK,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")


def test_parallel_tool_calls_off_makes_one_call(oai):
    """``parallel_tool_calls: false`` on the Serve app: the grammar closes the required calls
    block after one call."""
    params = {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"]}
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Pick."}], tools=[tool],
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=seed,
            extra_body=NO_THINK,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert json.loads(calls[0].function.arguments)["c"] in ("a", "b")


def test_responses_api(oai):
    r = oai.responses.create(
        model=MODEL, input="Say something.", max_output_tokens=8, extra_body=FULL
    )
    # through EOS, the answer always runs into max_output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8


def test_anthropic_messages(app_urls):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=app_urls[0], api_key=KEY, timeout=120)
    m = c.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_body=FULL
    )
    assert m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8
    with c.messages.stream(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hello"}]
    ) as s:
        events = list(s)
    assert events[0].type == "message_start"


def _readme_lm_eval_command() -> list[str]:
    """The lm-eval command of the README (its ``lm-eval run`` block, continued lines joined)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    m = re.search(r"^lm-eval run (?:.*\\\n)*.*$", readme, re.M)
    assert m, "README.md shows no lm-eval command"
    return shlex.split(m.group(0).replace("\\\n", " "))


def test_lm_eval_runs_the_readme_command(app_urls, tmp_path):
    """lm-eval's ``local-completions`` model against the app, by the README's command (this
    app's URL, model and key put in): a loglikelihood task and a generate-until task defined
    in tests/lm_eval_tasks (local data). Each loglikelihood lm-eval reports is the app's own:
    the continuation's echoed logprobs, its context measured by /tokenize."""
    base = app_urls[0]
    cmd = [a.replace("http://127.0.0.1:8000", base).replace("tiny-v41-chat", MODEL)
           for a in _readme_lm_eval_command()]  # fmt: skip
    at = cmd.index("--model_args") + 1
    cmd[at] += f",auth_token={KEY}"  # the remote tokenizer's key (the requests': OPENAI_API_KEY)
    lm_eval = Path(sys.executable).with_name("lm-eval")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([str(lm_eval), *cmd[1:], "--output_path", str(tmp_path), "--log_samples"],
                       cwd=root, env={**os.environ, "OPENAI_API_KEY": KEY}, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["fathom_pydoc_choice"]["acc,none"] <= 1
    assert 0 <= results["fathom_pydoc_gen"]["exact_match,strip"] <= 1
    gen = [json.loads(x) for x in next(tmp_path.rglob("samples_fathom_pydoc_gen_*")).open()]
    assert len(gen) == 4 and all("\n" not in s["resps"][0][0] for s in gen)
    samples = [json.loads(x) for x in next(tmp_path.rglob("samples_fathom_pydoc_choice_*")).open()]
    assert len(samples) == 6
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}).status_code == 401  # keyed
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:

        def ids(text: str) -> list[int]:
            body = {"prompt": text, "add_special_tokens": False}
            return http.post("/tokenize", json=body).json()["tokens"]

        for s in samples:
            for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
                ctx, cont = args["arg_0"], args["arg_1"]
                whole = ids(ctx + cont)
                body = {"model": MODEL, "prompt": whole, "echo": True, "logprobs": 1,
                        "max_tokens": 0, "temperature": 0}  # fmt: skip
                lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
                assert len(lp["token_logprobs"]) == len(whole)
                want = sum(lp["token_logprobs"][len(ids(ctx)) :])
                assert float(resp[0][0]) == pytest.approx(want, rel=1e-3, abs=1e-3)


def test_grpc_streams_token_ids_and_text(app_urls):
    with grpc.insecure_channel(app_urls[1]) as ch:
        stub = pbg.GenerateServiceStub(ch)
        req = pb.GenerateRequest(
            model=MODEL,
            text="Hello there",
            sampling=pb.SamplingOptions(max_tokens=5, temperature=0),
        )
        outs = list(stub.Generate(req, metadata=GRPC_META, timeout=120))
        ids = pb.GenerateRequest(
            model=MODEL,
            token_ids=pb.TokenIds(ids=[0, 5, 9]),
            sampling=pb.SamplingOptions(max_tokens=3, ignore_eos=True),
        )
        outs2 = list(stub.Generate(ids, metadata=GRPC_META, timeout=120))
    assert outs[-1].finished and outs[-1].completion_tokens == sum(len(o.token_ids) for o in outs)
    assert outs2[-1].finish_reason == "length" and outs2[-1].completion_tokens == 3


def test_32_concurrent_streams_complete(app_urls):
    openai = pytest.importorskip("openai")

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{app_urls[0]}/v1", api_key=KEY, timeout=300)

        async def one(i: int) -> int:
            n = 0
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=8,
                stream=True,
                extra_body={**NO_THINK, **FULL},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    n += 1
            return n

        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(main()) == [1] * 32


def _unfinished(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    vals = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fathom_rank_stat{") and 'stat="num_unfinished"' in line
    ]
    return sum(vals)


def _drained(base: str, timeout_s: float = 45.0) -> bool:
    """No rank reports an unfinished request for 2 s in a row. One zero is not enough: the
    gauges are the ranks' last reports (every 0.5 s), which may predate a request just sent."""
    deadline, zero_since = time.time() + timeout_s, None
    while time.time() < deadline:
        if _unfinished(base) > 0:
            zero_since = None
        elif zero_since is None:
            zero_since = time.time()
        elif time.time() - zero_since >= 2.0:
            return True
        time.sleep(0.25)
    return False


def test_burst_of_disconnects_keeps_serving(app_urls):
    """Rounds of 64 streams dropped at random points, many before their rank took them. The
    ingress's pinned request router once retried such requests in a busy loop that starved
    its event loop for good (/health 503, /metrics hanging); now it backs off."""
    base = app_urls[0]
    rng = random.Random(7)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"go {i}"}],
            "max_tokens": 4000,
            "stream": True,
            **NO_THINK,
        }
        try:
            async with asyncio.timeout(rng.uniform(0.005, 1.5)):
                async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass

    async def main() -> None:
        async with httpx.AsyncClient(
            timeout=60, limits=httpx.Limits(max_connections=100), headers=AUTH
        ) as c:
            for _ in range(6):  # without the fix, about one round in two wedged the ingress
                await asyncio.gather(*(one(c, i) for i in range(64)))
                t = time.time()
                # a wedged ingress answers 503 or never (the 10 s timeouts); a loaded 2-core
                # CI machine once took 6.4 s for the pair, so the bound leaves room for that
                assert (await c.get(f"{base}/health", timeout=10)).status_code == 200
                assert (await c.get(f"{base}/metrics", timeout=10)).status_code == 200
                assert time.time() - t < 8.0

    asyncio.run(main())
    assert _drained(base)


def test_disconnected_stream_frees_its_kv(app_urls):
    base = app_urls[0]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 4000,
        "stream": True,
        **NO_THINK,
    }
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, timeout=60, headers=AUTH
    ) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    assert _drained(base)


@pytest.mark.parametrize(
    ("path", "body", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_requests_through_ray(app_urls, path, body, status, words):
    base = app_urls[0]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json", **AUTH}
    r = httpx.post(f"{base}{path}", headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    assert words.lower() in r.text.lower()
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_duplicate_client_ids_touch_nothing(app_urls):
    """Issue 15, finding 2: gRPC calls carrying the id of a running HTTP stream (twice at once)
    once aborted it. Client ids are metadata now: all three requests complete in full."""
    base, grpc_addr = app_urls
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "victim"}],
        "max_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True},
        **NO_THINK,
        **FULL,
    }
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, timeout=120, headers=AUTH
    ) as r:
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        victim_id = next(events)["id"]
        req = pb.GenerateRequest(
            model=MODEL,
            token_ids=pb.TokenIds(ids=[0, 5, 9]),
            sampling=pb.SamplingOptions(max_tokens=3, ignore_eos=True),
            request_id=victim_id,
        )
        with grpc.insecure_channel(grpc_addr) as ch:
            stub = pbg.GenerateServiceStub(ch)
            calls = [stub.Generate(req, metadata=GRPC_META, timeout=120)
                     for _ in range(2)]  # fmt: skip
            outs = [list(c) for c in calls]
        rest = list(events)
    for o in outs:
        assert o[-1].finish_reason == "length" and o[-1].completion_tokens == 3, o[-1]
        assert o[-1].request_id == victim_id  # echoed back as metadata
    assert rest[-1]["usage"]["completion_tokens"] == 48
    assert any(e["choices"] and e["choices"][0]["finish_reason"] == "length" for e in rest)


def test_grpc_status_codes_through_serve(app_urls):
    """Issue 15, finding 3: through Serve's gRPC proxy, a missing key, a malformed message and
    an invalid field get UNAUTHENTICATED / INVALID_ARGUMENT with a clear message (they once
    got OK with the error in-band, or UNKNOWN with a Python exception text)."""
    ok = pb.GenerateRequest(
        model=MODEL, token_ids=pb.TokenIds(ids=[0, 5]), sampling=pb.SamplingOptions(max_tokens=2)
    )
    bad = pb.GenerateRequest(
        model=MODEL, token_ids=pb.TokenIds(ids=[0, 5]), sampling=pb.SamplingOptions(top_p=0)
    )
    with grpc.insecure_channel(app_urls[1]) as ch:
        stub = pbg.GenerateServiceStub(ch)
        raw = ch.unary_stream("/fathom.GenerateService/Generate", request_serializer=None)
        cases = [
            (lambda: stub.Generate(ok, metadata=GRPC_META[:1], timeout=60), "UNAUTHENTICATED"),
            (lambda: raw(b"\x12\xff\xff\xff\xff\x0f", metadata=GRPC_META, timeout=60),
             "INVALID_ARGUMENT"),
            (lambda: stub.Generate(bad, metadata=GRPC_META, timeout=60), "INVALID_ARGUMENT"),
        ]  # fmt: skip
        for make, code in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(make())
            assert e.value.code().name == code, e.value
            assert "Traceback" not in e.value.details()
        assert "top_p" in e.value.details()  # the last case names its field
        assert list(stub.Generate(ok, metadata=GRPC_META, timeout=60))[-1].finished


def test_1000_at_once_excess_gets_429(app_urls):
    """Issue 15, finding 4: 1000 requests at once once all got 200 and queued ~490 per rank
    (368 still waiting at 120 s). Now each rank holds at most 40: the excess gets 429 with
    Retry-After at once, and every accepted request completes in full."""
    base = app_urls[0]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None, dict]:
        body = {"model": MODEL, "prompt": [0, 5 + i % 200], "max_tokens": 2, "ignore_eos": True}
        r = await c.post(f"{base}/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), r.json()

    async def main() -> list[tuple[int, str | None, dict]]:
        limits = httpx.Limits(max_connections=1000)
        async with httpx.AsyncClient(timeout=300, limits=limits, headers=AUTH) as c:
            return await asyncio.gather(*(one(c, i) for i in range(1000)))

    t0 = time.time()
    results = asyncio.run(main())
    took = time.time() - t0
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 429]
    assert len(ok) + len(busy) == 1000, {r[0] for r in results}
    assert len(busy) > 0 and all(r[1] == "1" for r in busy)
    assert all("overloaded" in r[2]["error"]["message"] for r in busy)
    assert len(ok) >= 80 and all(r[2]["usage"]["completion_tokens"] == 2 for r in ok)
    print(f"1000 at once: {len(ok)} x 200, {len(busy)} x 429 in {took:.1f} s")
    assert _drained(base)


def test_http_hygiene_through_serve(app_urls):
    """Issue 15, findings 7-8 through Serve's proxy: one x-request-id per response, deep JSON
    and a 1 MB header are 4xx (not 500 / accepted), a cross-origin text/plain POST is 403."""
    base = app_urls[0]
    body = {"model": MODEL, "prompt": [0, 5], "max_tokens": 1}
    ok = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and len(ok.headers.get_list("x-request-id")) == 1
    deep = b'{"model": "tiny-v41", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(f"{base}/v1/completions", content=deep, timeout=60,
                   headers={**AUTH, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "nested deeper" in r.text
    big = httpx.get(f"{base}/v1/models", headers={**AUTH, "x-big": "v" * (1 << 20)}, timeout=60)
    assert big.status_code == 431, big.status_code
    evil = httpx.post(
        f"{base}/v1/completions",
        content=json.dumps(body),
        headers={"content-type": "text/plain", "origin": "http://evil.example"},
        timeout=60,
    )
    assert evil.status_code == 403 and "cross-origin" in evil.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def _rank_stat(base: str, stat: str) -> dict[str, float]:
    """rank -> its last reported ``stat``, from /metrics."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("fathom_rank_stat{") and f'stat="{stat}"' in line:
            out[line.split('rank="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) still runs: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _rank_labels(base: str) -> set[str]:
    return set(_rank_stat(base, "num_unfinished"))


def test_killed_rank_streams_end_retriably_new_requests_succeed(app_urls):
    """A rank SIGKILLed mid-traffic (runs last: Serve restarts the rank): its streams end
    with a retriable 503 error event, the other rank's streams finish, requests sent right
    after are retried on the live rank (no failure reaches a client), the dead rank's metric
    series disappear, and the app is back to two ranks."""
    base = app_urls[0]
    actors = {
        a["name"].rsplit("#", 1)[1]: a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "DPRank" in a["name"]
    }
    assert len(actors) == 2 and _rank_labels(base) == set(actors)
    victim: dict = {}
    # long enough that no stream finishes before the kill (checked below: the kill comes
    # once every stream has tokens and the reports count all four, seconds after the start;
    # at 1200 tokens an old exact-count wait once let all four finish first); short enough
    # that a live rank's streams end well inside the 120 s request timeout: this CPU engine
    # makes ~24 tokens/s per stream with two streams on a rank alone on a 2-core machine,
    # ~7 beside the unit suite (at 1700 the live streams timed out at 800-1561 tokens: runs
    # passed only when all four streams sat on the victim)
    n_tokens = 600
    # "tokens": chunks with generated text (the first chunk, the role's, has none: a kill
    # before a stream's first token is retried on the live rank, as it should be, so the
    # kill must wait for text on every stream)
    seen: list[dict] = [{"chunks": 0, "tokens": 0, "finish": None, "usage": None, "error": None,
                         "done": False} for _ in range(4)]  # fmt: skip

    async def stream(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"s{i}"}],
                "max_tokens": n_tokens, "stream": True, "stream_options": {"include_usage": True},
                **NO_THINK, **FULL}  # fmt: skip
        st = seen[i]
        async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    st["done"] = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    st["error"] = ev["error"]
                    continue
                if ev.get("usage"):
                    st["usage"] = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices", []):
                    st["chunks"] += 1
                    st["tokens"] += bool(ch.get("delta", {}).get("content"))
                    st["finish"] = ch.get("finish_reason") or st["finish"]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"model": MODEL, "prompt": [0, 7, i], "max_tokens": 4, "ignore_eos": True}
        r = await c.post(f"{base}/v1/completions", json=body)
        return r.status_code, r.json().get("usage", {}).get("completion_tokens", 0)

    async def main() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            streams = [asyncio.create_task(stream(c, i)) for i in range(4)]
            deadline = time.time() + 60
            while not all(st["tokens"] for st in seen):  # every stream has tokens out
                assert time.time() < deadline, seen
                await asyncio.sleep(0.1)
            # the ranks report every 0.5 s and a loaded machine can be late: wait until the
            # reported gauges count all four streams (none finishes before the kill)
            deadline = time.time() + 30
            while sum((busy := _rank_stat(base, "num_unfinished")).values()) != 4:
                assert time.time() < deadline, (busy, seen)
                await asyncio.sleep(0.25)
            rid = max(busy, key=busy.get)  # a rank serving some of the streams
            unfinished = [st["finish"] is None for st in seen]
            victim.update(id=rid, streams=int(busy[rid]), unfinished_at_kill=unfinished)
            actor = actors[rid]
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            t_pid = time.time()
            pid = await handle.__ray_call__.remote(lambda _self: os.getpid())
            t_kill = time.time()
            victim.update(pid_s=round(t_kill - t_pid, 2),
                          at_kill=[(st["tokens"], st["finish"]) for st in seen])  # fmt: skip
            ray.kill(handle)
            while _alive(pid):  # the kill has landed once the rank's process is gone
                assert time.time() < t_kill + 30, f"rank {rid} (pid {pid}) still alive after 30 s"
                await asyncio.sleep(0.05)
            victim.update(pid=pid, kill_s=round(time.time() - t_kill, 2),
                          at_death=[(st["tokens"], st["finish"]) for st in seen])  # fmt: skip
            after = await asyncio.gather(*(one(c, i) for i in range(10)))
            await asyncio.gather(*streams)
            return after

    after = asyncio.run(main())
    print(f"victim {victim}\nstreams {seen}")  # whole, where a failure's message is cut
    assert after == [(200, 4)] * 10, after  # retried on the live rank, none failed
    # the gauge counts the victim's streams only if none had finished when it was read
    assert all(victim["unfinished_at_kill"]), (victim, seen)
    errors = [st["error"] for st in seen if st["error"] is not None]
    n_victim = victim["streams"]
    assert n_victim >= 1 and len(errors) == n_victim, (victim, seen)
    for st in seen:
        if st["error"] is None:  # the live rank's streams run to the end: nothing lost
            assert st["done"] and st["finish"] == "length" and st["usage"] == n_tokens, st
        else:  # the victim's: a retriable 503 event, no [DONE], no finish
            e = st["error"]
            assert e["type"] == "service_unavailable" and e["code"] == "engine_unavailable", st
            assert e["message"].count("retry the request") == 1, e["message"]
            assert not st["done"] and st["finish"] is None, st
    assert victim["id"] not in _rank_labels(base)  # dropped at once: its series are gone
    deadline = time.time() + 120
    while len(_rank_labels(base)) < 2:  # Serve restarts the rank
        assert time.time() < deadline, "the killed rank did not come back"
        time.sleep(1)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
