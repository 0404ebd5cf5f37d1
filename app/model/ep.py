"""Expert parallelism: where each routed expert lives, and the all-to-all exchange of a gang.

A gang of ``size`` ranks holds ``n_experts + redundant`` expert *slots*, ``slots_per_rank``
consecutive slots per rank; ``slots[s]`` is the expert slot ``s`` holds (a redundant slot
repeats an expert held elsewhere). Default placement, E = 8, size 2, redundant 2:

    rank 0: slots 0-4 = experts [0 1 2 3 | 4]      (its 4 primaries, then a replica of
    rank 1: slots 5-9 = experts [4 5 6 7 | 0]       the next rank's first expert)

One MoE layer of one step, on every rank of the gang (an idle rank with T = 0), token by
token (a token travels once to a rank, with all k of its slots and weights):

    gate -> slots [T, k] (a local replica, else replica t % copies; identity placement: ids)
    dense (decode-sized steps):  pad to the step's capacity C -> all-gather [size*C rows]
        -> fused k-way experts over the slots held here -> reduce-scatter (fp32 sums)
    sized (larger steps):        each token to the ranks holding one of its slots
        (all-to-all, counts read on the host) -> fused k-way experts -> all-to-all back
        -> out[t] = sum over ranks of its partial sums (fp32, then x.dtype)

The dense exchange has fixed sizes and no host sync (CUDA graphs can hold it); the sized one
moves only the rows needed. ``torch.distributed`` only (gloo on CPU, NCCL on GPU); no Ray.
An ``EPGroup`` of size 1 runs the local experts on ``x`` itself: the fused MoE step, which
``bench.ep_step`` times against the plain MoE layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PlacementError(ValueError):
    """An expert placement that does not fit the model or the gang."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Slot -> expert map of one gang (see the module docstring)."""

    n_experts: int
    size: int
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        e, n = self.n_experts, self.size
        if n < 1 or e < 1:
            raise PlacementError(f"ep_size {n} and n_experts {e} must be positive")
        if len(self.slots) % n:
            raise PlacementError(f"{len(self.slots)} expert slots do not split over {n} ranks")
        if any(not 0 <= s < e for s in self.slots) or set(self.slots) != set(range(e)):
            raise PlacementError(f"the slots must hold every expert 0..{e - 1} (and only them)")
        for r in range(n):
            local = self.local(r)
            if len(set(local)) != len(local):
                raise PlacementError(f"rank {r} holds an expert twice: {local}")

    @classmethod
    def default(cls, n_experts: int, size: int, redundant: int = 0) -> ExpertPlacement:
        """Rank r: its ``n_experts / size`` primaries, then ``redundant / size`` replicas of
        the next rank's first experts (both counts must divide evenly)."""
        if n_experts % size or redundant % size:
            raise PlacementError(
                f"n_routed_experts {n_experts} and redundant_experts {redundant} must both be "
                f"multiples of ep_size {size}"
            )
        per, extra = n_experts // size, redundant // size
        if extra > per and size > 1:
            raise PlacementError(f"redundant_experts {redundant}: at most {per} per rank")
        slots: list[int] = []
        for r in range(size):
            slots += range(r * per, (r + 1) * per)
            nxt = ((r + 1) % size) * per
            slots += range(nxt, nxt + (extra if size > 1 else 0))
        if size == 1 and redundant:
            raise PlacementError("redundant_experts need ep_size > 1")
        return cls(n_experts, size, tuple(slots))

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.size

    def offset(self, rank: int) -> int:
        """First slot of ``rank``."""
        return rank * self.slots_per_rank

    def local(self, rank: int) -> tuple[int, ...]:
        """Experts ``rank`` holds, in slot order."""
        o = self.offset(rank)
        return self.slots[o : o + self.slots_per_rank]

    def routes(self, rank: int, device: torch.device | str) -> RouteTables:
        """The device tables :func:`pair_slots` reads on ``rank``."""
        e = self.n_experts
        copies = [[s for s, x in enumerate(self.slots) if x == k] for k in range(e)]
        width = max(len(c) for c in copies)
        table = torch.tensor([c + c[:1] * (width - len(c)) for c in copies], dtype=torch.int64)
        mine = range(self.offset(rank), self.offset(rank) + self.slots_per_rank)
        local = torch.tensor([next((s for s in c if s in mine), -1) for c in copies])
        n = torch.tensor([len(c) for c in copies], dtype=torch.int64)
        identity = self.slots == tuple(range(e))
        return RouteTables(table.to(device), n.to(device), local.to(device), identity)


@dataclass(frozen=True)
class ExpertShard:
    """What one rank of a gang holds: ``placement`` and its ``rank`` in it."""

    placement: ExpertPlacement
    rank: int

    @property
    def local(self) -> tuple[int, ...]:
        return self.placement.local(self.rank)

    @property
    def offset(self) -> int:
        return self.placement.offset(self.rank)


