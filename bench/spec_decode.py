"""W8 speculative decoding on the scaled V4.1-Flash rank (PERFORMANCE.md W8,
``bench.flash_rank``): DSpark draft and verify step times, and the effective TPOT.

    python -m bench.spec_decode [--batches 1,8,32] [--context 4096] [--drafts 3]
        [--what steps,engine] [--model flash-rank|tiny-rank]

- steps (``spec.*_step``): B requests at context L. The plain decode step (CUDA graph), the
  verify step of 1 + k tokens per request as a CUDA graph (without and with the DSpark
  target features: the engine's) and eagerly with the features, the DSpark draft (the
  context of the k + 1 committed rows, then one block per request: 3 stages + heads) eagerly
  (``spec.draft_step``, ``cuda_graph`` false: drafter calls as before the draft graphs) and
  as the engine's draft step replays it (``app.engine.spec.graphs``, ``cuda_graph`` true:
  the host inputs' copy, the step's tokens / accept flags / features copied in, the graph;
  peer: the eager time), and the whole speculative step (``spec.step``): the verify graph
  with features, the greedy sample, the draft, eager or its graph replayed right after
  (peer: the plain decode step, ``ratio_to_plain_decode``). Each is timed with CUDA events
  (median) beside its byte floor (bytes / measured copy bandwidth; ``floor_kind`` and the
  ``card`` in the params). The effective TPOT at acceptance length AL is the speculative
  step over AL (W8's bound; ``step``: with the draft graph or the eager draft), its floor
  the draft's and the verify's over AL.
- engine (``spec.engine_tpot``): the EngineCore on the same rank model decoding B requests
  (prompt 1024, 64 tokens, greedy) plain and with speculation whose drafts come from the
  oracle proposer (the target's own continuation, each draft right with probability r, set
  for AL 2.5 and 3.5 at k = 3): the measured time per output token after the prefill, with
  the DSpark draft graph's time of ``steps`` added per verify (the oracle drafts on the
  host, so its own time is not the drafter's; its host read of the anchors is a sync the
  DSpark proposer does not make, left in).

Random weights: acceptance is set by the oracle, not measured from DSpark.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.graphs import CudaGraphRunner
from app.engine.request import EngineRequest, SamplingParams
from app.engine.runner import StepInputs
from app.engine.sampler import PickKind, proposal_arrays, to_device
from app.engine.spec.graphs import DraftGraphs
from app.engine.spec.proposer import DSparkProposer
from app.engine.spec.step import REQ_ROWS, DraftInputs
from app.model.config import ModelConfig
from app.model.dspark import DSparkDrafter
from bench.common import record, write
from bench.engine_steps import Rank, _time, copy_bandwidth
from bench.flash_rank import decode_bytes, expected_experts
from bench.proposers import OracleProposer


def accept_rate_for(al: float, k: int) -> float:
    """Per-draft acceptance r with 1 + r + ... + r^k = ``al`` (drafts independent, the first
    rejection ends the run; the bonus makes it k + 1 when all are right)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in range(k + 1)) < al else (lo, mid)
    return (lo + hi) / 2


def draft_bytes(model, batch: int, k: int) -> float:
    """Bytes a DSpark draft must read: the stages' dense weights, the local experts their
    block rows touch (B x block rows), the head over the block rows and the
    Markov head (read whole), the context rings (W rows per request per stage), and the
    context writes of k + 1 rows."""
    cfg = model.cfg
    dense = experts = 0.0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith("mtp."):
            continue
        if ".experts." in name or "markov_head.embed" in name:
            continue  # touched experts below; the Markov embedding is a row lookup
        dense += t.numel() * t.element_size()
    pe = model.mtp[0].ffn.experts
    per_expert = sum(b.numel() * b.element_size() for b in (pe.w13, pe.s13, pe.w2, pe.s2))
    per_expert /= pe.n_local
    rows = batch * cfg.dspark_block_size
    touched = expected_experts(pe.n_local, cfg.dspark_n_routed_experts,
                               cfg.dspark_num_experts_per_tok, rows)  # fmt: skip
    experts = len(model.mtp) * touched * per_expert
    head = model.head.weight.numel() * model.head.weight.element_size()
    ring = len(model.mtp) * batch * (cfg.sliding_window + k + 1) * (cfg.head_dim + 16)
    return dense + experts + head + ring


