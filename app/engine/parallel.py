"""One rank's place in an expert-parallel gang, as the engine uses it (no Ray: the
deployment joins the gang and hands this over; tests spawn the processes themselves).

Every rank of a gang runs every step: before each forward the ranks agree on the gang's
largest token count (one all-reduce, :meth:`EPGroup.agree`: it also picks the step's
dense or sized expert exchange); a rank without tokens then runs :meth:`idle_step` (the
same exchanges with none of its own) when another has some, so no collective waits for a
rank that skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.model.engram_place import DEFAULT_SHM_DIR, EngramBytes, EngramPlacement, place_engram
from app.model.ep import EPGroup, ExpertPlacement, ExpertShard
from app.model.model import DeepseekModel

IDLE_POLL_S = 0.005  # a gang with no work anywhere checks again this often


@dataclass
class RankParallel:
    """The gang (``group``), the expert placement and the Engram placement of one rank.
    ``keep``: objects that must live as long as the group (the rendezvous store)."""

    group: EPGroup
    placement: ExpertPlacement
    engram: EngramPlacement = "replicated"
    engram_key: str = "fathom-engram"
    shm_dir: str = DEFAULT_SHM_DIR
    keep: list[Any] = field(default_factory=list)
    engram_bytes: EngramBytes | None = None
    busy: bool = True  # whether any rank had tokens at the last step

    @property
    def shard(self) -> ExpertShard:
        return ExpertShard(self.placement, self.group.rank)

    def attach(self, model: DeepseekModel) -> None:
        """Join ``model`` (loaded with :attr:`shard`) to the gang and place its Engram."""
        model.set_ep(self.group, self.shard)
        self.engram_bytes = place_engram(
            model, self.engram, self.group, self.engram_key, self.shm_dir
        )

    def step(self, model: DeepseekModel, n_tokens: int, device: Any) -> None:
        """The gang's agreement before a forward of ``n_tokens`` (0: none here); a rank
        without tokens runs the idle step when another has some."""
        if not model.gang_exchanges:
            return
        self.busy = self.group.agree(n_tokens, device) > 0
        if self.busy and not n_tokens:
            model.idle_step()

    def idle_wait_s(self) -> float:
        """How long an engine loop with nothing to do waits before its next step."""
        return 0.0 if self.busy else IDLE_POLL_S
