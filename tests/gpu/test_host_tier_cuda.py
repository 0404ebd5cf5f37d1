"""Host KV tier on CUDA: pinned rows, load-backs on the copy stream that a request waits for
(and only it), the same greedy output as a device hit."""

from __future__ import annotations

import pytest
import torch

from app.cache.host_tier import HostTier
from app.cache.manager import CacheManager
from app.config import CacheConfig, EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.engine.sequence import SeqStatus
from app.model.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
P = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _busy_copy_stream(host: HostTier, cycles: int = 200_000_000) -> None:
    """Keep the copy stream busy (~0.1 s) so a load issued now is still pending."""
    with torch.cuda.stream(host.copy_stream):
        torch.cuda._sleep(cycles)


def test_pinned_rows_async_load_and_ready(ckpts):
    model = load_model(ckpts["v41"], device="cuda")
    cfg = CacheConfig(block_size=P, host_bytes=1 << 20)
    cm = CacheManager(model, cfg, num_blocks=8, max_slots=2, device="cuda")
    host = cm.host
    assert host is not None and host.data.is_pinned()
    for v in host.views:
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda"))
    want = [v[[1, 2]].clone() for v in host.views]
    rows = [host.alloc(), host.alloc()]
    host.offload([1, 2], rows)
    warm = [host.alloc()]  # one load first: kernel loading (lazy, synchronizing) stays out
    host.offload([0], warm)
    host.load(warm, [7])
    host.synchronize()
    _busy_copy_stream(host, 2_000_000_000)  # ~1 s
    host.load(rows, [5, 6])
    host.poll()
    assert not host.ready([5]) and host.ready([1, 3])  # only the loaded blocks wait
    host.synchronize()
    assert host.ready([5, 6]) and host.num_free == host.num_blocks
    assert all(torch.equal(v[[5, 6]], w) for v, w in zip(host.views, want, strict=True))


def _engine(path, model, num_blocks: int, host_blocks: int) -> EngineCore:
    lay = CacheManager.layout_for(model, CacheConfig(block_size=P), torch.float32)
    cfg = EngineConfig.from_options(
        path, device="cuda", block_size=P, max_num_seqs=2, cuda_graphs=False,
        kv_cache_bytes=3 * lay.bytes_per_slot + (num_blocks + 1) * lay.bytes_per_block,
        host_bytes=host_blocks * lay.bytes_per_block,
    )  # fmt: skip
    return EngineCore(cfg, model=model)


def _generate(eng: EngineCore, rid: str, prompt: list[int]) -> list[int]:
    eng.add_request(EngineRequest(rid, tuple(prompt), GREEDY))
    out = []
    while eng.has_unfinished:
        for o in eng.step():
            out += o.token_ids
    return out


def test_request_waits_for_its_load_and_matches_a_device_hit(ckpts):
    path = ckpts["v41"]
    model = load_model(path, device="cuda")
    g = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(3, 500, (2 * P + 5,), generator=g).tolist() for _ in "ab")
    follow = prompt + [11, 12, 13]
    big = _engine(path, model, 8, 0)
    _generate(big, "p", prompt)
    want = _generate(big, "f", follow)
    small = _engine(path, model, 3, 4)
    _generate(small, "p", prompt)
    _generate(small, "o", other)
    _busy_copy_stream(small.cache.host)
    small.add_request(EngineRequest("f", tuple(follow), GREEDY))
    small.step()
    seq = small._seqs["f"]
    assert seq.status is SeqStatus.LOADING and seq in small.scheduler.loading
    got = []
    while small.has_unfinished:
        for o in small.step():
            got += o.token_ids
            assert o.num_cached_tokens == 2 * P
    assert got == want and small.stats.host_hit_tokens == 2 * P
    small.cache.check_integrity()