def step_inputs(slots: np.ndarray, start: int, k: int, vocab: int) -> DraftInputs:
    """The draft step's host inputs after a verify step of ``k`` drafts per request
    (``slots``), every chunk at positions ``start`` .. ``start + k``, greedy draws: what
    ``Speculator.draft_inputs`` gives for such a step."""
    B, q = slots.size, k + 1
    ints, floats = proposal_arrays([SamplingParams(temperature=0)] * B, vocab)
    bases = np.arange(B, dtype=np.int64) * q
    cols = {"slots": slots, "starts": np.full(B, start), "bases": bases,
            "counts": np.full(B, q), "first_output": np.full(B, 2), "anchor_rows": bases}
    req = np.stack([cols[f] for f in REQ_ROWS[:6]] + list(ints)).astype(np.int64)
    ctx = np.stack((np.tile(start + np.arange(q), B), np.repeat(slots, q),
                    np.repeat(np.arange(B), q), np.zeros(B * q, np.int64),
                    np.full(B * q, -1))).astype(np.int64)  # fmt: skip
    return DraftInputs(req, floats, ctx, B * q, PickKind())


def draft_times(
    rank: Rank, B: int, args, drafter: DSparkDrafter, graphs: DraftGraphs,
    verify: CudaGraphRunner | None,
) -> dict[str, float]:  # fmt: skip
    """Seconds of B requests' draft (the context of the k + 1 committed rows, then one block
    per request) eagerly and as the draft step's graph, of the verify graph that returns the
    features, and of the whole speculative step as the engine runs it: that verify graph,
    the greedy sample, the draft (eager, or its graph replayed right after)."""
    k, ctx, dev, rings = args.drafts, args.context, rank.device, rank.mgr.pools.draft
    q, taps = k + 1, graphs.proposer.feature_width
    rids = rank.requests(B, ctx, q)
    spec = rank.spec(rids, ctx, q)
    slot_np = spec.slots.astype(np.int64)
    slots = torch.from_numpy(slot_np).to(dev)
    anchors = torch.full((B,), ctx + k, dtype=torch.int64, device=dev)
    bonus = torch.full((B,), 11, dtype=torch.int64, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    feats = torch.randn(B * q, taps, generator=g, device=dev).to(graphs.dtype)
    cslots = slots.repeat_interleave(q)
    cpos = (ctx + torch.arange(q, device=dev)).repeat(B)
    dinp = step_inputs(slot_np, ctx, k, rank.model.cfg.vocab_size)
    tokens = torch.full((B * q,), 11, dtype=torch.int64, device=dev)
    accepted = torch.arange(B * q, device=dev) % q < 2  # m = 2 for every request
    feat_rows = np.arange(B * q, dtype=np.int64)

    def draft_eager(f: torch.Tensor = feats) -> None:
        with torch.inference_mode():
            drafter.write_context(rings, cslots, f, cpos)
            drafter.draft(rings, slots, anchors, bonus, k)

    def draft_graph(f: torch.Tensor = feats, t: torch.Tensor = tokens) -> None:
        graphs.run(dinp, t, accepted, f)

    def verified() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            if verify is None:  # CPU smoke run: eager
                rank.runner.features = True
                inp = StepInputs([], spec, [], feat_rows=feat_rows)
                logits, f = rank.runner.forward_with_features(inp)
                rank.runner.features = False
                return logits.argmax(-1), f
            logits, f = verify.run(spec, rank.runner.sampled)
            return logits[: B * q].argmax(-1), f[to_device(feat_rows, dev)]

    def step_eager() -> None:
        draft_eager(verified()[1])

    def step_graph() -> None:
        t, f = verified()
        draft_graph(f, t)

    out = {"draft": _time(draft_eager, args.reps), "draft_graph": _time(draft_graph, args.reps),
           "verify_graph_features": _time(verified, args.reps),
           "step_eager": _time(step_eager, args.reps), "step_graph": _time(step_graph, args.reps)}
    rank.free(rids)
    return out


def steps(rank: Rank, args, bw: float) -> tuple[list[dict], dict[int, float]]:
    """The ``steps`` part (module doc): per batch, the step times and their records."""
    model, k, ctx, dev = rank.model, args.drafts, args.context, rank.device
    q = k + 1
    drafter = DSparkDrafter(model)
    max_seqs = rank.mgr.kv.max_slots
    graphs = DraftGraphs(DSparkProposer(model, rank.mgr.pools), k, max_seqs,
                         rank.mgr.pools.trash_slot, dev, rank.mgr.layout.dtype)  # fmt: skip
    verify = None  # the engine's verify graphs: they return the features too
    if rank.runner.graphs is not None:
        pool = rank.runner.graphs.pool
        graphs.use_pool(pool)
        verify = CudaGraphRunner(model, rank.runner.builder, max_seqs, True, q)
        verify.pool = pool  # one pool, as in the engine
    else:  # CPU smoke run: the graphs' padded buffers, eagerly
        graphs.pad = True
    records, t_draft = [], {}
    card = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"{'B':>4} {'decode':>8} {'verify g':>8} {'ver g+f':>8} {'verify e':>8} "
          f"{'draft e':>7} {'draft g':>7} {'step e':>7} {'step g':>7} | {'dec fl':>7} "
          f"{'ver fl':>7} {'dr fl':>7} | TPOT_eff AL 2.5 / 3.5 (ms; floor)",
          flush=True)  # fmt: skip
    for B in (int(b) for b in args.batches.split(",")):
        res = {}
        for name, qq, graph in (("decode", 1, True), ("verify_graph", q, True),
                                ("verify_eager_features", q, False)):  # fmt: skip
            rids = rank.requests(B, ctx, qq)
            spec = rank.spec(rids, ctx, qq)
            inp = StepInputs([], spec, [], graph=graph and rank.runner.graphs is not None)
            if name == "verify_eager_features":
                rank.runner.features = True
                inp.feat_rows, inp.feat_pos, inp.feat_item = rank.runner._feature_rows(
                    spec.starts, spec.lens, spec.decoder_floors
                )

            def step(inp=inp):
                with torch.inference_mode():
                    logits, _ = rank.runner.forward_with_features(inp)
                    logits.argmax(-1)

            res[name] = _time(step, args.reps)
            rank.runner.features = False
            rank.free(rids)
        res.update(draft_times(rank, B, args, drafter, graphs, verify))
        t_draft[B] = res["draft_graph"]
        fl = {
            "decode": decode_bytes(model, B, ctx, 1).total / bw,
            "verify": decode_bytes(model, B, ctx, q).total / bw,
            "draft": draft_bytes(model, B, k) / bw,
        }
        p = {"batch": B, "context": ctx, "drafts": k, "ep": rank.ep, "card": card,
             "floor_kind": "bytes / copy bandwidth"}  # fmt: skip
        dec = {"plain_decode_ms": res["decode"] * 1e3}
        records += [
            record("spec.decode_step", res["decode"] * 1e3, "ms", dict(p, cuda_graph=True),
                   floor=fl["decode"] * 1e3),
            record("spec.verify_step", res["verify_graph"] * 1e3, "ms",
                   dict(p, cuda_graph=True, features=False), floor=fl["verify"] * 1e3),
            record("spec.verify_step", res["verify_graph_features"] * 1e3, "ms",
                   dict(p, cuda_graph=True, features=True), floor=fl["verify"] * 1e3),
            record("spec.verify_step", res["verify_eager_features"] * 1e3, "ms",
                   dict(p, cuda_graph=False, features=True), floor=fl["verify"] * 1e3),
            record("spec.draft_step", res["draft"] * 1e3, "ms", dict(p, cuda_graph=False),
                   floor=fl["draft"] * 1e3),
            record("spec.draft_step", res["draft_graph"] * 1e3, "ms", dict(p, cuda_graph=True),
                   floor=fl["draft"] * 1e3,
                   peer={"eager_ms": res["draft"] * 1e3,
                         "speedup": res["draft"] / res["draft_graph"]}),
        ]  # fmt: skip
        for tag, graph in (("step_eager", False), ("step_graph", True)):
            records.append(record(
                "spec.step", res[tag] * 1e3, "ms", dict(p, cuda_graph_draft=graph,
                                                        verify="graph, features"),
                floor=(fl["draft"] + fl["verify"]) * 1e3,
                peer={**dec, "ratio_to_plain_decode": res[tag] / res["decode"]},
            ))  # fmt: skip
        cells = []
        for al in (2.5, 3.5):
            floor = (fl["draft"] + fl["verify"]) / al
            for tag in ("step_graph", "step_eager"):
                records.append(record("spec.tpot_eff", res[tag] / al * 1e3, "ms",
                                      dict(p, accept_length=al, step=tag),
                                      floor=floor * 1e3, peer=dec))  # fmt: skip
            cells.append(f"{res['step_graph'] / al * 1e3:.2f}g/"
                         f"{res['step_eager'] / al * 1e3:.2f}e ({floor * 1e3:.2f})")
        ms = {key: v * 1e3 for key, v in res.items()}
        print(f"{B:>4} {ms['decode']:8.2f} {ms['verify_graph']:8.2f} "
              f"{ms['verify_graph_features']:8.2f} {ms['verify_eager_features']:8.2f} "
              f"{ms['draft']:7.2f} {ms['draft_graph']:7.2f} {ms['step_eager']:7.2f} "
              f"{ms['step_graph']:7.2f} | {fl['decode'] * 1e3:7.2f} {fl['verify'] * 1e3:7.2f} "
              f"{fl['draft'] * 1e3:7.2f} | {'  '.join(cells)}", flush=True)  # fmt: skip
    print(f"draft graphs: {graphs.captures} captured", flush=True)
    return records, t_draft


