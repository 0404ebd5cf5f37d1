"""Ray Serve's own ``PrefixCacheAffinityRouter`` as the DPRank handle's request router (the
``ray_prefix`` routing policy: a peer in bench/routing.py, and an operator's choice).

Ray's router matches *characters* of the prompt text in a tree of what it routed (it does not
see the engines' caches or evictions). Fathom hands it the prompt's token ids, one character
each (``chr(0x100 + id)``), so its matches are on tokens, never on a rendering of them. Calls
the Router pinned with ``target=`` still go to their replica and stay out of Ray's tree.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest, RunningReplica

from app.deployments.router import pinned_target


class PinnedOrRayPrefixRouter(PrefixCacheAffinityRouter):
    """``target=`` pins (Fathom's decision); no target: Ray's prefix-affinity choice."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = pinned_target(candidate_replicas, pending_request)
        if pinned:
            return [pinned]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        req = pending_request.args[0] if pending_request.args else None
        ids = getattr(req, "prompt_token_ids", None)
        if ids is None:
            raise ValueError("a DPRank call without an EngineRequest")
        return "".join(chr(0x100 + t) for t in ids)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        if pending_request is not None and pending_request.kwargs.get("target"):
            return  # pinned by the Router: not Ray's decision
        super().on_request_routed(pending_request, replica_id, result)
