"""PD transfer on two GPUs: rank 0 = the prefill engine on cuda:0, rank 1 = the
decode engine on cuda:1, one process each; a request's exported decode state
(``HandoffPort.export`` -> ``DecodeState`` / ``KVState``) goes over NCCL (its tensors as bytes, one
batched send / receive) and the decode side imports it (``add_handoff``) and decodes.

    engine   the tiny V4.1 checkpoint, a ``--prompt-tokens`` request (32K on the GPUs): the
             decode side's greedy tokens against the colocated engine's for the same prompt
             (``pd.tokens_equal``); TTFT of the PD request (prefill + first token on GPU0,
             export, transfer, import, first decode step on GPU1) against the colocated one
             (prefill + first token on one GPU) (``pd.ttft``; ``pd.second_token``: the
             colocated engine's second token, the same work as the PD request's first
             decoded one); the state's bytes (``pd.state_bytes``)
    scaled   a 32K-token state of the scaled V4.1-Flash rank's cache layout (40 layers,
             released formats: fp8 window, nvfp4 entries, mxfp4 index keys), synthesized:
             random rows in a real ``PagedKVCache``, exported with ``app.cache.transfer
             .gather``, imported with ``scatter``; by the layouts, the tiny model's 32K state
             is 18.9 MB (fp32 rows), the scaled rank's 31.9 MB (29.2 MB of 512 blocks)
    both     the transfer, repeated (``pd.transfer``: per tensor, and one flat buffer),
             against a plain device-to-device copy of the same bytes in the same run, rank
             0 alone with GPU 1 idle (``pd.copy``; ``floor`` of ``pd.transfer``)

    PYTHONPATH=. python -m bench.pd_transfer --out DIR                 # two GPUs, NCCL
    PYTHONPATH=. python -m bench.pd_transfer --cpu-smoke --out DIR     # two CPU processes

Transfer times span the two processes on one host clock (CLOCK_MONOTONIC): from rank 0's
send (its device idle, the receives already posted) to rank 1 holding every byte (its
device synchronized). Records go to ``DIR/pd_transfer.json`` as they are measured.
No Ray, no pydantic (torch 2.11 + triton 3.6 on the GPU machine).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.cache.kv_cache import PagedKVCache
from app.cache.layout import CacheLayout, block_size_for
from app.cache.transfer import LayoutHeader, _storage, gather, scatter
from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.handoff import DecodeState, Handoff
from app.engine.request import EngineRequest, FinishReason, SamplingParams
from bench.common import record
from bench.gang import Gang, chosen_parts, failure, median, now, part_worker, run

GPU = {"prompt_tokens": 32768, "max_tokens": 8, "reps": 3, "chunk": 8192, "kv_bytes": 1 << 30,
       "copy_reps": 20, "scaled_tokens": 32768}  # fmt: skip
SMOKE = {"prompt_tokens": 150, "max_tokens": 4, "reps": 1, "chunk": 64, "kv_bytes": 1 << 24,
         "copy_reps": 3, "scaled_tokens": 256}  # fmt: skip
PREFILL, DECODE = 0, 1


# ---- the wire: a state's skeleton as an object, its tensors as bytes -----------------------
def _tensors(state: DecodeState) -> list[torch.Tensor]:
    ts = list(state.kv.tensors.values())
    return ts + ([state.draft_logits] if state.draft_logits is not None else [])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 view (NCCL and gloo move any dtype this way)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _wire_bytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _p2p(op, ts: list[torch.Tensor], peer: int) -> None:
    ops = [dist.P2POp(op, _flat(t), peer) for t in ts if t.numel()]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


def send_state(state: DecodeState, extra: dict) -> None:
    """Prefill side: the skeleton (shapes and dtypes in place of tensors) and ``extra``, then
    every tensor."""
    skeleton = state.map_tensors(lambda t: (tuple(t.shape), t.dtype))
    dist.send_object_list([skeleton, extra], dst=DECODE)
    _p2p(dist.isend, _tensors(state), DECODE)


def recv_state(dev: torch.device) -> tuple[DecodeState, dict, float]:
    """Decode side: -> (the state, its tensors on ``dev``; ``extra``; the host time when
    every byte is here)."""
    got: list[Any] = [None, None]
    dist.recv_object_list(got, src=PREFILL)
    skeleton, extra = got
    if skeleton is None:  # the prefill side failed before its send
        raise RuntimeError(f"no state from the prefill rank: {extra['error']}")
    state = skeleton.map_tensors(lambda s: torch.empty(s[0], dtype=s[1], device=dev))
    _p2p(dist.irecv, _tensors(state), PREFILL)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return state, extra, now()


def _checksum(t: torch.Tensor) -> int:
    """Position-weighted sum of ``t``'s bytes (a reordered or truncated copy differs)."""
    b = _flat(t).to(torch.int64)
    return int((b * (torch.arange(b.numel(), device=b.device) % 251 + 1)).sum())


