"""Draft proposers: after a step, each speculating request gets up to k draft tokens for
positions anchor + 2 .. anchor + 1 + k, where ``anchor`` is its last committed position and
``bonus`` the token the step emitted at anchor + 1 (both device tensors: the step's accept
decision never reaches the host before the drafts are launched).

    DSparkProposer   V4.1: the checkpoint's DSpark stages (app.model.dspark) over a context
                     ring per stage and slot (``PagedKV.draft``), fed the target features of
                     committed rows (``observe``)

Test and benchmark proposers (the target's own continuation, random tokens) implement the
same protocol in ``bench/proposers.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from app.config import EngineConfigError, SpeculativeConfig
from app.engine.request import SamplingParams
from app.engine.sampler import draw_proposal
from app.model.dspark import DraftBlock, DSparkDrafter, supports_dspark
from app.model.kv_store import PagedKV
from app.model.model import DeepseekModel


class Proposer(Protocol):
    """What the engine needs of a drafter."""

    needs_features: bool  # the step must return the target features of its head rows

    def observe(
        self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None
    ) -> None:
        """Committed rows of a step (``slots`` [N], trash slot = not committed)."""

    def propose(
        self,
        request_ids: Sequence[str],
        slots: torch.Tensor,
        anchors: torch.Tensor,
        bonus: torch.Tensor,
        num_drafts: int,
        params: Sequence[SamplingParams],
        first_output: torch.Tensor,
    ) -> DraftBlock:
        """``num_drafts`` drafts per request; ``first_output`` [R]: the output index of each
        request's first draft (seeded draws count from it)."""


class DSparkProposer:
    """V4.1 DSpark over the engine's draft rings."""

    needs_features = True

    def __init__(self, model: DeepseekModel, pools: PagedKV) -> None:
        self.drafter = DSparkDrafter(model)
        if len(pools.draft) != len(self.drafter.stages):
            raise ValueError(
                f"the KV cache has {len(pools.draft)} draft rings for "
                f"{len(self.drafter.stages)} DSpark stages"
            )
        self.rings = pools.draft

    def observe(self, slots, positions, features) -> None:
        self.drafter.write_context(self.rings, slots, features, positions)

    def propose(self, request_ids, slots, anchors, bonus, num_drafts, params, first_output):
        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:
            return draw_proposal(logits, params, first_output + k)

        return self.drafter.draft(self.rings, slots, anchors, bonus, num_drafts, pick)


def check_speculation(spec: SpeculativeConfig, model: DeepseekModel) -> None:
    """Fail at engine start, with a message naming the option, when ``model`` cannot run
    ``spec``."""
    if spec.method == "dspark":
        problem = supports_dspark(model)
        if problem is not None:
            raise EngineConfigError(f"speculative.method 'dspark': {problem}")
        B = model.cfg.dspark_block_size
        if spec.num_draft_tokens > B:
            raise EngineConfigError(
                f"speculative.num_draft_tokens {spec.num_draft_tokens} exceeds the checkpoint's "
                f"DSpark block of {B} drafts"
            )
        return
    raise EngineConfigError(f"speculative.method {spec.method!r} is not available")


def make_proposer(spec: SpeculativeConfig, model: DeepseekModel, pools: PagedKV) -> Proposer:
    """The proposer of ``spec`` for ``model`` over the engine's cache tensors."""
    check_speculation(spec, model)
    return DSparkProposer(model, pools)
