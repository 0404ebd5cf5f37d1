"""Joining an expert-parallel gang inside a DPRank replica.

Serve gang-schedules the ranks of one gang (``gang_scheduling_config``: one placement group,
one bundle per rank, PACK, RESTART_GANG) and tells each replica its gang id and rank
(``serve.get_replica_context().gang_context``). Rank 0 opens a ``torch.distributed`` store
on a free port (port 0) and publishes host:port through the Router; the others read it there
(no fixed ports, no environment variables). Every rank then joins one process group (gloo
on CPU, NCCL on GPU). A lost rank breaks the group's collectives on its peers; Serve's
RESTART_GANG policy replaces the whole gang, which rendezvouses again under a new id.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import ParallelConfig
from app.deployments.routing import EngramPlan
from app.engine.parallel import RankParallel
from app.model.ep import EPGroup, ExpertPlacement

logger = logging.getLogger(__name__)
RENDEZVOUS_TIMEOUT_S = 300.0  # the gang's ranks load their weights before they meet
COLLECTIVE_TIMEOUT_S = 120.0  # a collective a peer never joins fails after this


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _blocking(fn):
    """Run ``fn`` on a helper thread and wait (handle ``.result()`` must not run on an
    event loop thread, which a replica constructor may be on)."""
    out: dict = {}

    def run() -> None:
        try:
            out["v"] = fn()
        except BaseException as e:  # re-raised in the caller
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out["v"]


def join_gang(
    pc: ParallelConfig, n_experts: int, router: DeploymentHandle, device: str
) -> RankParallel:
    """This replica's :class:`RankParallel`: rendezvous through the Router, one process
    group, the expert placement of its rank and the Engram placement the Router published."""
    ctx = serve.get_replica_context().gang_context
    if ctx is None or ctx.world_size != pc.ep_size:
        raise RuntimeError(f"ep_size {pc.ep_size} needs Serve gang scheduling with gangs of "
                           f"that size (gang context: {ctx})")  # fmt: skip
    rank, size = ctx.rank, ctx.world_size
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)

    def meet() -> tuple[dist.TCPStore, EngramPlan]:
        if rank == 0:
            host = _node_ip()
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)  # fmt: skip
            router.publish_rendezvous.remote(ctx.gang_id, host, store.port).result(timeout_s=30)
        else:
            deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
            while (addr := router.rendezvous.remote(ctx.gang_id).result(timeout_s=30)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gang {ctx.gang_id}: rank 0 never published its store")
                time.sleep(0.2)
            store = dist.TCPStore(addr[0], addr[1], size, is_master=False, timeout=timeout)
        return store, router.engram_placement.remote().result(timeout_s=30)

    store, plan = _blocking(meet)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    placement = ExpertPlacement.default(n_experts, size, pc.redundant_experts)
    logger.info("gang %s: rank %d of %d (%s), experts %s, Engram %s", ctx.gang_id, rank, size,
                backend, placement.local(rank), plan.mode)  # fmt: skip
    return RankParallel(EPGroup(rank, size), placement, plan.mode, plan.key,  # type: ignore[arg-type]
                        keep=[store])  # fmt: skip