def _transfer_times(gang: Gang, key: str, ts: list[torch.Tensor], reps: int) -> list[float]:
    """The tensors ``ts`` (rank 0's; rank 1 passes buffers of the same shapes) moved rank 0
    -> rank 1, ``reps`` times after one warm-up; rank 1 returns the seconds of each.

    Rank 1 posts its receives, then tells rank 0 (through the store) to start: the time
    is the transfer, not rank 1's lateness. Not so in the warm-up: posting can block on
    the host while NCCL connects the pair for this exchange's channels, and that needs
    rank 0's sends."""
    times = []
    for j in range(reps + 1):
        if gang.rank == PREFILL:
            gang.store.wait([f"{key}.ready.{j}"])
            gang.sync()
            t0 = now()
            _p2p(dist.isend, ts, DECODE)
            gang.sync()
            gang.store.set(f"{key}.t0.{j}", repr(t0))
        else:
            if not j:  # the warm-up: both sides at once (a first exchange may connect)
                gang.store.set(f"{key}.ready.{j}", "1")
            ops = [dist.P2POp(dist.irecv, _flat(t), PREFILL) for t in ts if t.numel()]
            works = dist.batch_isend_irecv(ops) if ops else []  # then: posted first
            if j:
                gang.store.set(f"{key}.ready.{j}", "1")
            for w in works:
                w.wait()
            gang.sync()
            t1 = now()
            if j:
                times.append(t1 - float(gang.store.get(f"{key}.t0.{j}").decode()))
    return times


def _copy_times(gang: Gang, ts: list[torch.Tensor], reps: int) -> dict[str, list[float]]:
    """Rank 0 alone (rank 1 waits, its GPU idle): the same bytes to the decode GPU by plain
    device-to-device copies, tensor by tensor (``.to``, as a one-process transport would)
    and as one flat buffer; seconds each."""
    dev = gang.device
    peer = torch.device("cuda", DECODE) if dev.type == "cuda" else dev

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.synchronize(peer)

    flat = torch.cat([_flat(t) for t in ts]) if ts else torch.empty(0, dtype=torch.uint8)
    dst = torch.empty_like(flat, device=peer)
    res: dict[str, list[float]] = {"d2d_per_tensor": [], "d2d_flat": []}
    for j in range(reps + 1):
        for name, fn in (("d2d_per_tensor", lambda: [t.to(peer, copy=True) for t in ts]),
                         ("d2d_flat", lambda: dst.copy_(flat))):  # fmt: skip
            sync()
            t = now()
            fn()
            sync()
            if j:
                res[name].append(now() - t)
    assert torch.equal(dst.to(dev), flat)
    return res


def _bandwidth_records(gang: Gang, source: str, ts: list[torch.Tensor], reps: int, out) -> None:
    """``pd.transfer`` (per tensor, one flat buffer) against ``pd.copy`` of the same bytes."""
    n = _wire_bytes(ts)
    per = _transfer_times(gang, f"{source}.tensors", ts, reps)
    flat = (torch.cat([_flat(t) for t in ts]) if gang.rank == PREFILL
            else torch.empty(n, dtype=torch.uint8, device=gang.device))  # fmt: skip
    one = _transfer_times(gang, f"{source}.flat", [flat], reps)
    del flat
    gang.barrier()
    if gang.rank == DECODE:
        gang.store.wait([f"{source}.copied"])
        dist.send_object_list([{"p2p_per_tensor": per, "p2p_flat": one}], dst=PREFILL)
        return
    copies = _copy_times(gang, ts, reps)
    gang.store.set(f"{source}.copied", "1")
    got: list[Any] = [None]
    dist.recv_object_list(got, src=DECODE)
    base = {"source": source, "bytes": n, "tensors": len(ts), "reps": reps,
            "backend": gang.backend}  # fmt: skip
    floor = {}
    for method, vals in copies.items():
        us = median(vals) * 1e6
        floor[method] = us
        out(record("pd.copy", us, "us", {**base, "method": method, "gbps": n / us / 1e3,
                                         "path": _path(gang)}))  # fmt: skip
    for method, vals in got[0].items():
        us = median(vals) * 1e6
        like = floor[method.replace("p2p", "d2d")]
        out(record("pd.transfer", us, "us", {**base, "method": method, "gbps": n / us / 1e3,
                                             "per_rep_us": [v * 1e6 for v in vals]},
                   floor=like))  # fmt: skip