def _engine_run(model, B: int, k: int, prompts, truth, rate: float | None, device: str,
                dtype: str = "bfloat16", path: str | None = None):
    """Decode ``prompts`` (64 tokens each, greedy) with ``model`` (or the checkpoint at
    ``path``); -> (outputs, s per output token after the prefill, the stats report)."""
    opts = dict(device=device, dtype=dtype, max_num_seqs=B, max_num_batched_tokens=4096,
                max_model_len=4096, enable_prefix_caching=False)  # fmt: skip
    proposer = None
    if rate is not None:
        opts["speculative"] = {"method": "dspark", "num_draft_tokens": k}
        vocab = (ModelConfig.from_file(path) if model is None else model.cfg).vocab_size
        proposer = OracleProposer(truth, vocab, accept_rate=rate, seed=B)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig.from_options(path or tmp, **opts)
        eng = EngineCore(cfg, model=model, proposer=proposer)
        outs = {f"s{i}": [] for i in range(B)}
        for i, p in enumerate(prompts):
            eng.add_request(EngineRequest(f"s{i}", tuple(p), params))
        while not all(outs.values()):  # the prefill (and each request's first token)
            for o in eng.step():
                outs[o.request_id] += o.token_ids
        if device == "cuda":
            torch.cuda.synchronize()
        n0 = sum(len(v) for v in outs.values())
        t0 = time.perf_counter()
        while eng.has_unfinished:
            for o in eng.step():
                outs[o.request_id] += o.token_ids
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        per_req = (sum(len(v) for v in outs.values()) - n0) / B
        rep = eng.stats.report()
        eng.close()
    return outs, wall / per_req, rep


