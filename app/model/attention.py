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

from app.model.compressor import Compressor41, CompressorV4
from app.model.config import LayerMode, LayerSpec, ModelConfig
from app.model.forward_batch import ForwardBatch
from app.model.indexer import Indexer, candidate_blocks
from app.model.layers import Linear, RMSNorm
from app.model.rope import Rotary, apply_rope
from kernels.attention import sparse_attention
from kernels.indexer import topk
from kernels.kv_quant import kv_qdq
from kernels.norm import rms_norm


@dataclass
class CompressedState:
    """Per-forward compressed state shared across layers, keyed by owning layer id.

    Each value is a per-sequence list: ``kv`` [C, D] rotated entries, ``keys`` [C, Di]
    index keys, ``topk`` [L, k] selected entry ids (-1 empty), ``cand`` [L, C] candidates.
    """

    kv: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)
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
    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: CompressedState) -> torch.Tensor:
        """``x`` [T, hidden] (normed sublayer input) -> [T, hidden]."""
        if any(batch.prefix_lens):
            raise NotImplementedError("incremental attention needs the paged KV cache")
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        angles = self.rotary.angles(batch.positions)
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(T, H, D)
        if not self.cfg.is_v41:
            q = rms_norm(q, None, self.cfg.rms_norm_eps)
        q = apply_rope(q, angles)
        kv = self._q(apply_rope(self.kv_norm(self.wkv(x)), angles), "fp8", 32)

        pool, idx = [kv], [self._window_rows(batch, x.device)]
        if self.spec.compressed:
            comp_rows, entries = self._compressed(x, c_q, angles, batch, state)
            pool.extend(entries)
            idx.append(comp_rows + T * (comp_rows >= 0))
        rows = torch.cat(idx, dim=1)
        out = sparse_attention(q, torch.cat(pool, dim=0), rows, self.attn_sink, D**-0.5)
        out = apply_rope(out, angles, inverse=True)
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

    def _window_rows(self, batch: ForwardBatch, device: torch.device) -> torch.Tensor:
        """[T, W] pool rows of the sliding window; e.g. W=3, seq starting at row 4, token
        row 5 -> [-1, 4, 5]."""
        starts = torch.repeat_interleave(
            torch.tensor([s.start for s in batch.seq_slices()], device=device),
            torch.tensor(batch.seq_lens, device=device),
        )
        t = torch.arange(batch.num_tokens, device=device)
        rows = t.unsqueeze(1) - self.window + 1 + torch.arange(self.window, device=device)
        return torch.where(rows >= starts.unsqueeze(1), rows, -1)

    def _compressed(
        self,
        x: torch.Tensor,
        c_q: torch.Tensor,
        angles: torch.Tensor,
        batch: ForwardBatch,
        state: CompressedState,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Compressed entries per sequence and each token's selected rows (relative to the
        compressed part of the pool, -1 empty)."""
        spec, lid, r = self.spec, self.spec.layer_id, self.spec.ratio
        if spec.owns_compressor:
            state.kv[lid], state.keys[lid] = [], []
        if spec.computes_topk:
            state.topk[lid] = []
            if spec.is_candidate_source:
                state.cand[lid] = []
        row_lists, base = [], 0
        for s, sl in enumerate(batch.seq_slices()):
            xs, pos = x[sl], batch.positions[sl]
            if spec.owns_compressor:
                self._compress_seq(xs, state)
            kv_s = state.kv[spec.kv_source][s]
            visible = torch.div(pos + 1, r, rounding_mode="floor")
            if spec.computes_topk:
                state.topk[lid].append(self._select(xs, c_q[sl], angles[sl], visible, s, state))
            if spec.mode is LayerMode.HCA:
                cols = torch.arange(kv_s.shape[0], device=x.device)
                sel = torch.where(cols.unsqueeze(0) < visible.unsqueeze(1), cols, -1)
            else:
                sel = state.topk[spec.index_source][s]
            row_lists.append(torch.where(sel >= 0, sel + base, -1))
            base += kv_s.shape[0]
        width = max(rl.shape[1] for rl in row_lists)
        rows = torch.cat(
            [torch.nn.functional.pad(rl, (0, width - rl.shape[1]), value=-1) for rl in row_lists]
        )
        entries = [state.kv[spec.kv_source][s] for s in range(batch.num_seqs)]
        return rows, entries

    def _compress_seq(self, xs: torch.Tensor, state: CompressedState) -> None:
        """Compressed KV (and index keys) of one sequence, rotated at positions w*ratio."""
        lid, r = self.spec.layer_id, self.spec.ratio
        latent = self.compressor(xs)
        pos = torch.arange(latent.shape[0], device=xs.device) * r
        ang = self.rotary.angles(pos)
        state.kv[lid].append(self._q(apply_rope(latent, ang).to(xs.dtype), "nvfp4", 16))
        if self.spec.owns_index_keys:
            ix = self.indexer
            # V4.1: index keys from the unrotated latent; V4: the indexer's own compressor.
            v41 = self.cfg.is_v41
            keys = ix.k_norm(ix.wk(latent.to(xs.dtype))) if v41 else ix.compressor(xs)
            keys = apply_rope(keys, ang[: keys.shape[0]]).to(xs.dtype)
            state.keys[lid].append(self._q(keys, "mxfp4", 32))

    def _select(
        self,
        xs: torch.Tensor,
        c_q: torch.Tensor,
        angles: torch.Tensor,
        visible: torch.Tensor,
        s: int,
        state: CompressedState,
    ) -> torch.Tensor:
        """Top-k compressed entry ids [L, k] for one sequence (V4 CSA, V4.1 Full/Reindex)."""
        spec, cfg = self.spec, self.cfg
        keys = state.keys[spec.kv_source][s]
        if keys.shape[0] == 0:
            return torch.empty(xs.shape[0], 0, dtype=torch.int64, device=xs.device)
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