def _path(gang: Gang) -> str:
    return "cuda:0 -> cuda:1" if gang.device.type == "cuda" else "cpu"


# ---- the engine: a PD request against a colocated one --------------------------------------
def _engine(opts: dict, gang: Gang) -> EngineCore:
    s = opts["shape"]
    cfg = EngineConfig.from_options(
        opts["ckpt"], device=str(gang.device), kv_cache_bytes=s["kv_bytes"], max_num_seqs=4,
        max_num_batched_tokens=s["chunk"],
    )  # fmt: skip
    return EngineCore(cfg)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return (0, *torch.randint(3, 500, (n - 1,), generator=g).tolist())


def _colocated(core: EngineCore, req: EngineRequest) -> dict:
    """Prefill + decode on one engine: tokens, seconds to the first and second token."""
    t0, times, toks = now(), [], []
    core.add_request(req)
    while core.has_unfinished:
        for o in core.step():
            toks += o.token_ids
            times += [now()] * len(o.token_ids)
    return {"tokens": toks, "ttft_s": times[0] - t0, "second_s": times[1] - t0}


def _prefill_side(
    core: EngineCore, req: EngineRequest, colocated: list[int], sent: list[bool]
) -> dict:
    """Prefill with export, send the state (the colocated tokens ride along for the decode
    side's check); host times of each point. ``sent[0]``: the decode side has its state."""
    t0 = now()
    core.add_request(req, export=True)
    out = None
    while out is None:
        if not core.has_unfinished:
            raise RuntimeError(f"request {req.request_id} ended without a handoff")
        out = next((o for o in core.step() if o.finish_reason is FinishReason.HANDOFF), None)
    t_out = now()
    state = out.handoff
    if not isinstance(state, DecodeState):
        raise RuntimeError(f"request {req.request_id}: the export failed")
    state.wait_ready()
    t_ready = now()
    sent[0] = True
    send_state(state, {"t0": t0, "t_ready": t_ready, "output_ids": tuple(out.token_ids),
                       "colocated": colocated})  # fmt: skip
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)
    t_sent = now()
    while core.has_unfinished:  # the step already in flight (overlap)
        core.step()
    return {"t0": t0, "t_out": t_out, "t_ready": t_ready, "t_sent": t_sent, "state": state}


def _decode_side(core: EngineCore, req: EngineRequest, dev: torch.device) -> dict:
    state, extra, t_recv = recv_state(dev)
    why = core.add_handoff(req, Handoff(extra["output_ids"], state))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_import = now()
    toks, t_first = list(extra["output_ids"]), None
    while core.has_unfinished:
        for o in core.step():
            if o.token_ids and t_first is None:
                t_first = now()
            toks += o.token_ids
    ts = _tensors(state)
    return {"why": why, "tokens": toks, "equal": toks == list(extra["colocated"]),
            "t0": extra["t0"], "t_ready": extra["t_ready"], "t_recv": t_recv,
            "t_import": t_import, "t_first": t_first, "bytes": _wire_bytes(ts),
            "nbytes": state.nbytes, "tensors": len(ts), "num_blocks": state.kv.num_blocks,
            "shapes": [(tuple(t.shape), t.dtype) for t in ts]}  # fmt: skip


