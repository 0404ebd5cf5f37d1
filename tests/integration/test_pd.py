"""Prefill/decode disaggregation on the real Serve app (CPU, tiny V4.1, 1 prefill rank +
1 decode rank, KV states through Ray's object store): the tokens equal one engine's (the
offline engine in this process; greedy, replay off) for chunked prompts and a request the
prefill rank finishes itself; an injected export failure and a header mismatch degrade to a
local prefill on the decode rank with the same tokens; a client that disconnects mid-decode
leaves no KV referenced on either side."""

from __future__ import annotations

import random
import time

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from app.builder import build_app  # noqa: E402
from app.engine.llm import LLM  # noqa: E402
from app.engine.request import SamplingParams  # noqa: E402
from app.grpc import fathom_pb2 as pb  # noqa: E402
from app.grpc import fathom_pb2_grpc as pbg  # noqa: E402
from app.serve_args import ServeArgs  # noqa: E402
from tests.integration.serve_util import deploy, wait_healthy  # noqa: E402

ENGINE = {
    "kv_cache_bytes": 1 << 24,
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,  # a 150-token prompt prefills in 3 chunks
    "bounded_replay": "off",
}
# the prefill rank: a device pool of 48 blocks (64 tokens, 36 KiB each on tiny-v41, 8 slots
# of 17 KiB) over a host tier of 200 (test_host_tier_hit_on_the_prefill_rank)
PREFILL_ENGINE = {"kv_cache_bytes": 8 * 17408 + 49 * 36864, "host_bytes": 200 * 36864}
META = (("application", "fathom"),)
rng = random.Random(3)
PROMPTS = [[0] + [rng.randrange(3, 500) for _ in range(n)] for n in (150, 20, 70, 9)]


@pytest.fixture(scope="module")
def pd_app(tmp_path_factory, cluster):
    args = {
        "model": "tiny-v41",
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "rank_num_cpus": 0.25,
        "engine": ENGINE,
        "api": {"request_timeout_s": 120},
        "pd": {"prefill": {"ranks": 1, "engine": PREFILL_ENGINE}, "decode": {"ranks": 1},
               "transfer_timeout_s": 20},  # fmt: skip
    }
    with deploy(build_app(args)):
        wait_healthy(cluster.base)
        path = ServeArgs.model_validate(args).model_path()
        yield cluster.base, cluster.grpc, str(path)


@pytest.fixture(scope="module")
def reference(pd_app):
    """Greedy tokens of one offline engine with the ranks' options, one request at a time."""
    llm = LLM(model=pd_app[2], **ENGINE)
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            memo[key] = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids
        return memo[key]

    return tokens


def generate(target: str, prompt: list[int], n: int) -> tuple[list[int], list]:
    with grpc.insecure_channel(target) as ch:
        req = pb.GenerateRequest(
            model="tiny-v41", token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingOptions(max_tokens=n, temperature=0, ignore_eos=True),
        )  # fmt: skip
        outs = list(pbg.GenerateServiceStub(ch).Generate(req, metadata=META, timeout=120))
    return [t for o in outs for t in o.token_ids], outs


def rank(name: str):
    return serve.get_deployment_handle(name, app_name="fathom")


def stats(name: str) -> dict[str, int]:
    return rank(name).pd_stats.remote().result(timeout_s=30)


def test_pd_tokens_equal_one_engine(pd_app, reference):
    target = pd_app[1]
    before = stats("DecodeRank")
    for prompt in PROMPTS[:3]:
        got, outs = generate(target, prompt, 12)
        assert got == reference(prompt, 12)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [len(o.token_ids) for o in outs if o.token_ids][0] == 1  # the prefill rank's
    one, outs = generate(target, PROMPTS[3], 1)  # the first token ends it: no handoff
    assert one == reference(PROMPTS[3], 1) and outs[-1].finish_reason == "length"
    dec, pre = stats("DecodeRank"), stats("PrefillRank")
    assert dec["received"] - before.get("received", 0) == 3
    assert dec["kv_imports"] - before.get("kv_imports", 0) == 3
    assert not {k for k in dec if k.startswith("fallback")}
    assert pre["sent"] >= 3 and pre["sent_bytes"] > 0


@pytest.mark.parametrize("fault,reason", [("export", "export_failed"), ("header", "mismatch")])
def test_injected_transfer_failure_degrades_to_local_prefill(pd_app, reference, fault, reason):
    before = stats("DecodeRank")
    rank("PrefillRank").set_fault.remote(fault).result(timeout_s=30)
    try:
        got, outs = generate(pd_app[1], PROMPTS[2][:40], 10)
    finally:
        rank("PrefillRank").set_fault.remote("none").result(timeout_s=30)
    assert got == reference(PROMPTS[2][:40], 10) and outs[-1].finish_reason == "length"
    after = stats("DecodeRank")
    key = f"fallback_{reason}"
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["kv_import_local"] - before["kv_import_local"] == 1
    assert after["kv_imports"] == before["kv_imports"]


def _kv_idle(name: str) -> bool:
    s = stats(name)
    return s["num_unfinished"] == 0 and s["kv_blocks_used"] == 0


def test_disconnect_mid_decode_frees_kv_on_both_sides(pd_app):
    body = {"model": "tiny-v41", "prompt": PROMPTS[0], "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", f"{pd_app[0]}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 6:  # well into the decode rank's part
                break
    deadline = time.time() + 30
    while not (_kv_idle("PrefillRank") and _kv_idle("DecodeRank")):
        assert time.time() < deadline, "KV still referenced after the disconnect"
        time.sleep(0.5)
    assert stats("DecodeRank")["kv_imports"] >= 1


def test_host_tier_hit_on_the_prefill_rank(pd_app, reference):
    """28 other 151-token prompts (56 full blocks) push PROMPTS[0]'s blocks out of the
    prefill rank's 48-block device pool into its host tier; asked again, the prompt is a
    host-tier hit: the same tokens, its two full blocks counted as cached (gRPC
    cached_tokens, the OpenAI usage's cached_tokens), host_hit_tokens up by them."""
    target = pd_app[1]
    generate(target, PROMPTS[0], 1)
    before = stats("PrefillRank")
    other = random.Random(9)
    for _ in range(28):
        generate(target, [0] + [other.randrange(3, 500) for _ in range(150)], 1)
    got, outs = generate(target, PROMPTS[0], 4)
    assert got == reference(PROMPTS[0], 4)
    assert max(o.cached_tokens for o in outs) == 128
    after = stats("PrefillRank")
    assert after["host_hit_tokens"] - before["host_hit_tokens"] == 128