def engine(rank: Rank, args, t_draft: dict[int, float]) -> list[dict]:
    """The EngineCore with the oracle proposer. ``--engine-model tiny`` (default): the tiny
    V4.1 checkpoint in fp32, where greedy tokens do not depend on the step's shape, so the
    oracle's truth (the plain run) stays the target's continuation; the draft time added is
    the flash rank's. ``flash-rank``: the rank model in bf16, whose random weights give
    near-uniform logits over 129k tokens: outputs part at near ties (seen: 6% equal)."""
    k, records = args.drafts, []
    g = torch.Generator().manual_seed(0)
    model, path, dtype, plen = rank.model, None, "bfloat16", 1024
    tmp = None
    if args.engine_model == "tiny":
        from app.model.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory()
        path = tmp.name
        make_tiny_checkpoint(Path(path), arch="v41", seed=0)
        model, dtype, plen = None, "float32", 64
    V = (ModelConfig.from_file(path) if path else model.cfg).vocab_size
    print(f"{'B':>4} {'plain TPOT':>10} | per AL target: r, AL got, TPOT verify-only, "
          "+ draft (ms), speedup, share of tokens equal to plain", flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        prompts = [torch.randint(3, V - 1, (plen,), generator=g).tolist() for _ in range(B)]
        plain, t_plain, _ = _engine_run(model, B, k, prompts, None, None, args.device, dtype,
                                        path)  # fmt: skip
        truth = {f"s{i}": prompts[i] + plain[f"s{i}"] for i in range(B)}
        row = [f"{B:>4} {t_plain * 1e3:10.2f} |"]
        p = {"batch": B, "prompt": plen, "max_tokens": 64, "drafts": k,
             "model": args.engine_model, "draft_time_of": "flash-rank"}
        records.append(record("spec.engine_tpot", t_plain * 1e3, "ms", dict(p, speculative=False)))
        for al in (2.5, 3.5):
            r = accept_rate_for(al, k)
            got, t_spec, rep = _engine_run(model, B, k, prompts, truth, r, args.device, dtype,
                                           path)  # fmt: skip
            # bf16 steps are not batch-shape invariant (nor is the plain engine: B = 1 and 2
            # differ too), so greedy outputs can part after a near tie; the oracle's truth is
            # the plain run, so drafts after such a point are rejected (AL below target);
            # fp32 (tiny) keeps them equal
            same = sum(sum(x == y for x, y in zip(got[r_], plain[r_], strict=True))
                       for r_ in plain) / sum(len(v) for v in plain.values())  # fmt: skip
            al_got = rep["spec_accept_length"]
            eff = t_spec + t_draft.get(B, float("nan")) / al_got
            records.append(record("spec.engine_tpot", eff * 1e3, "ms",
                                  dict(p, speculative=True, accept_rate=r, accept_length=al_got,
                                       verify_only_ms=t_spec * 1e3, same_tokens=same),
                                  peer={"plain_ms": t_plain * 1e3}))  # fmt: skip
            row.append(f" AL {al}: r {r:.3f}, {al_got:.2f}, {t_spec * 1e3:.2f}, {eff * 1e3:.2f}"
                       f", {t_plain / eff:.2f}x, same {same:.2f} |")  # fmt: skip
        print("".join(row), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if tmp is not None:
        tmp.cleanup()
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="flash-rank", choices=("flash-rank", "tiny-rank"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--what", default="steps,engine")
    ap.add_argument("--engine-model", default="tiny", choices=("tiny", "flash-rank"))
    ap.add_argument("--out", default=None, help="directory for spec_decode.json")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="the rank's KV pool (default on CUDA: what 0.9 of the card leaves)")
    args = ap.parse_args()
    model = None
    if args.model == "tiny-rank":  # a smoke run of the script on CPU
        from bench.flash_rank import load_rank, tiny_rank_dir

        with tempfile.TemporaryDirectory() as tmp:
            model = load_rank(tiny_rank_dir(tmp), args.device)
    bw = copy_bandwidth() if args.device == "cuda" else 1e12
    records = [record("ceiling.copy_bandwidth", bw / 1e12, "TB/s")]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    ep = 8 if model is None else 1
    kv = None if args.device == "cuda" else 1 << 28  # None: what 0.9 of the card leaves
    kv = int(args.kv_gib * 2**30) if args.kv_gib is not None else kv
    rank = Rank(max_seqs=64, kv_bytes=kv, ep=ep, max_tokens=4096, model=model,
                device=args.device, ring_headroom=args.drafts, draft_stages=3,
                context=args.context + 64)  # fmt: skip
    t_draft: dict[int, float] = {}
    what = args.what.split(",")
    if "steps" in what:
        recs, t_draft = steps(rank, args, bw)
        records += recs
        write("spec_decode", records, args.out)
    if "engine" in what:  # its EngineCores size their own pools: the rank's goes first
        if args.device == "cuda":
            rank.release()
        records += engine(rank, args, t_draft)
    print("wrote", write("spec_decode", records, args.out))


if __name__ == "__main__":
    main()
