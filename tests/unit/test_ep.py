"""Expert parallelism without Ray: placements, and two real gloo processes running the engine
(EP2) against the one-process engine (EP1) on the tiny V4.1 and V4 checkpoints: identical
greedy tokens with unequal loads (one rank idle, or a shorter prompt), redundant experts,
packed and dequantized experts, and the three Engram placements."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.config import EngineConfig, EngineConfigError, ParallelConfig
from app.engine.core import EngineCore
from app.engine.parallel import RankParallel
from app.engine.request import SamplingParams
from app.model.config import ModelConfig
from app.model.ep import EPGroup, ExpertPlacement, PlacementError, pair_slots
from bench.gang import greedy_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = tuple(range(3, 35))  # 32 tokens: two chunks; the first skips the decoder layers
SHORT = (5, 9, 200, 17, 33)

# (arch, engram placement, redundant experts, packed experts, rank 1's prompts)
CASES = [
    ("v41", "replicated", 0, "off", ()),
    ("v41", "host", 2, "on", (SHORT,)),
    ("v41", "sharded", 0, "off", ()),
    ("v4", "replicated", 2, "off", (SHORT,)),
]


def test_default_placement_and_routes() -> None:
    p = ExpertPlacement.default(8, 2, redundant=2)
    assert p.local(0) == (0, 1, 2, 3, 4) and p.local(1) == (4, 5, 6, 7, 0)
    assert p.offset(1) == 5 and p.slots_per_rank == 5
    ids = torch.tensor([[0, 4], [4, 6], [0, 7]])
    # rank 0 holds 0 and 4 itself; 6 and 7 only live on rank 1 (slots 6, 8)
    assert pair_slots(ids, p.routes(0, "cpu")).tolist() == [[0, 4], [4, 7], [0, 8]]
    # rank 1: its own replica of 0 (slot 9) and of 4 (slot 5)
    assert pair_slots(ids, p.routes(1, "cpu")).tolist() == [[9, 5], [5, 7], [9, 8]]
    with pytest.raises(PlacementError, match="multiples of ep_size"):
        ExpertPlacement.default(8, 3)
    with pytest.raises(PlacementError, match="twice"):
        ExpertPlacement(4, 2, (0, 0, 1, 2, 3, 1))  # rank 0 would hold expert 0 twice
    with pytest.raises(PlacementError, match="every expert"):
        ExpertPlacement(4, 2, (0, 1, 2, 2))


def test_parallel_config_validation(tiny_ckpt) -> None:
    mcfg = ModelConfig.from_file(tiny_ckpt("v41"))  # 8 routed experts
    ParallelConfig(ep_size=2, redundant_experts=2, engram_placement="sharded").check(mcfg, 4)
    with pytest.raises(EngineConfigError, match="multiple of ep_size"):
        ParallelConfig(ep_size=2).check(mcfg, 3)
    with pytest.raises(EngineConfigError, match="do not split"):
        ParallelConfig(ep_size=3).check(mcfg, 3)
    with pytest.raises(EngineConfigError, match="redundant_experts"):
        ParallelConfig(ep_size=2, redundant_experts=1)
    with pytest.raises(EngineConfigError, match="needs ep_size > 1"):
        ParallelConfig(engram_placement="sharded")


def _opts(packed: str) -> dict:
    return {"kv_cache_bytes": 1 << 22, "max_num_batched_tokens": 16, "packed_experts": packed}


def _worker(rank: int, paths: dict[str, str], store: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores: spinning OpenMP threads stall gloo
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = EPGroup(rank, 2)
    result: dict = {"ep2": [], "ep1": [], "bytes": []}
    ep1: dict[tuple, dict] = {}
    for arch, engram, redundant, packed, other in CASES:
        prompts = (LONG, SHORT) if rank == 0 else other
        placement = ExpertPlacement.default(8, 2, redundant)
        shm = Path(out_dir) / "shm"
        par = RankParallel(group, placement, engram, f"t-{arch}-{redundant}", str(shm))
        cfg = EngineConfig.from_options(paths[arch], **_opts(packed))
        core = EngineCore(cfg, parallel=par)
        result["ep2"].append(greedy_tokens(core, prompts, GREEDY, gang=True))
        result["bytes"].append(par.engram_bytes)
        if (arch, packed) not in ep1:  # the one-process engine (its Engram: replicated)
            ep1[arch, packed] = greedy_tokens(EngineCore(cfg), prompts, GREEDY, gang=False)
        result["ep1"].append(ep1[arch, packed])
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def test_ep2_equals_ep1(tiny_ckpt, tmp_path) -> None:
    paths = {"v41": tiny_ckpt("v41"), "v4": tiny_ckpt("v4")}
    mp.start_processes(_worker, args=(paths, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="spawn")  # fmt: skip
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    for c, (arch, engram, _, _, other) in enumerate(CASES):
        for r, res in enumerate(ranks):
            ep2, ep1 = res["ep2"][c], res["ep1"][c]
            assert ep2 == ep1, (arch, engram, r)
            assert all(len(t) == GREEDY.max_tokens for t in ep1.values())
        assert len(ranks[1]["ep2"][c]) == len(other)  # rank 1: idle, or a lighter load
        assert ranks[0]["ep2"][c]["r0"] != ranks[0]["ep2"][c]["r1"]  # different prompts
    full = ranks[0]["bytes"][0].private  # replicated: every table on every rank
    assert full > 0 and ranks[1]["bytes"][0].private == full
    host = ranks[0]["bytes"][1]
    assert host.private == 0 and host.shared == full  # one mapped copy per node
    sharded = [res["bytes"][2].private for res in ranks]
    assert sum(sharded) == full and max(sharded) < full
    assert ranks[0]["bytes"][3].private == 0  # V4 has no Engram


def _layer(shard, packed: bool, dtype: torch.dtype = torch.float32):
    """A seeded MoE layer (8 experts, 64 wide, top-3): every expert (``shard`` None) or the
    slots of ``shard``; ``packed``: fp8 32x32-block experts (the MegaMoE kernels' format);
    ``dtype`` of the activations and dense weights (the gate's bias stays fp32)."""
    from app.model.moe import MoE, PackedExperts

    torch.manual_seed(0)
    full = MoE(64, 64, 8, 3, 2.5, 10.0)
    for p in full.parameters():
        p.data.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    held = list(range(8)) if shard is None else list(shard.local)
    moe = full if shard is None else MoE(64, 64, 8, 3, 2.5, 10.0, shard=shard)
    if shard is not None:
        moe.gate.load_state_dict(full.gate.state_dict())
        moe.shared_experts.load_state_dict(full.shared_experts.state_dict())
        for e in held:
            moe.experts[str(e)].load_state_dict(full.experts[e].state_dict())
    if packed:
        g = torch.Generator().manual_seed(1)
        w13 = (torch.randn(8, 128, 64, generator=g) * 64).to(torch.float8_e4m3fn)[held]
        w2 = (torch.randn(8, 64, 64, generator=g) * 64).to(torch.float8_e4m3fn)[held]
        s13 = torch.randint(116, 119, (8, 4, 2), generator=g).byte()[held]
        s2 = torch.randint(116, 119, (8, 2, 2), generator=g).byte()[held]
        e8 = torch.float8_e8m0fnu
        off = 0 if shard is None else shard.offset
        moe.experts = PackedExperts(w13, s13.view(e8), w2, s2.view(e8), "fp8", (32, 32), 10.0,
                                    off)  # fmt: skip
    if dtype != torch.float32:
        moe.to(dtype)
        moe.gate.bias.data = moe.gate.bias.data.float()
    return moe.eval()


def _moe_worker(rank: int, store: str, out_dir: str) -> None:
    from app.model.ep import ExpertShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = EPGroup(rank, 2, dense_max_tokens=6)  # steps above 6 tokens on a rank: sized
    g = torch.Generator().manual_seed(10 + rank)
    got: dict = {}
    f32, bf16 = torch.float32, torch.bfloat16
    for packed, redundant, tokens, mode, dt in [
        (False, 0, (6, 3), "dense", f32), (False, 2, (7, 0), "sized", f32),
        (True, 2, (5, 2), "dense", f32), (True, 0, (6, 9), "sized", f32),
        (False, 2, (0, 4), "dense", f32), (False, 0, (2, 12), "sized", f32),
        (False, 0, (6, 5), "dense", bf16), (True, 2, (9, 20), "sized", bf16),
    ]:  # fmt: skip
        placement = ExpertPlacement.default(8, 2, redundant)
        moe = _layer(ExpertShard(placement, rank), packed, dt)
        moe.set_ep(placement, group)
        x = torch.randn(tokens[rank], 64, generator=g).to(dt)
        tok = torch.randint(0, 100, (tokens[rank],), generator=g)
        most = group.agree(x.shape[0])
        assert (group.capacity is not None) == (mode == "dense") and most == max(tokens)
        with torch.no_grad():
            got[packed, redundant, tokens, mode, dt] = (x, tok, moe(x, tok))
    Path(out_dir, f"moe{rank}.pkl").write_bytes(pickle.dumps(got))
    dist.destroy_process_group()


def test_ep_moe_dense_and_sized_equal_one_rank(tmp_path) -> None:
    """One MoE layer over two gloo ranks: the dense (all-gather + reduce-scatter) and the
    sized (all-to-all) exchanges give each rank the one-process layer's output for its
    tokens, with dequantized and packed fp8 experts, redundant slots, unequal and empty
    loads; the size-1 EP path is the fused layer itself."""
    mp.start_processes(_moe_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    cases = [pickle.loads((tmp_path / f"moe{r}.pkl").read_bytes()) for r in (0, 1)]
    for r, got in enumerate(cases):
        for (packed, _, tokens, mode, dt), (x, tok, out) in got.items():
            assert out.shape == (tokens[r], 64) and out.dtype == dt
            with torch.no_grad():
                ref = _layer(None, packed, dt)(x, tok)
            assert tokens[r] == 0 or ref.abs().max() > 0.1
            if dt == torch.float32:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=(r, packed, mode))
            else:  # fp32 partial sums: at most the order of fp32 additions differs, so the
                # bf16 outputs are equal but for rare one-unit roundings (bf16 partials
                # rounded before the combine differed on most rows)
                differ = (out != ref).float().mean().item()
                assert differ <= 0.02, (r, packed, mode, differ)
                torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-7 * ref.abs().max())
    one = _layer(None, True)
    one.set_ep(ExpertPlacement.default(8, 1), EPGroup(0, 1))
    x = torch.randn(5, 64)
    tok = torch.arange(5)
    with torch.no_grad():
        assert torch.equal(one(x, tok), _layer(None, True)(x, tok))
