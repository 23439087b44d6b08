"""The cluster-level policies without a cluster: the prefix router's decision, the LLM-load
autoscaling policy beside Serve's default, and the merged /metrics text."""

from __future__ import annotations

import asyncio
import contextvars
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig

from deployments import metrics_hub, routing
from deployments.autoscaling import LLMLoadPolicy
from deployments.metrics_hub import Pusher, collect, render
from deployments.routing import PrefixIndex, pack_hashes
from engine.block_manager import BlockManager, prefix_block_hashes
from tests.reference import make_prompts

BS = 16
ROOT = Path(__file__).resolve().parents[2]


def replica_holding(prompts: list[list[int]], free_blocks: int = 1000, running: int = 0,
                    waiting: int = 0, age_s: float = 0.0) -> dict:
    """A replica's routing stats after it served `prompts`, from a real block manager."""
    bm = BlockManager(num_blocks=4096, block_size=BS)
    for i, prompt in enumerate(prompts):
        bm.allocate(f"r{i}", len(prompt))
        bm.cache_full_blocks(f"r{i}", prompt, len(prompt))
        bm.free(f"r{i}")
    return {"v": 1, "time": time.time() - age_s, "block_size": BS,
            "blocks": pack_hashes(bm.cached_names), "running": running, "waiting": waiting,
            "free_blocks": free_blocks}


@pytest.fixture()
def prompts():
    system = make_prompts(2048, [400], seed=1)[0]
    return {"system": system, "turn": system + make_prompts(2048, [40], seed=2)[0],
            "other": make_prompts(2048, [440], seed=3)[0]}


