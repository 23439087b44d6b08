"""Prometheus text for GET /metrics, under TGI's metric names where TGI has one."""

from __future__ import annotations


def prometheus_text(stats: dict, in_flight: int) -> str:
    gauges = {
        "tgi_queue_size": ("Requests waiting for a batch", stats["num_waiting"]),
        "tgi_batch_current_size": ("Requests in the running batch", stats["num_running"]),
        "tgi_batch_current_max_tokens": ("KV slots of the batch", stats["max_batch_total_tokens"]),
        "raygen_kv_blocks_used": ("KV cache blocks in use", stats["kv_blocks_used"]),
        "raygen_kv_blocks_total": ("KV cache blocks", stats["kv_blocks_total"]),
        "raygen_ingress_in_flight_requests": ("Requests this ingress is serving", in_flight),
    }
    counters = {
        "raygen_prefix_cache_queries_total": ("Prompt tokens looked up", stats["prefix_cache_queries"]),
        "raygen_prefix_cache_hits_total": ("Prompt tokens served from cache", stats["prefix_cache_hits"]),
        "raygen_preemptions_total": ("Requests preempted for KV space", stats["preemptions"]),
        "raygen_aborted_requests_total": ("Requests aborted", stats["aborted"]),
    }
    lines = []
    for kind, table in (("gauge", gauges), ("counter", counters)):
        for name, (help_text, value) in table.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
