"""Metrics under TGI's names (so TGI dashboards carry over), plus what TGI lacks.

Each metric is recorded once and exported twice: through `ray.serve.metrics` to Ray's
Prometheus export and the dashboard's Grafana (tagged with application, deployment and
replica; Ray prefixes the names with `ray_`), and into a process-local prometheus_client
registry that `GET /metrics` renders in Prometheus text under the plain TGI names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import prometheus_client as prom

prom.disable_created_metrics()  # no *_created series: TGI dashboards do not expect them

# Seconds: from a millisecond decode step to a multi-minute request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DRAFT_BUCKETS = (0.5, 1, 2, 3, 4, 6, 8, 12, 16)  # Ray takes no 0: zeros fall under 0.5


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # counter | gauge | histogram
    help: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS


INGRESS = {
    "tgi_request_count": Spec("counter", "Requests received"),
    "tgi_request_success": Spec("counter", "Requests that generated to the end"),
    "tgi_request_failure": Spec("counter", "Requests that failed, by error type", ("err",)),
    "tgi_request_duration": Spec("histogram", "End-to-end request time (s)"),
    "tgi_request_validation_duration": Spec("histogram", "Validation time (s)"),
    "tgi_request_queue_duration": Spec("histogram", "Time waiting for a batch (s)"),
    "tgi_request_inference_duration": Spec("histogram", "Time generating (s)"),
    "tgi_request_mean_time_per_token_duration": Spec("histogram", "Mean time per token (s)"),
    "tgi_request_input_length": Spec("histogram", "Prompt tokens", (), TOKEN_BUCKETS),
    "tgi_request_generated_tokens": Spec("histogram", "Generated tokens", (), TOKEN_BUCKETS),
    "tgi_request_skipped_tokens": Spec("histogram", "Speculated tokens: the draft tokens "
                                       "kept in each step of a request", (), DRAFT_BUCKETS),
    "raygen_time_to_first_token_seconds": Spec("histogram", "Time to first token (s)"),
    "raygen_inter_token_latency_seconds": Spec("histogram", "Time between streamed tokens (s)"),
    "raygen_ingress_in_flight_requests": Spec("gauge", "Requests this ingress is serving"),
}

BATCHER = {
    "tgi_batch_current_size": Spec("gauge", "Requests in the running batch"),
    "tgi_batch_current_max_tokens": Spec("gauge", "KV slots of the batch"),
    "tgi_queue_size": Spec("gauge", "Requests waiting for a batch"),
    "tgi_batch_inference_count": Spec("counter", "Engine steps, by kind", ("method",)),
    "tgi_batch_forward_duration": Spec("histogram", "Engine step time (s), by kind", ("method",)),
    "tgi_batch_concat": Spec("counter", "New requests joining a running batch", ("reason",)),
    "raygen_kv_blocks_used": Spec("gauge", "KV cache blocks in use"),
    "raygen_kv_blocks_capacity": Spec("gauge", "KV cache blocks"),
    "raygen_prefix_cache_queries": Spec("counter", "Prompt tokens looked up in the prefix cache"),
    "raygen_prefix_cache_hits": Spec("counter", "Prompt tokens served from the prefix cache"),
    "raygen_preemptions": Spec("counter", "Requests preempted for KV space (recomputed later)"),
    "raygen_aborted_requests": Spec("counter", "Requests aborted (client gone, deadline)"),
    "raygen_speculation_draft_tokens": Spec("counter", "Draft tokens computed (prompt lookup)"),
    "raygen_speculation_accepted_tokens": Spec("counter", "Draft tokens kept: each one a "
                                               "token that took no step of its own"),
    # Output channels (deployments/channels.py): outputs per message is the batching.
    "raygen_output_channel_messages": Spec("counter", "Messages sent to ingress replicas "
                                           "through output channels (one per step each)"),
    "raygen_output_channel_outputs": Spec("counter", "Generation outputs those messages carried"),
    # What the LLM-load autoscaling policy reads (deployments/autoscaling.py).
    "raygen_queued_prompt_tokens": Spec("gauge", "Prompt tokens waiting to be prefilled"),
    "raygen_oldest_wait_seconds": Spec("gauge", "Age of the oldest waiting request (s)"),
}

# Recorded by the batcher's request router, in each ingress process (deployments/routing.py).
ROUTER = {
    "raygen_router_decisions": Spec(
        "counter", "Batcher routing decisions: prefix (to the longest cached prefix), "
        "balance (its holder too busy or full), fallback (no prefix known, no stats)",
        ("decision",)),
}

ALL = {**INGRESS, **BATCHER, **ROUTER}


class Metrics:
    """One component's metrics, recorded to Ray and to a local registry at once."""

    def __init__(self, specs: dict[str, Spec]):
        self.registry = prom.CollectorRegistry()
        self._local: dict[str, Any] = {}
        self._ray: dict[str, Any] = {}
        try:
            from ray.serve import metrics as serve_metrics
        except ImportError:  # pragma: no cover - ray is a dependency
            serve_metrics = None
        for name, spec in specs.items():
            if spec.kind == "counter":
                self._local[name] = prom.Counter(name, spec.help, spec.tags, registry=self.registry)
            elif spec.kind == "gauge":
                self._local[name] = prom.Gauge(name, spec.help, spec.tags, registry=self.registry)
            else:
                self._local[name] = prom.Histogram(name, spec.help, spec.tags,
                                                   buckets=spec.buckets, registry=self.registry)
            if serve_metrics is not None:
                cls = {"counter": serve_metrics.Counter, "gauge": serve_metrics.Gauge,
                       "histogram": serve_metrics.Histogram}[spec.kind]
                kwargs = {"boundaries": list(spec.buckets)} if spec.kind == "histogram" else {}
                self._ray[name] = cls(name, description=spec.help, tag_keys=spec.tags, **kwargs)

    def _pair(self, name: str, tags: dict[str, str] | None):
        local = self._local[name]
        return (local.labels(**tags) if tags else local), self._ray.get(name)

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value <= 0:
            return
        local, remote = self._pair(name, tags)
        local.inc(value)
        if remote is not None:
            remote.inc(value, tags=tags)

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        local, remote = self._pair(name, tags)
        local.set(value)
        if remote is not None:
            remote.set(value, tags=tags)

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        local, remote = self._pair(name, tags)
        local.observe(value)
        if remote is not None:
            remote.observe(value, tags=tags)

    def text(self) -> str:
        return prom.generate_latest(self.registry).decode()