def test_adapter_prompts_route_by_their_own_chain_and_to_replicas_holding_the_adapter(
        prompts):
    """A LoRA adapter's blocks are named apart from the base model's (the same tokens
    under another adapter are other KV): the router matches a request's prefix under its
    adapter, and sends a request of an adapter some replicas hold to one of them (the others
    would load it first) unless they are busier than the margin."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    bm.allocate("a", len(prompts["turn"]))
    bm.cache_full_blocks("a", prompts["turn"], len(prompts["turn"]), namespace="sql@1")
    assert bm.get_computed_blocks(prompts["turn"])[1] == 0
    assert bm.get_computed_blocks(prompts["turn"], "sql@2")[1] == 0
    assert bm.get_computed_blocks(prompts["turn"], "sql@1")[1] == len(prompts["turn"]) - 8
    assert set(prefix_block_hashes(prompts["turn"], BS, "sql@1")) <= bm.cached_names

    index = PrefixIndex(imbalance_margin=4)
    a, b = replica_holding([prompts["turn"]]), replica_holding([])
    b["adapters"] = ["sql@1"]
    # The base model's prefix is on A; the adapter's request goes to B, which holds it.
    assert index.decide(prompts["turn"], {"A": a, "B": b}, {}) == ("prefix", "A")
    assert index.decide(prompts["turn"], {"A": a, "B": b}, {}, "sql@1") == ("adapter", "B")
    # Busier than the margin: any replica (here the prefix's holder is none, so the least busy).
    b["running"] = 6
    decision, chosen = index.decide(prompts["turn"], {"A": a, "B": b}, {}, "sql@1")
    assert (decision, chosen) == ("fallback", "A")
    # Every replica holds it (adapters named at start): the prefix decides, as without.
    a["adapters"], b["running"] = ["sql@1"], 0
    assert index.decide(prompts["turn"], {"A": a, "B": b}, {}, "sql@1")[0] == "fallback"


def test_router_chain_is_the_block_managers(prompts):
    bm = BlockManager(num_blocks=64, block_size=BS)
    bm.allocate("a", len(prompts["turn"]))
    bm.cache_full_blocks("a", prompts["turn"], len(prompts["turn"]))
    chain = prefix_block_hashes(prompts["turn"], BS)
    assert len(chain) == (len(prompts["turn"]) - 1) // BS
    assert set(chain) <= bm.cached_names
    bm.check_integrity()
    hits, _ = bm.get_computed_blocks(prompts["turn"])
    assert len(hits) == len(chain)


def test_routes_to_the_replica_holding_the_longest_prefix(prompts):
    index = PrefixIndex()
    stats = {"a": replica_holding([prompts["other"]]), "b": replica_holding([prompts["system"]]),
             "c": replica_holding([])}
    assert index.decide(prompts["turn"], stats, {}) == ("prefix", "b")
    # Equal prefixes: the less busy holder.
    stats["a"] = replica_holding([prompts["system"]], running=1)
    assert index.decide(prompts["turn"], stats, {"a": 3, "b": 5}) == ("prefix", "a")


def test_a_far_busier_holder_does_not_get_the_request(prompts):
    index = PrefixIndex(imbalance_margin=8)
    stats = {"a": replica_holding([prompts["system"]]), "b": replica_holding([])}
    assert index.decide(prompts["turn"], stats, {"a": 8, "b": 0}) == ("prefix", "a")
    assert index.decide(prompts["turn"], stats, {"a": 9, "b": 0}) == ("balance", "b")
    # Without the router's own counts, the replicas' reports decide.
    stats["a"] = replica_holding([prompts["system"]], running=20, waiting=4)
    assert index.decide(prompts["turn"], stats, {"a": None, "b": None}) == ("balance", "b")
    # A holder without the KV blocks for the rest of the prompt is skipped too, for the
    # least busy of the others.
    stats["a"] = replica_holding([prompts["system"]], free_blocks=1)
    stats["c"] = replica_holding([], running=2)
    assert index.decide(prompts["turn"], stats, {}) == ("balance", "b")


def test_a_burst_routed_before_any_send_still_spreads(prompts, monkeypatch):
    """Serve routes a burst of queued requests in one pass and counts each in a replica's
    load only once sent: the index counts those it gave out and Serve has not sent."""
    index = PrefixIndex(imbalance_margin=8)
    stats = {"a": replica_holding([prompts["system"]]), "b": replica_holding([])}
    loads = {"a": 0, "b": 0}  # Serve's counts, unchanged through the pass
    seen = []
    for _ in range(12):
        decision, replica = index.decide(prompts["turn"], stats, loads)
        seen.append(decision)
        assert replica == ("a" if decision == "prefix" else "b")
        index.chosen(replica)
    # The holder until it has 9 more than the other, then they alternate.
    assert seen == ["prefix"] * 9 + ["balance", "prefix", "balance"], seen
    # Once Serve has sent them they are its to count, not ours twice.
    for _ in range(10):
        index.sent("a")
    assert index.in_transit("a") == 0 and index.in_transit("b") == 2
    assert index.decide(prompts["turn"], stats, loads) == ("prefix", "a")
    # A request chosen but never sent (its caller gone) stops counting.
    monkeypatch.setattr(routing, "_IN_TRANSIT_TTL_S", 0.0)
    index.chosen("a")
    assert index.in_transit("a") == 0 and index.in_transit("b") == 0


def test_without_a_known_prefix_the_least_busy_else_serves_choice(prompts):
    index = PrefixIndex(stats_max_age_s=10)
    held = replica_holding([prompts["system"]])
    # No load known for some replica (no fresh report, no count of Serve's): Serve's choice.
    assert index.decide(prompts["turn"], {"a": None, "b": None}, {}) == ("fallback", None)
    assert index.decide(prompts["turn"], {"a": {}, "b": {"v": 0}}, {}) == ("fallback", None)
    old = replica_holding([prompts["system"]], age_s=11)
    assert index.decide(prompts["turn"], {"a": old, "b": None}, {}) == ("fallback", None)
    assert index.decide(prompts["other"], {"a": held, "b": None}, {}) == ("fallback", None)
    # Every load known, by Serve's count or a report: the least busy.
    assert index.decide(prompts["turn"], {"a": None, "b": None}, {"a": 3, "b": 1}) == (
        "fallback", "b")
    busy = replica_holding([prompts["system"]], running=2, waiting=1)
    assert index.decide(prompts["other"], {"a": busy, "b": replica_holding([])}, {}) == (
        "fallback", "b")
    assert index.decide(prompts["other"], {"a": busy, "b": None}, {"b": 4}) == (
        "fallback", "a")
    # Ties at random, so that the routers of several ingress replicas do not herd.
    picks = {index.decide(prompts["other"], {"a": held, "b": replica_holding([])}, {})[1]
             for _ in range(64)}
    assert picks == {"a", "b"}


def test_a_burst_of_new_prompts_routed_before_any_send_splits_evenly(prompts):
    """The same one-pass burst with no prefix known anywhere: Serve's power-of-two choice,
    blind to the requests not yet sent, would split it at random."""
    index = PrefixIndex()
    stats = {r: replica_holding([]) for r in "abc"}
    loads = {"a": 1, "b": 0, "c": 0}  # Serve's counts, unchanged through the pass
    given = {r: 0 for r in stats}
    for i in range(12):
        decision, replica = index.decide(make_prompts(2048, [40], seed=100 + i)[0], stats, loads)
        assert decision == "fallback"
        given[replica] += 1
        index.chosen(replica)
    # 13 requests in all on three replicas: never more than one apart.
    assert sorted(loads[r] + index.in_transit(r) for r in stats) == [4, 4, 5], given
    assert sum(given.values()) == 12 and given["a"] <= min(given["b"], given["c"]), given


def test_remembers_where_it_sent_a_prefix_until_reports_catch_up(prompts):
    index = PrefixIndex(recent_ttl_s=0.3)
    stats = {"a": replica_holding([]), "b": replica_holding([])}
    assert index.decide(prompts["turn"], stats, {})[0] == "fallback"
    index.remember("b", prompts["system"], BS)
    assert index.decide(prompts["turn"], stats, {}) == ("prefix", "b")
    time.sleep(0.4)
    assert index.decide(prompts["turn"], stats, {})[0] == "fallback"


def policy_context(queued_tokens: list[float], ongoing: float, kv_usage=None, wait=None,
                   preempted=None, target_ongoing: float = 64):
    replicas = range(len(queued_tokens))
    metrics = {"queued_tokens": dict(zip(replicas, queued_tokens, strict=True)),
               "kv_usage": dict(zip(replicas, kv_usage or [0.1] * len(queued_tokens), strict=True)),
               "queue_wait_s": dict(zip(replicas, wait or [0.0] * len(queued_tokens), strict=True)),
               "preempted_waiting": dict(zip(replicas, preempted or [0] * len(queued_tokens),
                                             strict=True))}
    config = AutoscalingConfig(min_replicas=1, max_replicas=4,
                               target_ongoing_requests=target_ongoing)
    return SimpleNamespace(current_num_replicas=len(queued_tokens),
                           target_num_replicas=len(queued_tokens), total_num_requests=ongoing,
                           aggregated_metrics=metrics, config=config, deployment_name="Batcher")


def test_policy_scales_on_queued_tokens_where_ongoing_requests_do_not():
    # A burst of 6 long prompts: 6 ongoing requests (far under 64 a replica), 24k tokens queued.
    ctx = policy_context([24_000], ongoing=6)
    default, _ = replica_queue_length_autoscaling_policy(ctx)
    ours, state = LLMLoadPolicy(target_queued_tokens=8192)(ctx)
    assert default < 1 and ours == pytest.approx(24_000 / 8192)
    assert max(state["signals"], key=state["signals"].get) == "queued_tokens"
    # Idle: both ask for less than one replica each (Serve's bounds and delays apply).
    assert LLMLoadPolicy()(policy_context([0, 0], ongoing=0))[0] < 1


def test_policy_scales_on_kv_pressure_and_waiting():
    policy = LLMLoadPolicy(target_kv_usage=0.8, target_queue_wait_s=5)
    assert policy(policy_context([0], ongoing=4, kv_usage=[0.96]))[0] == pytest.approx(1.2)
    assert policy(policy_context([0], ongoing=4, preempted=[2]))[0] == 2
    assert policy(policy_context([0, 0], ongoing=4, wait=[1, 10]))[0] == pytest.approx(4)
    with pytest.raises(ValueError):
        LLMLoadPolicy(target_queued_tokens=0)


def replica_registry(queue: float, requests: float, latencies: list[float]) -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("tgi_queue_size", "Requests waiting", registry=registry).set(queue)
    Counter("tgi_batch_inference_count", "Steps", ["method"], registry=registry).labels(
        method="decode").inc(requests)
    h = Histogram("tgi_batch_forward_duration", "Step time", buckets=(0.1, 1.0), registry=registry)
    for x in latencies:
        h.observe(x)
    return registry


def test_metrics_of_several_replicas_are_summed_and_kept_per_replica():
    text = render({"Batcher:a": collect(replica_registry(2, 10, [0.05, 0.5])),
                   "Batcher:b": collect(replica_registry(3, 5, [2.0]))})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("tgi_queue_size", ())] == 5
    assert samples[("tgi_queue_size", (("replica", "Batcher:a"),))] == 2
    assert samples[("tgi_batch_inference_count_total", (("method", "decode"),))] == 15
    assert samples[("tgi_batch_inference_count_total",
                    (("method", "decode"), ("replica", "Batcher:b")))] == 5
    assert samples[("tgi_batch_forward_duration_bucket", (("le", "1.0"),))] == 2
    assert samples[("tgi_batch_forward_duration_count", ())] == 3
    assert samples[("tgi_batch_forward_duration_sum", (("replica", "Batcher:b"),))] == 2.0


def test_pusher_outlives_a_hub_that_hangs_or_fails(monkeypatch):
    """A push that never returns (a hub not yet routable) or raises must not silence a
    replica's metrics for good: the next period pushes again."""
    monkeypatch.setattr(metrics_hub, "PUSH_PERIOD_S", 0.01)
    monkeypatch.setattr(metrics_hub, "PUSH_TIMEOUT_S", 0.05)
    received, calls = [], []

    class Hub:
        class report:
            @staticmethod
            def remote(source, families):
                calls.append(source)
                if len(calls) == 1:
                    return asyncio.get_running_loop().create_future()  # never resolves
                if len(calls) == 2:
                    raise ConnectionError("hub restarting")
                received.append(families)
                return asyncio.sleep(0)

    async def main():
        value = [1]
        pusher = Pusher(Hub, "Batcher:x", lambda: list(value))
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        value.append(2)  # a change goes out on the next period
        while len(received) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        pusher.stop()

    asyncio.run(main())
    assert calls[:3] == ["Batcher:x"] * 3
    assert received[:2] == [[1], [1, 2]]


def test_pushes_are_not_calls_of_the_request_that_started_the_pusher():
    """Started from whichever call comes first; its pushes must not carry that call's
    context (under Ray: be that task's children, cancelled when its client leaves)."""
    caller = contextvars.ContextVar("caller", default=None)
    seen = []

    class Hub:
        class report:
            @staticmethod
            def remote(source, families):
                seen.append(caller.get())
                return asyncio.sleep(0)

    async def main():
        caller.set("the first request")
        pusher = Pusher(Hub, "Batcher:x", lambda: [1])
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        pusher.stop()

    asyncio.run(main())
    assert seen and set(seen) == {None}


def test_block_names_are_the_same_in_every_process(prompts):
    """The router (in an ingress) reads names a replica computed in another process."""
    code = ("import json, sys; from engine.block_manager import prefix_block_hashes; "
            "print(json.dumps(prefix_block_hashes(json.loads(sys.argv[1]), 16)))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts["turn"])], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == prefix_block_hashes(prompts["turn"], BS)