def engine_case(gang: Gang, opts: dict, out) -> None:
    s, rank, dev = opts["shape"], gang.rank, gang.device
    n, m = s["prompt_tokens"], s["max_tokens"]
    params = {"source": "tiny_v41_engine", "prompt_tokens": n, "max_tokens": m,
              "chunk": s["chunk"], "backend": gang.backend}  # fmt: skip
    ok = True
    try:
        engines = ([_engine(opts, gang), _engine(opts, gang)] if rank == PREFILL
                   else [_engine(opts, gang)])  # fmt: skip
    except Exception as e:
        out(failure("pd.engine", params, e, rank))
        ok = False
    if not all(gang.gather(ok)):
        return
    params = {**params, "max_model_len": engines[0].max_model_len}
    rows, state = [], None
    for rep in range(s["reps"] + 1):  # rep 0 warms the kernels up (not in the medians)
        greedy = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        req = EngineRequest(f"pd{rep}", _prompt(n, rep), greedy)
        mine: dict[str, Any] = {}
        sent = [False]
        try:
            gang.barrier()
            if rank == PREFILL:
                colo = _colocated(engines[1], req)
                gang.sync()
                side = _prefill_side(engines[0], req, colo["tokens"], sent)
                state = side.pop("state")
                mine = {**side, "colocated": colo}
            else:
                mine = _decode_side(engines[0], req, dev)
        except Exception as e:
            out(failure("pd.engine", {**params, "rep": rep}, e, rank))
            mine = {"error": repr(e)}
            if rank == PREFILL and not sent[0]:  # rank 1 waits for a state: release it
                dist.send_object_list([None, {"error": repr(e)}], dst=DECODE)
        got = gang.gather(mine)
        if rank == PREFILL and not any("error" in g for g in got):
            rows.append(got)
            p0, p1 = got
            out(record("pd.tokens_equal", float(p1["equal"] and p1["why"] is None), "bool",
                       {**params, "rep": rep, "warmup": rep == 0, "installed": p1["why"] is None,
                        "pd_tokens": p1["tokens"], "colocated_tokens":
                        p0["colocated"]["tokens"]}))  # fmt: skip
    if rank == PREFILL and rows:
        p1 = rows[-1][1]
        out(record("pd.state_bytes", float(p1["bytes"]), "bytes",  # received on the decode side
                   {**params, "nbytes_state": state.nbytes, "nbytes_imported": p1["nbytes"],
                    "tensors": p1["tensors"], "num_blocks": p1["num_blocks"]}))  # fmt: skip
        _ttft_records(rows[1:] or rows, params, out)
    # the repeated transfer of the last state (rank 1: buffers of its shapes)
    shapes = gang.gather(rows[-1][1]["shapes"] if rank == PREFILL and rows else None)[0]
    if shapes is None:
        return
    ts = (_tensors(state) if rank == PREFILL
          else [torch.empty(sh, dtype=dt, device=dev) for sh, dt in shapes])  # fmt: skip
    _bandwidth_records(gang, "tiny_v41_engine", ts, s["copy_reps"], out)
    del engines, state, ts
    gc.collect()


def _ttft_records(rows: list[list[dict]], params: dict, out) -> None:
    def col(f) -> list[float]:
        return [f(p0, p1) for p0, p1 in rows]

    colo = col(lambda p0, p1: p0["colocated"]["ttft_s"])
    second = col(lambda p0, p1: p0["colocated"]["second_s"])
    pd = col(lambda p0, p1: p1["t_first"] - p0["t0"])
    phases = {
        "prefill_s": col(lambda p0, p1: p0["t_out"] - p0["t0"]),  # to the first token
        "export_wait_s": col(lambda p0, p1: p0["t_ready"] - p0["t_out"]),
        "transfer_s": col(lambda p0, p1: p1["t_recv"] - p0["t_ready"]),  # skeleton + bytes
        "import_s": col(lambda p0, p1: p1["t_import"] - p1["t_recv"]),
        "first_decode_s": col(lambda p0, p1: p1["t_first"] - p1["t_import"]),
    }
    n = len(rows)
    out(record("pd.ttft", median(colo), "s",
               {**params, "mode": "colocated", "reps": n, "per_rep": colo}))  # fmt: skip
    out(record("pd.ttft", median(pd), "s",
               {**params, "mode": "pd", "reps": n, "per_rep": pd, "colocated_s": median(colo),
                **{k: median(v) for k, v in phases.items()}}))  # fmt: skip
    out(record("pd.second_token", median(second), "s",
               {**params, "mode": "colocated", "reps": n, "per_rep": second,
                "pd_first_decoded_s": median(pd)}))  # fmt: skip


# ---- a 32K-token state of the scaled V4.1-Flash rank ---------------------------------------
def _scaled_cache(tokens: int, dev: torch.device) -> tuple[CacheLayout, PagedKVCache, int]:
    from bench.flash_rank import flash_config

    cfg = flash_config()
    layout = CacheLayout.build(cfg, block_size_for(cfg), torch.bfloat16, kv_quant=True)
    blocks = math.ceil(tokens / layout.block_size)
    return layout, PagedKVCache(layout, blocks, 1, dev), blocks


