"""The KV pool's memory arithmetic (``app.engine.capacity``) with the measurements passed in:
what ``gpu_memory_utilization`` of the card leaves after the weights, the other memory in
use, the activation peak and the CUDA graphs; blocks and max_model_len from a budget; the
total never over the utilization; one config starting on an 80 GB and a 141 GB card."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.cache.manager import CacheManager
from app.config import CacheConfig, EngineConfig, EngineConfigError
from app.engine.capacity import (
    DEFAULT_CPU_KV_BYTES,
    GIB,
    DeviceMemory,
    PoolSize,
    fit_pool,
    kv_budget,
    pool_blocks,
    pool_bytes,
    size_pool,
)
from app.model.config import ModelConfig
from app.model.loader import build_empty_model

G = 1 << 30
# a layout as the arithmetic reads it: 64 positions a block, bytes per block and per slot
LAYOUT = SimpleNamespace(block_size=64, bytes_per_block=56960, bytes_per_slot=3030912)
H100, H200 = int(79.1 * G), int(139.8 * G)  # what mem_get_info reports as total


def _flash(total: int, util: float = 0.9) -> DeviceMemory:
    """One scaled flash rank: 51.6 GiB of weights, 1.4 GiB of context and workspaces."""
    return DeviceMemory(total=total, in_use=int(53.0 * G), weights=int(51.6 * G),
                        activation_peak=int(4.5 * G), graphs=int(0.8 * G),
                        utilization=util)  # fmt: skip


def test_budget_is_the_utilization_of_the_card_less_every_measured_part():
    mem = _flash(H100)
    assert mem.limit == int(0.9 * H100)
    assert mem.kv_budget == int(0.9 * H100) - int(53.0 * G) - int(4.5 * G) - int(0.8 * G)
    assert mem.check_budget() == mem.kv_budget
    # the weights are part of what is in use, not counted twice
    assert replace_weights(mem, 0).kv_budget == mem.kv_budget


def replace_weights(mem: DeviceMemory, weights: int) -> DeviceMemory:
    return DeviceMemory(mem.total, mem.in_use, weights, mem.activation_peak, mem.graphs,
                        mem.utilization)  # fmt: skip


def test_no_budget_left_names_every_part():
    mem = DeviceMemory(total=H100, in_use=int(70 * G), weights=int(68 * G),
                       activation_peak=int(3 * G), graphs=G, utilization=0.9)  # fmt: skip
    assert mem.kv_budget <= 0
    with pytest.raises(EngineConfigError) as e:
        mem.check_budget()
    msg = str(e.value)
    for part in ("gpu_memory_utilization 0.9", "in use 70.00 GiB", "weights 68.00 GiB",
                 "activation peak 3.00 GiB", "CUDA graphs 1.00 GiB", "kv_cache_bytes"):
        assert part in msg, part


def test_pool_bytes_is_the_inverse_of_pool_blocks():
    for budget in (10 * G, 10 * G + 12345, int(13.7 * G)):
        n = pool_blocks(budget, 64, LAYOUT)
        assert pool_bytes(LAYOUT, 64, n) <= budget < pool_bytes(LAYOUT, 64, n + 1)
    with pytest.raises(EngineConfigError, match="holds no block"):
        pool_blocks(65 * LAYOUT.bytes_per_slot, 64, LAYOUT)


def test_fit_pool_caps_max_model_len():
    n, m = fit_pool(10 * G, 64, LAYOUT, 0, 1 << 20)
    assert n == pool_blocks(10 * G, 64, LAYOUT) and m == min(1 << 20, n * 64)
    assert fit_pool(10 * G, 64, LAYOUT, 4096, 1 << 20) == (n, 4096)  # configured
    assert fit_pool(10 * G, 64, LAYOUT, 0, 1 << 20, max_context=300_000) == (n, 300_000)
    small = pool_bytes(LAYOUT, 64, 100)  # one request holds the whole pool at most
    assert fit_pool(small, 64, LAYOUT, 0, 1 << 20) == (100, 6400)


@pytest.mark.parametrize("total", [H100, H200])
def test_one_config_starts_on_an_80_and_a_141_gb_card(total):
    """The same flash-rank config: the pool takes what is left on either card, the total
    stays within the utilization, and the larger card only buys more blocks."""
    mem = _flash(total)
    n, m = fit_pool(mem.check_budget(), 64, LAYOUT, 0, 1 << 20)
    pool = pool_bytes(LAYOUT, 64, n)
    assert mem.total_with(pool) <= mem.limit
    assert m == 1 << 20  # a 1M context fits either pool (890 B a token)
    assert pool / GIB > (60 if total == H200 else 10)


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(16 * G, 200 * G),
    util=st.floats(0.5, 1.0),
    in_use=st.floats(0.01, 0.9),
    act=st.floats(0.0, 0.1),
    graphs=st.floats(0.0, 0.05),
    slots=st.integers(1, 512),
)
def test_the_total_never_exceeds_the_utilization(total, util, in_use, act, graphs, slots):
    mem = DeviceMemory(total, int(in_use * total), int(in_use * total * 0.9),
                       int(act * total), int(graphs * total), util)  # fmt: skip
    try:
        n, _ = fit_pool(mem.check_budget(), slots, LAYOUT, 0, 1 << 20)
    except EngineConfigError:
        assert mem.kv_budget < pool_bytes(LAYOUT, slots, 1)
        return
    assert mem.total_with(pool_bytes(LAYOUT, slots, n)) <= mem.limit


def test_describe_logs_every_part_in_gib():
    mem = _flash(H100)
    size = PoolSize(LAYOUT, 1000, 64000, 0, 0)  # type: ignore[arg-type]
    line = mem.describe(size, 64)
    pool = pool_bytes(LAYOUT, 64, 1000)
    for part in ("weights 51.60 GiB", "activation peak 4.50 GiB", "CUDA graphs 0.80 GiB",
                 f"KV pool {pool / GIB:.2f} GiB (1000 blocks of 64, max_model_len 64000)",
                 f"total {mem.total_with(pool) / GIB:.2f} of {H100 / GIB:.2f} GiB",
                 "gpu_memory_utilization 0.9"):
        assert part in line, part


def test_kv_budget_source(tiny_ckpt):
    path = tiny_ckpt("v41")
    assert kv_budget(EngineConfig.from_options(path, kv_cache_bytes=1 << 24)) == 1 << 24
    assert kv_budget(EngineConfig.from_options(path)) == DEFAULT_CPU_KV_BYTES
    # CUDA without kv_cache_bytes: measured at start-up (builds no device state here)
    assert kv_budget(EngineConfig.from_options(path, device="cuda")) is None
    assert kv_budget(EngineConfig.from_options(path, device="cuda", kv_cache_bytes=5)) == 5


def test_size_pool_with_a_real_layout_and_a_profiled_context(tiny_ckpt):
    path = tiny_ckpt("v41")
    mcfg = ModelConfig.from_file(path)
    model = build_empty_model(mcfg)
    cfg = EngineConfig.from_options(path, max_num_seqs=8)
    lay = CacheManager.layout_for(model, CacheConfig(), torch.float32)
    budget = pool_bytes(lay, 8, 500)
    size = size_pool(cfg, model, budget)
    assert size.num_blocks == 500 and size.pool_bytes(8) == budget
    assert size.max_model_len == min(mcfg.max_position_embeddings, 500 * lay.block_size)
    capped = size_pool(cfg, model, budget, max_context=1000)
    assert capped.max_model_len == 1000 and capped.num_blocks == 500
