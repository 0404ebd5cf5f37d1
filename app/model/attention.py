"""Attention for every layer mode: sliding window + compressed entries, one latent KV head.

Per query token t the key set is the window ``{t-W+1..t}`` of this layer's own latent KV plus
compressed entries: the top-k selected ones (V4 CSA, V4.1 Full/Reindex/Reuse) or every visible
one (V4 HCA, ``w < (t+1)//ratio``). All keys live as rows of one pool and each token carries
its list of rows, which is the same contract the paged decode kernel gets:

    pool = [window KV of all T tokens | compressed entries of seq 0 | of seq 1 | ...]
    idx[t] = [window rows (-1 padded)  | selected compressed rows (-1 padded)]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from app.model.compressor import Compressor, Compressor41, CompressorV4
from app.model.config import LayerMode, LayerSpec, ModelConfig
from app.model.forward_batch import ForwardBatch
from app.model.indexer import Indexer, candidate_blocks
from app.model.kv_store import KVStore
from app.model.layers import Linear, RMSNorm
from app.model.rope import Rotary, apply_rope
from kernels.attention import sparse_attention
from kernels.indexer import topk
from kernels.kv_quant import kv_qdq
from kernels.norm import rms_norm


@dataclass
class CompressedState:
    """Per-forward selection state shared across layers, keyed by the computing layer id.

    Per-sequence lists: ``topk`` [L, k] selected entry ids (-1 empty), ``cand`` [L, C]
    V4.1 candidate masks. (Compressed entries and index keys live in the KV store.)
    """

    topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    cand: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class Attention(nn.Module):
    """MLA-style single-latent attention with sink, partial RoPE, grouped low-rank output."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, kv_quant: bool = False):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        # Round KV like the released V4.1 cache formats (fp8 window, nvfp4 compressed,
        # mxfp4 index q/k); off = exact arithmetic.
        self.kv_quant = kv_quant and cfg.is_v41
        H, D, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.head_dim, self.window = H, D, cfg.sliding_window
        self.wq_a = Linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D)
        self.wkv = Linear(d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.rotary = Rotary(cfg, compressed=spec.compressed)
        if spec.owns_compressor:
            if cfg.is_v41:
                self.compressor = Compressor41(d, D, spec.ratio, cfg.rms_norm_eps)
            else:
                overlap = spec.mode is LayerMode.CSA
                self.compressor = CompressorV4(d, D, spec.ratio, overlap, cfg.rms_norm_eps)
        if spec.computes_topk:
            self.indexer = Indexer(cfg, owns_keys=spec.owns_index_keys)

    # ---- forward ------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: CompressedState, store: KVStore
    ) -> torch.Tensor:
        """``x`` [T, hidden] (normed sublayer input) -> [T, hidden]."""
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        angles = self.rotary.angles(batch.positions)
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(T, H, D)
        if not self.cfg.is_v41:
            q = rms_norm(q, None, self.cfg.rms_norm_eps)
        q = apply_rope(q, angles)
        kv = self._q(apply_rope(self.kv_norm(self.wkv(x)), angles), "fp8", 32)
        if self.spec.computes_topk:
            state.topk[self.spec.layer_id] = []
            if self.spec.is_candidate_source:
                state.cand[self.spec.layer_id] = []

        pool, win_rows, comp_rows, base = [], [], [], 0
        for s, sl in enumerate(batch.seq_slices()):
            local, rows = self._window(kv[sl], batch, s, store)
            pool.append(local)
            win_rows.append(torch.where(rows >= 0, rows + base, -1))
            base += local.shape[0]
            if self.spec.compressed:
                entries, sel = self._compressed(x[sl], c_q[sl], angles[sl], batch, s, state, store)
                pool.append(entries)
                comp_rows.append(torch.where(sel >= 0, sel + base, -1))
                base += entries.shape[0]
        rows = torch.cat(win_rows)
        if comp_rows:
            width = max(r.shape[1] for r in comp_rows)
            pad = torch.nn.functional.pad
            rows = torch.cat(
                (rows, torch.cat([pad(r, (0, width - r.shape[1]), value=-1) for r in comp_rows])),
                dim=1,
            )
        out = sparse_attention(
            q, torch.cat(pool), rows, self.attn_sink, D**-0.5, inv_rope_angles=angles
        )
        return self._project(out)

    def _q(self, x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
        return kv_qdq(x, fmt, block) if self.kv_quant else x

    def _project(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: group g of heads -> wo_a[g] -> concat -> wo_b."""
        g = self.cfg.o_groups
        grouped = o.reshape(o.shape[0], g, -1)
        w = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)
        y = torch.einsum("tgi,goi->tgo", grouped.to(w.dtype), w).flatten(1)
        return self.wo_b(y)

    def _window(
        self, kv_new: torch.Tensor, batch: ForwardBatch, s: int, store: KVStore
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys of one sequence: (local KV [m, D], rows [n, W] into it, -1 empty).

        ``local`` holds consecutive positions ``p0 ..``: the stored window positions
        ``[max(floor, a-W+1), a)`` followed by the n new ones. Example W=3, a=5, n=2, floor 0:
        local = positions [3, 4, 5, 6]; token 6 -> rows [1, 2, 3].
        """
        lid, W = self.spec.layer_id, self.window
        a, n, floor = batch.prefix_lens[s], kv_new.shape[0], batch.window_floors[s]
        lo = max(floor, a - W + 1, 0)
        if a > lo:
            local = torch.cat((store.read_window(lid, s, lo, a).to(kv_new.dtype), kv_new))
        else:
            lo, local = a, kv_new
        store.write_window(lid, s, a, kv_new)
        t = torch.arange(a, a + n, device=kv_new.device)
        rows = (t - lo).unsqueeze(1) - W + 1 + torch.arange(W, device=kv_new.device)
        return local, torch.where(rows >= 0, rows, -1)

    def _compressed(
        self,
        xs: torch.Tensor,
        c_q: torch.Tensor,
        angles: torch.Tensor,
        batch: ForwardBatch,
        s: int,
        state: CompressedState,
        store: KVStore,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed entries 0..E-1 of the sequence, selected entry ids per token [n, k])."""
        spec, r = self.spec, self.spec.ratio
        a, n = batch.prefix_lens[s], xs.shape[0]
        if spec.owns_compressor:
            self._emit(xs, batch, s, store)
        E = (a + n) // r
        if E:
            entries = store.read_entries(spec.kv_source, s, E).to(xs.dtype)
        else:
            entries = xs.new_zeros(0, self.head_dim)
        visible = torch.div(
            torch.arange(a + 1, a + n + 1, device=xs.device), r, rounding_mode="floor"
        )
        if spec.computes_topk:
            sel = self._select(xs, c_q, angles, visible, E, s, state, store)
            state.topk[spec.layer_id].append(sel)
        elif spec.mode is LayerMode.HCA:
            cols = torch.arange(E, device=xs.device)
            sel = torch.where(cols.unsqueeze(0) < visible.unsqueeze(1), cols, -1)
        else:
            sel = state.topk[spec.index_source][s]
        return entries, sel

    def _emit(self, xs: torch.Tensor, batch: ForwardBatch, s: int, store: KVStore) -> None:
        """Run the compressor(s) over the new tokens; store every group that completes in
        this chunk and is not cached yet (entries ``[c // r, (a+n) // r)``, c = cached_len)."""
        lid, r = self.spec.layer_id, self.spec.ratio
        a, n = batch.prefix_lens[s], xs.shape[0]
        c = max(a, batch.cached_lens[s])
        e0, e1 = c // r, (a + n) // r
        pos = torch.arange(a, a + n, device=xs.device)
        latent = self._pool_groups(self.compressor, "kv", xs, pos, e0, e1, batch, s, store)
        v4_keys = None
        if self.spec.owns_index_keys and not self.cfg.is_v41:
            # V4: the indexer's own overlapping compressor (its tail advances every chunk)
            comp = self.indexer.compressor
            v4_keys = self._pool_groups(comp, "idx", xs, pos, e0, e1, batch, s, store)
        if latent is None:
            return
        w = torch.arange(e0, e1, device=xs.device)
        ang = self.rotary.angles(w * r)
        entries = self._q(apply_rope(latent, ang).to(xs.dtype), "nvfp4", 16)
        keys = None
        if self.spec.owns_index_keys:
            ix = self.indexer  # V4.1: index keys from the unrotated latent
            raw = ix.k_norm(ix.wk(latent.to(xs.dtype))) if v4_keys is None else v4_keys
            keys = self._q(apply_rope(raw, ang).to(xs.dtype), "mxfp4", 32)
        store.write_entries(lid, s, e0, entries, keys)

    def _pool_groups(
        self,
        comp: Compressor,
        name: str,
        xs: torch.Tensor,
        pos: torch.Tensor,
        e0: int,
        e1: int,
        batch: ForwardBatch,
        s: int,
        store: KVStore,
    ) -> torch.Tensor | None:
        """Pool groups ``e0 .. e1-1`` from stored tail projections + the new tokens', then
        store the new projections in the tail."""
        lid, r, span = self.spec.layer_id, comp.ratio, comp.span
        a = int(pos[0])
        v, g = comp.project(xs, pos)
        lo = max((e0 + 1) * r - span, 0)
        out = None
        if e1 > e0:
            if lo < a:
                if lo < batch.window_floors[s]:
                    raise RuntimeError(
                        f"layer {lid}: compressor needs position {lo}, below the replay floor"
                    )
                pv, pg = store.read_tail(lid, name, s, lo, a)
                V, G = torch.cat((pv.to(v.dtype), v)), torch.cat((pg.to(g.dtype), g))
            else:
                lo, V, G = a, v, g
            w = torch.arange(e0, e1, device=xs.device)
            idx = ((w + 1) * r - span - lo).unsqueeze(1) + torch.arange(span, device=xs.device)
            out = comp.pool(V[idx.clamp_min(0)], G[idx.clamp_min(0)], w == 0)
        store.write_tail(lid, name, s, a, v, g)
        return out

    def _select(
        self,
        xs: torch.Tensor,
        c_q: torch.Tensor,
        angles: torch.Tensor,
        visible: torch.Tensor,
        E: int,
        s: int,
        state: CompressedState,
        store: KVStore,
    ) -> torch.Tensor:
        """Top-k compressed entry ids [n, k] for one sequence (V4 CSA, V4.1 Full/Reindex)."""
        spec, cfg = self.spec, self.cfg
        if E == 0:
            if spec.is_candidate_source:
                state.cand[spec.layer_id].append(torch.zeros(xs.shape[0], 0, dtype=torch.bool))
            return torch.empty(xs.shape[0], 0, dtype=torch.int64, device=xs.device)
        keys = store.read_keys(spec.kv_source, s, E).to(xs.dtype)
        q, w = self.indexer.queries(xs, c_q, angles, apply_rope)
        q = self._q(q, "mxfp4", 32)
        scores = self.indexer.scores(q, w, keys, visible)
        if spec.is_candidate_source:
            cand = candidate_blocks(
                scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size
            )
            state.cand[spec.layer_id].append(cand)
        elif spec.uses_candidates:
            cand = state.cand[cfg.candidate_source_layer_id][s]
            scores = scores.masked_fill(~cand, float("-inf"))
        return topk(scores, cfg.index_topk)
