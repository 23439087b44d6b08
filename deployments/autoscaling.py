"""Autoscaling the batcher on an LLM's load, not only on ongoing requests.

Serve's default policy scales on ongoing requests per replica, which cannot tell 64 short
decodes from 64 long prefills, nor a replica with KV room from one preempting. This
policy reads what each replica reports through `record_autoscaling_stats`
(deployments/batcher.py), averaged by Serve over `look_back_period_s`:

  queued_tokens      prompt tokens waiting to be prefilled       target_queued_tokens
  queue_wait_s       age of the oldest waiting request            target_queue_wait_s
  kv_usage           share of KV blocks held by requests          target_kv_usage
  preempted_waiting  requests preempted for KV space, waiting     any: one replica more
  ongoing requests   Serve's own count (the default signal)       target_ongoing_requests

and asks for as many replicas as the most pressing signal needs (for a signal summed
over replicas, total / target). Serve then applies the config's upscale and downscale
delays, scaling factors and min/max bounds as for its own policy. Select it with
`autoscaling_config.policy`:

    autoscaling_config:
      policy:
        policy_function: deployments.autoscaling:LLMLoadPolicy
        policy_kwargs: {target_queued_tokens: 8192}
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("ray.serve")

POLICY_PATH = "deployments.autoscaling:LLMLoadPolicy"


class LLMLoadPolicy:
    def __init__(self, target_queued_tokens: float = 8192, target_queue_wait_s: float = 10.0,
                 target_kv_usage: float = 0.9, use_ongoing_requests: bool = True):
        if min(target_queued_tokens, target_queue_wait_s, target_kv_usage) <= 0:
            raise ValueError("autoscaling targets must be positive")
        self.target_queued_tokens = target_queued_tokens
        self.target_queue_wait_s = target_queue_wait_s
        self.target_kv_usage = target_kv_usage
        self.use_ongoing_requests = use_ongoing_requests

    def desired(self, current: int, metrics: dict[str, dict], ongoing: float,
                target_ongoing: float) -> tuple[float, dict[str, float]]:
        """Replicas each signal asks for, from per-replica averages; pure."""
        def values(name: str) -> list[float]:
            return list(metrics.get(name, {}).values())

        def total(name: str) -> float:
            return sum(values(name))

        signals = {
            "queued_tokens": total("queued_tokens") / self.target_queued_tokens,
            "queue_wait_s": max(values("queue_wait_s"), default=0.0) / self.target_queue_wait_s
            * current,
            "kv_usage": total("kv_usage") / self.target_kv_usage,
        }
        if total("preempted_waiting") > 0:  # out of KV space: more replicas, whatever else
            signals["preempted_waiting"] = current + 1
        if self.use_ongoing_requests and target_ongoing > 0:
            signals["ongoing_requests"] = ongoing / target_ongoing
        return max(signals.values()), signals

    def __call__(self, ctx) -> tuple[float, dict]:
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        desired, signals = self.desired(
            current, ctx.aggregated_metrics or {}, ctx.total_num_requests,
            ctx.config.get_target_ongoing_requests())
        if math.ceil(desired) != current:
            logger.info("autoscaling %s: %d -> %.2f replicas (%s)", ctx.deployment_name, current,
                        desired, ", ".join(f"{k} {v:.2f}" for k, v in signals.items()))
        return desired, {"signals": signals}
