"""Expert parallelism: where each routed expert lives, and the all-to-all exchange of a gang.

A gang of ``size`` ranks holds ``n_experts + redundant`` expert *slots*, ``slots_per_rank``
consecutive slots per rank; ``slots[s]`` is the expert slot ``s`` holds (a redundant slot
repeats an expert held elsewhere). Default placement, E = 8, size 2, redundant 2:

    rank 0: slots 0-4 = experts [0 1 2 3 | 4]      (its 4 primaries, then a replica of
    rank 1: slots 5-9 = experts [4 5 6 7 | 0]       the next rank's first expert)

One MoE layer of one step, on every rank of the gang (an idle rank with T = 0):

    gate -> (token, expert) pairs [T*k] -> slot (a local replica, else replica t % copies)
    sort pairs by owner rank -> all-to-all rows (+ slot ids) -> local experts (weight 1)
    -> all-to-all results back -> out[t] = sum_j w[t, j] * y[t, j]  (fp32, then x.dtype)

``torch.distributed`` only (gloo on CPU, NCCL on GPU); no Ray. ``EPGroup`` of size 1 runs the
same path without a collective (what ``bench.ep_step`` times against the fused MoE).
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
        return RouteTables(table.to(device), n.to(device), local.to(device))


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
    ``local`` [E] this rank's slot of each expert or -1."""

    replicas: torch.Tensor
    copies: torch.Tensor
    local: torch.Tensor


def pair_slots(ids: torch.Tensor, routes: RouteTables) -> torch.Tensor:
    """Slot of each (token, expert) pair [T, k]: the local replica when there is one, else
    replica ``t % copies`` (spreads a hot expert's tokens over its copies)."""
    t = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    pick = routes.replicas[ids, t % routes.copies[ids]]
    return torch.where(routes.local[ids] >= 0, routes.local[ids], pick)


class EPGroup:
    """A gang's collective group as the model uses it: ``rank``, ``size`` and the
    ``torch.distributed`` group (None = the default group; unused when ``size`` is 1)."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a gang of {size}")
        self.rank, self.size, self.group = rank, size, group

    def exchange(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send ``rows`` [N, ...] (sorted by destination; ``counts`` [size] int64 per rank)
        -> (rows received, sorted by source; counts received per source). Rows travel as
        bytes (any dtype over gloo). One host sync for the counts."""
        if self.size == 1:
            return rows, counts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = rows.contiguous()
        width = max(1, int(torch.Size(send.shape[1:]).numel())) * send.element_size()
        raw = send.view(torch.uint8).reshape(send.shape[0], width)
        sc, rc = counts.tolist(), recv_counts.tolist()
        out = raw.new_empty(sum(rc), raw.shape[1])
        dist.all_to_all_single(out, raw, rc, sc, group=self.group)
        shape = (sum(rc), *rows.shape[1:])
        return out.view(rows.dtype).reshape(shape), recv_counts

    def any(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        """Whether ``flag`` is true on any rank (every rank calls this once per step)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def _by_owner(owner: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stable order grouping ``owner`` [N] by rank, counts [size])."""
    order = torch.argsort(owner, stable=True)
    return order, torch.bincount(owner, minlength=size).to(torch.int64)


def ep_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    routes: RouteTables,
    slots_per_rank: int,
    group: EPGroup,
    local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Routed experts of ``x`` [T, d] over the gang (T may be 0: an idle rank still serves
    its experts to the others). ``local(rows [R, d], slots [R])`` applies each row's local
    expert (weight 1) in ``x.dtype``. -> [T, d] in ``x.dtype``."""
    T, k = ids.shape
    slot = pair_slots(ids, routes).reshape(-1)
    order, counts = _by_owner(slot // slots_per_rank, group.size)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)[order]
    recv_x, recv_counts = group.exchange(x[tok], counts)
    recv_slot, _ = group.exchange(slot[order], counts)
    y = local(recv_x, recv_slot)
    back, _ = group.exchange(y, recv_counts)
    pairs = torch.empty_like(back)
    pairs[order] = back
    out = (pairs.view(T, k, x.shape[1]).float() * weights.float().unsqueeze(-1)).sum(1)
    return out.to(x.dtype)


def sharded_rows(
    table: torch.Tensor, start: int, rows: torch.Tensor, per_rank: int, group: EPGroup
) -> torch.Tensor:
    """Rows ``rows`` [N] (global ids) of a table split over the gang, ``per_rank`` rows each
    (this rank holds ``table`` = rows ``[start, start + len)``) -> [N, dim]: the row ids go
    to their owners, the rows come back. N may be 0 (an idle rank still answers)."""
    flat = rows.reshape(-1)
    order, counts = _by_owner(flat // per_rank, group.size)
    want, recv_counts = group.exchange(flat[order], counts)
    found, _ = group.exchange(table[want - start], recv_counts)
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
