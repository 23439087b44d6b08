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

WORKLOAD = Workload(sessions=8, turns=3, system_len=320, user_len=24, max_tokens=8, vocab=2048)


@pytest.fixture(scope="module")
def sessions(llama_dir, tmp_path_factory):
    config = serve_config(llama_dir, 8000, {"one": (1, None), "two": (2, None)})
    log = tmp_path_factory.mktemp("routing") / "serve.log"
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with serve_run([], log, target=config, health_paths=("/one/health", "/two/health")):
        results = {name: asyncio.run(run_sessions(f"{BASE}/{name}", llama_dir, tokenizer, WORKLOAD))
                   for name in ("one", "two")}
        metrics = poll_metrics(f"{BASE}/two/metrics")
    return results, metrics, tokenizer


def poll_metrics(url: str, timeout: float = 30) -> str:
    """Replicas push their metrics every 0.5 s: wait until both batchers are listed."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url, timeout=10).text
        if len(requests_per_replica(text)) == 2 or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


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
    decisions = dict(re.findall(r'^raygen_router_decisions_total\{decision="(\w+)"\} (\S+)$',
                                metrics, re.M))
    assert float(decisions.get("prefix", 0)) > 0, decisions


def test_the_router_changes_where_never_what(sessions, llama_dir):
    results, _, tokenizer = sessions
    one, two = results["one"]["turns"], results["two"]["turns"]
    assert [t.text for t in one] == [t.text for t in two]
    for turn in two[:WORKLOAD.turns]:  # one whole session, against transformers
        expected = hf_greedy(llama_dir, turn.prompt, WORKLOAD.max_tokens)
        assert turn.text == tokenizer.decode(expected, skip_special_tokens=True)
