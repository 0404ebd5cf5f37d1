"""The PD metrics both sides of prefill/decode disaggregation count (named in
``app.deployments.pd``'s module doc): the ranks (``app.deployments.pd``) and the ingress
(``app.deployments.pd_client``); no torch and no API here."""

from __future__ import annotations

import logging
from collections import Counter

from ray.util.metrics import Counter as RayCounter
from ray.util.metrics import Histogram

logger = logging.getLogger(__name__)


class PDMetrics:
    """Ray metrics of PD transfers."""

    def __init__(self) -> None:
        self.bytes = RayCounter("fathom_pd_transfer_bytes", "KV state bytes sent / received",
                                tag_keys=("role",))  # fmt: skip
        self.seconds = Histogram(
            "fathom_pd_transfer_seconds", "KV state send (prefill) and receive (decode) time",
            boundaries=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
            tag_keys=("stage",),
        )
        self.handoffs = RayCounter("fathom_pd_handoffs", "KV states sent / imported",
                                   tag_keys=("role",))  # fmt: skip
        self.fallbacks = RayCounter(
            "fathom_pd_fallbacks", "Handed-off requests prefilled again on a decode rank",
            tag_keys=("reason",),
        )


def count_fallback(metrics: PDMetrics | None, counts: Counter, reason: str) -> None:
    counts[f"fallback_{reason}"] += 1
    if metrics is not None:
        try:
            metrics.fallbacks.inc(tags={"reason": reason})
        except Exception:  # metrics never fail a request
            logger.debug("PD fallback counter failed", exc_info=True)
