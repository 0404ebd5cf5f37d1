"""Draft proposers: after a step, each speculating request gets up to k draft tokens for
positions anchor + 2 .. anchor + 1 + k, where ``anchor`` is its last committed position and
``bonus`` the token the step emitted at anchor + 1 (both device tensors: the step's accept
decision never reaches the host before the drafts are launched).

    DSparkProposer   V4.1: the checkpoint's DSpark stages (app.model.dspark) over a context
                     ring per stage and slot (``PagedKV.draft``), fed the target features of
                     committed rows (``observe``)
    MTPProposer      V4: the checkpoint's MTP block (app.model.mtp), one draft per step, over
                     a window ring per slot, fed the final streams and next tokens of
                     committed rows; the anchor row's streams come with ``propose``

Both also draft with :meth:`~DrafterProposer.block`: the same block with the draws left to
a ``pick`` of the caller's (the engine's draft step, ``app.engine.spec.step``, picks on the
device from static per-row settings, which a CUDA graph captures).

Test and benchmark proposers (the target's own continuation, random tokens) implement the
same protocol in ``bench/proposers.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from app.config import EngineConfig, EngineConfigError, SpeculativeConfig
from app.engine.request import SamplingParams
from app.engine.sampler import ProposalRows, add_bias
from app.model.dspark import DraftBlock, DSparkDrafter, supports_dspark
from app.model.kv_store import PagedKV
from app.model.model import DeepseekModel
from app.model.mtp import MTPDrafter, supports_mtp


class Proposer(Protocol):
    """What the engine needs of a drafter."""

    needs_features: bool  # the step must return the target features of its head rows
    needs_next_tokens: bool  # observe wants the token after each committed row

    def observe(
        self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
        next_tokens: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Committed rows of a step (``slots`` [N], trash slot = not committed), their draft
        features and the token after each row (``next_tokens`` [N])."""

    def propose(
        self,
        request_ids: Sequence[str],
        slots: torch.Tensor,
        anchors: torch.Tensor,
        bonus: torch.Tensor,
        num_drafts: int,
        params: Sequence[SamplingParams],
        first_output: torch.Tensor,
        features: torch.Tensor | None,
    ) -> DraftBlock:
        """``num_drafts`` drafts per request; ``first_output`` [R]: the output index of each
        request's first draft (seeded draws count from it); ``features``: the draft features
        of the anchor rows [R, F] (None when the step returned none)."""


# pick(k, logits [R, V] fp32) -> draft k of each request [R] (it may add to the logits in
# place: what it drew from is the proposal verification reads)
Pick = Callable[[int, torch.Tensor], torch.Tensor]


class DrafterProposer(ABC):
    """A proposer over the checkpoint's drafter: :meth:`propose` is :meth:`block` with the
    draws of ``draw_proposal`` (the rows' logit biases, then their settings)."""

    needs_features = True
    needs_next_tokens = False
    anchor_features = False  # block reads the features of the anchor rows
    feature_width = 0  # of the target features a step returns (the draft step's buffer)

    @abstractmethod
    def observe(self, slots, positions, features, next_tokens) -> None:
        """As :meth:`Proposer.observe`."""

    @abstractmethod
    def block(
        self, slots: torch.Tensor, anchors: torch.Tensor, bonus: torch.Tensor,
        features: torch.Tensor | None, num_drafts: int, pick: Pick,
    ) -> DraftBlock:  # fmt: skip
        """``num_drafts`` drafts per request drawn by ``pick`` (no host work: the engine's
        draft step captures it in a CUDA graph); arguments as :meth:`Proposer.propose`."""

    def propose(self, request_ids, slots, anchors, bonus, num_drafts, params, first_output,
                features):  # fmt: skip
        rows: list[ProposalRows] = []

        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:
            add_bias(logits, params)
            if not rows:
                rows.append(ProposalRows.of(params, logits.shape[1], logits.device))
            return rows[0].draw(logits, first_output + k)

        return self.block(slots, anchors, bonus, features, num_drafts, pick)


class DSparkProposer(DrafterProposer):
    """V4.1 DSpark over the engine's draft rings."""

    def __init__(self, model: DeepseekModel, pools: PagedKV) -> None:
        self.drafter = DSparkDrafter(model)
        if len(pools.draft) != len(self.drafter.stages):
            raise ValueError(
                f"the KV cache has {len(pools.draft)} draft rings for "
                f"{len(self.drafter.stages)} DSpark stages"
            )
        self.rings = pools.draft
        self.feature_width = len(model.cfg.dspark_target_layer_ids) * model.cfg.hidden_size

    def observe(self, slots, positions, features, next_tokens) -> None:
        self.drafter.write_context(self.rings, slots, features, positions)

    def block(self, slots, anchors, bonus, features, num_drafts, pick) -> DraftBlock:
        return self.drafter.draft(self.rings, slots, anchors, bonus, num_drafts, pick)


class MTPProposer(DrafterProposer):
    """V4 MTP-1 over the engine's draft ring (one draft per verify)."""

    needs_next_tokens = True
    anchor_features = True

    def __init__(self, model: DeepseekModel, pools: PagedKV) -> None:
        self.drafter = MTPDrafter(model)
        if len(pools.draft) != 1:
            raise ValueError(f"the KV cache has {len(pools.draft)} draft rings for one MTP block")
        self.ring = pools.draft[0]
        self.feature_width = model.cfg.hc_mult * model.cfg.hidden_size

    def observe(self, slots, positions, features, next_tokens) -> None:
        self.drafter.write_context(self.ring, slots, features, next_tokens, positions)

    def block(self, slots, anchors, bonus, features, num_drafts, pick) -> DraftBlock:
        if num_drafts != 1:
            raise ValueError(f"MTP drafts one token per verify, not {num_drafts}")
        logits = self.drafter.draft(self.ring, slots, anchors, features, bonus)
        ids = pick(0, logits)
        return DraftBlock(ids.unsqueeze(1), logits.unsqueeze(1), None)


def check_speculation(spec: SpeculativeConfig, model: DeepseekModel) -> None:
    """Fail at engine start, with a message naming the option, when ``model`` cannot run
    ``spec`` (its config: ``SpeculativeConfig.check_model``; or its weights)."""
    spec.check_model(model.cfg)
    problem = supports_dspark(model) if spec.method == "dspark" else supports_mtp(model)
    if problem is not None:
        raise EngineConfigError(f"speculative.method {spec.method!r}: {problem}")


def make_proposer(spec: SpeculativeConfig, model: DeepseekModel, pools: PagedKV) -> Proposer:
    """The proposer of ``spec`` for ``model`` over the engine's cache tensors."""
    check_speculation(spec, model)
    if spec.method == "dspark":
        return DSparkProposer(model, pools)
    return MTPProposer(model, pools)


def cache_extras(
    cfg: EngineConfig, model: DeepseekModel, own_drafter: bool = True
) -> tuple[int, int]:
    """-> (ring headroom, draft rings) of the cache layout: a verify of k drafts writes k
    rows past the window; the checkpoint's drafter keeps a context ring per draft stage
    (DSpark 3, MTP 1; none for a test proposer, ``own_drafter=False``)."""
    spec = cfg.speculative
    if spec is None:
        return 0, 0
    return spec.num_draft_tokens, (len(model.mtp) if own_drafter else 0)