def scaled_case(gang: Gang, opts: dict, out) -> None:
    s, rank, dev = opts["shape"], gang.rank, gang.device
    n = s["scaled_tokens"]
    params = {"source": "scaled_v41_flash_synthetic", "prompt_tokens": n, "layers": 40,
              "formats": "fp8 window, nvfp4 entries, mxfp4 keys", "speculation": "off",
              "backend": gang.backend}  # fmt: skip
    layout, cache, blocks = _scaled_cache(n, dev)
    header = LayoutHeader.of(layout, "scaled-v41-flash (synthetic rows)")
    ids = list(range(blocks))
    exports: list[float] = []
    imports: list[float] = []
    mine: dict[str, Any] = {}
    if rank == PREFILL:
        g = torch.Generator(device=dev).manual_seed(3)
        for _, _, t in _storage(cache.pools, layout):
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, device=dev, dtype=torch.uint8))
        for _ in range(s["copy_reps"] + 1):
            gang.sync()
            t = now()
            kv = gather(cache.pools, layout, header, 0, ids, n)
            gang.sync()
            exports.append(now() - t)
        state = DecodeState("scaled", (0,), kv)
        sums = [_checksum(t) for t in _tensors(state)]
        send_state(state, {"checksums": sums})
        ts = _tensors(state)
    else:
        state, extra, _ = recv_state(dev)
        for _ in range(s["copy_reps"] + 1):
            gang.sync()
            t = now()
            scatter(cache.pools, layout, state.kv, 0, ids)
            gang.sync()
            imports.append(now() - t)
        back = gather(cache.pools, layout, header, 0, ids, n)  # the rows as stored there
        same = [_checksum(t) for t in _tensors(DecodeState("scaled", (0,), back))]
        ts = _tensors(state)
        mine = {"equal": same == extra["checksums"], "bytes": _wire_bytes(ts),
                "nbytes": state.nbytes, "tensors": len(ts), "import_s": imports[1:]}  # fmt: skip
    got = gang.gather(mine if rank == DECODE else {"export_s": exports[1:]})
    if rank == PREFILL:
        p1 = got[1]
        p = {**params, "num_blocks": blocks, "block_size": layout.block_size}
        out(record("pd.state_bytes", float(p1["bytes"]), "bytes",
                   {**p, "nbytes_state": state.nbytes, "nbytes_imported": p1["nbytes"],
                    "tensors": p1["tensors"],
                    "bytes_per_token_paged": layout.bytes_per_token}))  # fmt: skip
        out(record("pd.scaled_roundtrip_equal", float(p1["equal"]), "bool", p))
        out(record("pd.export", median(exports[1:]) * 1e6, "us",
                   {**p, "what": "transfer.gather out of the prefill pools"}))  # fmt: skip
        out(record("pd.import", median(p1["import_s"]) * 1e6, "us",
                   {**p, "what": "transfer.scatter into the decode pools"}))  # fmt: skip
    _bandwidth_records(gang, "scaled_v41_flash_synthetic", ts, s["copy_reps"], out)


# ---- driver -------------------------------------------------------------------------------
PARTS = {"engine": engine_case, "scaled": scaled_case}
worker = functools.partial(part_worker, parts=PARTS, prefix="pd", file="pd_transfer.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for pd_transfer.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, short prompts")
    ap.add_argument("--parts", default="engine,scaled", help="which: engine, scaled")
    ap.add_argument("--prompt-tokens", type=int, help="the engine request's prompt length")
    ap.add_argument("--reps", type=int, help="timed PD / colocated requests (after a warm-up)")
    ap.add_argument("--timeout-s", type=int, default=300, help="a hung collective ends here")
    args = ap.parse_args(argv)
    out_dir, parts = chosen_parts(ap, args, PARTS)
    shape = dict(SMOKE if args.cpu_smoke else GPU)
    for k in ("prompt_tokens", "reps"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    with tempfile.TemporaryDirectory(prefix="fathom-pd-transfer-") as tmp:
        ckpt = None
        if "engine" in parts:
            from app.model.tiny import make_tiny_checkpoint

            ckpt = str(make_tiny_checkpoint(Path(tmp) / "v41", arch="v41", seed=0))
        opts = {"smoke": args.cpu_smoke, "out": str(out_dir), "parts": parts, "ckpt": ckpt,
                "shape": shape, "timeout_s": args.timeout_s, "args": vars(args)}  # fmt: skip
        run(worker, opts, out_dir / "pd_transfer.json")


if __name__ == "__main__":
    main()
