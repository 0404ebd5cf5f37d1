"""Expert parallelism on the real Serve app (CPU, tiny V4.1): one gang of two DP ranks
(Serve gang scheduling, gloo, Engram rows sharded over the gang): greedy completions equal
the one-process engine's while the other rank idles, and a killed rank restarts its gang
without a request hanging."""

from __future__ import annotations

import asyncio

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from app.builder import build_app  # noqa: E402
from app.engine.llm import LLM  # noqa: E402
from app.engine.model_path import resolve_model  # noqa: E402
from app.engine.request import SamplingParams  # noqa: E402
from tests.integration.serve_util import deploy, wait_until  # noqa: E402

ENGINE = {"kv_cache_bytes": 1 << 22, "max_model_len": 1024, "max_num_batched_tokens": 64}
PROMPTS = [[5, 9, 200, 17, 33, 8], list(range(3, 40))]
N = 4


@pytest.fixture(scope="module")
def app(tmp_path_factory, cluster):
    cache = str(tmp_path_factory.mktemp("cache"))
    args = {
        "model": "tiny-v41",
        "cache_dir": cache,
        "dp_size": 2,
        "ep_size": 2,
        "engram_placement": "sharded",
        "rank_num_cpus": 0.5,
        "engine": ENGINE,
    }
    with deploy(build_app(args)):
        wait_until(lambda: len(_ranks()) == 2, 120, "the gang's two ranks reporting")
        path = resolve_model("tiny-v41", cache)
        llm = LLM(model=str(path), **ENGINE)  # EP1: one process
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy)
        ref = [[tok.decode([t], skip_special_tokens=False) for t in o.token_ids] for o in outs]
        yield cluster.base, ref


def _ranks() -> dict[str, dict]:
    router = serve.get_deployment_handle("Router", app_name="fathom")
    return router.ranks_stats.remote().result(timeout_s=30)


async def _complete(
    c: httpx.AsyncClient, url: str, prompt: list[int], n: int = N
) -> httpx.Response:
    body = {"model": "tiny-v41", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    return await c.post(f"{url}/v1/completions", json=body)


def _tokens(r: httpx.Response) -> list[str]:
    """The completion's tokens, each decoded on its own (the logprobs' ``tokens``)."""
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_gang_outputs_equal_one_process_with_an_idle_rank(app):
    url, ref = app
    stats = _ranks()
    assert sorted(s["ep_rank"] for s in stats.values()) == [0, 1]
    shards = [s["engram_private_bytes"] for s in stats.values()]
    assert shards[0] > 0 and abs(shards[0] - shards[1]) <= shards[0] // 8  # rows split in two

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as c:  # one at a time: one rank idles
            return [_tokens(await _complete(c, url, p)) for p in PROMPTS]

    assert asyncio.run(main()) == ref


def test_killed_rank_restarts_its_gang_and_no_request_hangs(app):
    url, ref = app
    before = set(_ranks())
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if "DPRank" in a["name"])  # fmt: skip

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as c:
            flight = [asyncio.create_task(_complete(c, url, p, n=200)) for p in PROMPTS]
            await asyncio.sleep(1.0)
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
            return await asyncio.wait_for(asyncio.gather(*flight), 90)  # none hangs

    for r in asyncio.run(main()):  # done, or a clear retriable error
        assert r.status_code == 200 or (r.status_code == 503 and "retry" in r.text.lower()), r.text
    # the whole gang was replaced (both replica ids are new), and it serves the same tokens
    wait_until(lambda: len(s := set(_ranks())) == 2 and not s & before, 120, "a new gang")

    async def again() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as c:
            return [_tokens(await _complete(c, url, p)) for p in PROMPTS]

    assert asyncio.run(again()) == ref
