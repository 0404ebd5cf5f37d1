"""Serve autoscaling of the DP ranks on queue depth *and* KV usage.

Serve's default policy scales on ongoing requests per replica only. A rank's streams are its
queue depth (running + waiting), but a rank can be full long before that count is high:
long prompts fill its KV pool and new requests wait for blocks. Each rank therefore reports
``kv_usage`` (``DPRank.record_autoscaling_stats``), and the policy asks for

    replicas = max(ongoing / target_ongoing_requests,  n * mean(kv_usage) / target_kv_usage)

Serve's wrapper applies ``min_replicas`` / ``max_replicas``, the up/down-scaling factors and
the ``upscale_delay_s`` / ``downscale_delay_s`` hysteresis. A rank that leaves finishes its
streams first (Serve's graceful shutdown) and leaves the router's index (``DPRank.__del__``);
a new rank registers with its first report.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext


class RankPolicy:
    """The DPRank autoscaling policy (a class: Serve passes ``policy_kwargs`` to it)."""

    def __init__(self, target_kv_usage: float = 0.8) -> None:
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict]:
        """Desired DP ranks for ``ctx`` (see the module docstring)."""
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        by_queue = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        kv: dict[Any, float] = (ctx.aggregated_metrics or {}).get("kv_usage", {})
        by_kv = n * (sum(kv.values()) / len(kv)) / self.target_kv_usage if kv else 0.0
        return max(by_queue, by_kv), {}
