"""Two batcher replicas behind raygen's prefix router, started with `serve run` from a
config that also holds a one-replica application of the same model (the ideal: one
cache). Multi-turn sessions with long system prompts: the two replicas together cache
about what one would, both serve, and the answers are the ones transformers gives."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from transformers import AutoTokenizer

from benchmarks.sessions import Workload, requests_per_replica, run_sessions, serve_config
from tests.e2e.serving import BASE, serve_run
from tests.reference import hf_greedy

# Turns 2.5 s apart, and the router's memory of where it sent prefixes off (below): each
# later turn is routed by what the replicas reported (every second), so the test shows
# that replica and router compute the same block names in different processes.
WORKLOAD = Workload(sessions=8, turns=3, system_len=320, user_len=24, max_tokens=8, vocab=2048,
                    think_s=2.5)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    config = serve_config(llama_dir, 8000, {"one": (1, None),
                                            "two": (2, None, {"recent_ttl_s": 0.0})})
    log = tmp_path_factory.mktemp("routing") / "serve.log"
    with serve_run([], log, target=config, health_paths=("/one/health", "/two/health")):
        yield


@pytest.fixture(scope="module")
def sessions(server, llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    results = {name: asyncio.run(run_sessions(f"{BASE}/{name}", llama_dir, tokenizer, WORKLOAD))
               for name in ("one", "two")}
    return results, poll_metrics(f"{BASE}/two/metrics"), tokenizer


def poll_metrics(url: str, timeout: float = 30, until=None) -> str:
    """Replicas push their metrics every PUSH_PERIOD_S (2 s): wait until both batchers are
    listed (and `until(text)` holds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url, timeout=10).text
        done = len(requests_per_replica(text)) == 2 and (until is None or until(text))
        if done or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def decisions(metrics: str) -> dict[str, float]:
    found = re.findall(r'^raygen_router_decisions_total\{decision="(\w+)"\} (\S+)$', metrics, re.M)
    return {k: float(v) for k, v in found}


def test_two_replicas_cache_what_one_would(sessions):
    results, metrics, _ = sessions
    one, two = results["one"], results["two"]
    assert not one["errors"] and not two["errors"], (one["errors"], two["errors"])
    assert one["requests"] == two["requests"] == WORKLOAD.sessions * WORKLOAD.turns
    # Every later turn resends its session's history: most of it is cached on one replica.
    assert one["cached_tokens"] >= 0.5 * one["prompt_tokens"]
    assert two["cached_tokens"] >= 0.9 * one["cached_tokens"], (two["cached_tokens"],
                                                                one["cached_tokens"])


def test_both_replicas_serve_and_the_router_reports(sessions):
    _, metrics, _ = sessions
    per_replica = requests_per_replica(metrics)
    assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values()), per_replica
    assert decisions(metrics).get("prefix", 0) > 0, decisions(metrics)
    # The ingress got each replica's outputs through a channel to that replica.
    for name in ("messages", "outputs"):
        pattern = rf'^raygen_output_channel_{name}_total\{{replica="([^"]+)"\}} (\S+)$'
        found = dict(re.findall(pattern, metrics, re.M))
        assert found.keys() == per_replica.keys(), (name, found)
        assert all(float(v) > 0 for v in found.values()), (name, found)


def test_the_router_changes_where_never_what(sessions, llama_dir):
    results, _, tokenizer = sessions
    one, two = results["one"]["turns"], results["two"]["turns"]
    assert [t.text for t in one] == [t.text for t in two]
    for turn in two[:WORKLOAD.turns]:  # one whole session, against transformers
        expected = hf_greedy(llama_dir, turn.prompt, WORKLOAD.max_tokens)
        assert turn.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_several_calls_of_one_request_are_all_routed(sessions, llama_dir):
    """n > 1 and best_of make several batcher calls inside one HTTP request (one Serve
    internal request id): each gets a replica."""
    prompt = sessions[0]["two"]["turns"][0].prompt
    r = httpx.post(f"{BASE}/two/v1/completions", timeout=120, json={
        "model": llama_dir, "prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 0.8,
        "seed": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    r = httpx.post(f"{BASE}/two/generate", timeout=120, json={
        "inputs": "Kari", "parameters": {"max_new_tokens": 6, "best_of": 2, "do_sample": True,
                                         "details": True}})
    assert r.status_code == 200 and len(r.json()["details"]["best_of_sequences"]) == 1


def test_a_busy_holder_shares_its_prefix_past_the_margin(sessions, llama_dir):
    """24 requests at once, all starting with session 0's prompt (held by one replica):
    the holder takes them until it serves 8 more than the other, then the other does.
    Whether Serve routes the burst in one pass or as it comes (timing), and however early
    the model would stop (`ignore_eos`), the holder gets busier than the margin."""
    results, _, _ = sessions
    prefix = results["two"]["turns"][WORKLOAD.turns - 1].prompt
    before = httpx.get(f"{BASE}/two/metrics", timeout=10).text
    counts, looked_up = decisions(before), requests_per_replica(before)

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(f"{BASE}/two/v1/completions", json={
                "model": llama_dir, "prompt": prefix + [100 + i], "max_tokens": 200,
                "temperature": 0, "ignore_eos": True}) for i in range(24)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))

    def served_both(text):
        return (sum(decisions(text).values()) >= sum(counts.values()) + 24
                and all(v > looked_up.get(k, 0) for k, v in requests_per_replica(text).items()))

    after = poll_metrics(f"{BASE}/two/metrics", until=served_both)
    moved = {k: v - counts.get(k, 0) for k, v in decisions(after).items()}
    assert moved.get("prefix", 0) >= 8 and moved.get("balance", 0) >= 1, moved
    # A balance decision sends the request to the other replica: both served the burst.
    assert served_both(after), (looked_up, requests_per_replica(after))