@dataclass(frozen=True)
class RouteTables:
    """``replicas`` [E, width] slots of each expert (padded with its first), ``copies`` [E],
    ``local`` [E] this rank's slot of each expert or -1; ``identity``: slot s holds expert
    s (no redundant experts), so a pair's slot is its expert id."""

    replicas: torch.Tensor
    copies: torch.Tensor
    local: torch.Tensor
    identity: bool = False


def pair_slots(ids: torch.Tensor, routes: RouteTables) -> torch.Tensor:
    """Slot of each (token, expert) pair [T, k]: the local replica when there is one, else
    replica ``t % copies`` (spreads a hot expert's tokens over its copies). An identity
    placement returns ``ids`` itself (no launch)."""
    if routes.identity:
        return ids
    t = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    pick = routes.replicas[ids, t % routes.copies[ids]]
    return torch.where(routes.local[ids] >= 0, routes.local[ids], pick)


DENSE_MAX_TOKENS = 256  # a step whose gang-wide max tokens per rank is at most this: dense

# torch 2.13 renames the tensor collectives (the GPU machine's torch 2.11 has the old names)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class EPGroup:
    """A gang's collective group as the model uses it: ``rank``, ``size`` and the
    ``torch.distributed`` group (None = the default group; unused when ``size`` is 1).

    ``capacity``: this step's dense capacity, set by :meth:`agree` (every rank calls it
    once per step with its token count): the gang's largest token count when that is at
    most ``dense_max_tokens``, else None. Every rank reads the same value, so every rank
    picks the same exchange (dense or sized) for every layer of the step."""

    def __init__(
        self,
        rank: int,
        size: int,
        group: dist.ProcessGroup | None = None,
        dense_max_tokens: int = DENSE_MAX_TOKENS,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a gang of {size}")
        self.rank, self.size, self.group = rank, size, group
        self.dense_max_tokens = dense_max_tokens
        self.capacity: int | None = None

    def agree(self, n_tokens: int, device: torch.device | str = "cpu") -> int:
        """The gang's largest token count this step (one all-reduce, one host read: the
        step's only host sync for the gang); sets :attr:`capacity`."""
        most = n_tokens
        if self.size > 1:
            t = torch.tensor([n_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            most = int(t.item())
        self.capacity = most if 0 < most <= self.dense_max_tokens else None
        return most

    def split_sizes(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """(rows this rank sends to each rank, rows it receives from each) for ``counts``
        [size] int64 rows per destination: one all-to-all of the counts and one host read
        (the sized exchange's only host sync; the way back reuses the same lists)."""
        if self.size == 1:
            n = counts.tolist()
            return n, n
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send, got = torch.stack((counts, recv)).tolist()
        return send, got

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``rows`` [N, ...] (sorted by destination, ``send[r]`` to rank r) -> the rows
        received, sorted by source (``recv[r]`` from rank r). Rows travel as bytes (any
        dtype over gloo). No host sync (the sizes come from :meth:`split_sizes`)."""
        if self.size == 1:
            return rows
        raw = _bytes(rows)
        out = raw.new_empty(sum(recv), raw.shape[1])
        dist.all_to_all_single(out, raw, recv, send, group=self.group)
        return out.view(rows.dtype).reshape(sum(recv), *rows.shape[1:])

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` [C, ...] (the same C everywhere) -> [size * C, ...] in rank
        order. No host sync (a CUDA graph can hold it)."""
        raw = _bytes(rows)
        out = raw.new_empty(self.size * raw.shape[0], raw.shape[1])
        _all_gather(out, raw, group=self.group)
        return out.view(rows.dtype).reshape(self.size * rows.shape[0], *rows.shape[1:])

    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [size * C, ...] -> the sum over ranks of block ``rank`` [C, ...]. No host
        sync."""
        out = rows.new_empty(rows.shape[0] // self.size, *rows.shape[1:])
        _reduce_scatter(out, rows.contiguous(), group=self.group)
        return out


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [N, ...] as a [N, row bytes] uint8 view (contiguous)."""
    send = rows.contiguous()
    width = max(1, int(torch.Size(send.shape[1:]).numel())) * send.element_size()
    return send.view(torch.uint8).reshape(send.shape[0], width)


def _by_owner(owner: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stable order grouping ``owner`` [N] by rank, counts [size])."""
    order = torch.argsort(owner, stable=True)
    return order, torch.bincount(owner, minlength=size).to(torch.int64)


LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _pack(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte row per token: its activations, its k slots (int32), its k weights (fp32)."""
    meta = torch.cat((slots.to(torch.int32), weights.float().view(torch.int32)), dim=1)
    return torch.cat((_bytes(x), _bytes(meta)), dim=1)


def _unpack(
    raw: torch.Tensor, d: int, k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xb = d * torch.empty(0, dtype=dtype).element_size()
    x = raw[:, :xb].contiguous().view(dtype)
    meta = raw[:, xb:].contiguous().view(torch.int32)
    return x, meta[:, :k].long(), meta[:, k:].view(torch.float32)


def ep_moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slots_per_rank: int,
    group: EPGroup,
    local: LocalExperts,
    phase: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Routed experts of ``x`` [T, d] over the gang; ``slots`` / ``weights`` [T, k] each
    token's expert slots (:func:`pair_slots`) and gate weights. T may be 0: an idle rank
    still serves the others' tokens. ``local(rows [R, d], slots [R, k], weights [R, k],
    dtype)`` is this rank's part of each row: ``sum_j w_j expert(row)`` over the slots it
    holds (the others ignored; the fused k-way kernels with the rank's slot offset), in
    ``dtype``: ``x.dtype`` at ep_size 1, else fp32 (the partial sums stay fp32 until the
    combine has added them). -> [T, d] in ``x.dtype``.

    Each token travels once to each rank, never once per expert:

    - ep_size 1: ``local`` on ``x`` itself (no exchange: the fused MoE step).
    - dense (``group.capacity`` set: a decode-sized step): every rank pads its tokens to
      the capacity C and all-gathers them ([size * C] rows everywhere); each rank runs
      its experts over all of them, and a reduce-scatter sums each rank's rows back in
      fp32. Fixed sizes, no host sync: a CUDA graph can capture the layer.
    - sized (larger steps): each token goes to the ranks holding one of its slots; the
      exchange counts are read on the host (one sync per layer); the partial sums come
      back in fp32 and add up per token.

    ``phase`` (benchmarks: ``bench.ep_nccl``): called with "dispatch" once the rows are
    here and with "experts" once the local experts ran (the rest is the combine); not
    called at ep_size 1.
    """
    if group.size == 1:
        return local(x, slots, weights, x.dtype)
    T, d = x.shape
    k = slots.shape[1]
    cap = group.capacity
    if cap is not None:
        if cap < T:
            raise RuntimeError(f"{T} tokens in a dense step of capacity {cap} (agree() first)")
        pad = torch.full((cap - T, k), -1, dtype=slots.dtype, device=x.device)
        rows = torch.cat((x, x.new_zeros(cap - T, d)))
        no_w = torch.zeros(cap - T, k, dtype=torch.float32, device=x.device)
        mine = _pack(rows, torch.cat((slots, pad)), torch.cat((weights.float(), no_w)))
        rx, rs, rw = _unpack(group.gather(mine), d, k, x.dtype)
        if phase is not None:
            phase("dispatch")
        part = local(rx, rs, rw, torch.float32)
        if phase is not None:
            phase("experts")
        return group.reduce_scatter(part)[:T].to(x.dtype)
    owner = torch.where(slots >= 0, slots // slots_per_rank, group.size)
    hit = torch.zeros(T, group.size + 1, dtype=torch.bool, device=x.device)
    hit = hit.scatter_(1, owner, True)[:, : group.size]  # token t has a slot on rank r
    send, got = group.split_sizes(hit.sum(0).to(torch.int64))
    # by destination, then token (the size is known: no second host sync)
    tok = torch.nonzero_static(hit.t(), size=sum(send))[:, 1]
    rx, rs, rw = _unpack(group.exchange(_pack(x[tok], slots[tok], weights[tok]), send, got),
                         d, k, x.dtype)  # fmt: skip
    if phase is not None:
        phase("dispatch")
    part = local(rx, rs, rw, torch.float32)
    if phase is not None:
        phase("experts")
    back = group.exchange(part, got, send)
    out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, back).to(x.dtype)


def sharded_rows(
    table: torch.Tensor, start: int, rows: torch.Tensor, per_rank: int, group: EPGroup
) -> torch.Tensor:
    """Rows ``rows`` [N] (global ids) of a table split over the gang, ``per_rank`` rows each
    (this rank holds ``table`` = rows ``[start, start + len)``) -> [N, dim]: the row ids go
    to their owners, the rows come back. N may be 0 (an idle rank still answers)."""
    flat = rows.reshape(-1)
    order, counts = _by_owner(flat // per_rank, group.size)
    send, got = group.split_sizes(counts)
    want = group.exchange(flat[order], send, got)
    found = group.exchange(table[want - start], got, send)
    out = torch.empty_like(found)
    out[order] = found
    return out


__all__ = [
    "EPGroup",
    "ExpertPlacement",
    "ExpertShard",
    "PlacementError",
    "RouteTables",
    "ep_moe",
    "pair_slots",
    "sharded_rows",
]
