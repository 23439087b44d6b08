"""Kill after kill at tensor_parallel_size=2, through `serve run` and HTTP: streams in flight
end with an error event, the service answers again within 60 s with correct output, and a
short chaos run (benchmarks.soak --chaos) loses nothing and leaves no KV block in use."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from benchmarks.chaos import chaos, is_replica_of, server_processes, succeeded
from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.e2e.serving import BASE, serve_run

RECOVERY_LIMIT_S = 60
# How long after the kill a stream may still receive its last token from a step that ended
# before the kill (the step's outputs cross the batcher, ingress and proxy).
KILL_IN_FLIGHT_S = 1.0


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    # Serve's proxy actor (serve_throughput_mode=false). Under HAProxy this module failed 2
    # of 6 runs here (the short run once saw /health answer 200 throughout its kills), and
    # once a HAProxy reloaded for a replacement replica outlived `serve run` and kept port
    # 8000: Serve's HAProxy mode under replica kills is not yet characterised (README:
    # Failures and recovery).
    log = tmp_path_factory.mktemp("serve-tp2") / "serve.log"
    with serve_run([f"model={llama_dir}", "tensor_parallel_size=2", "num_blocks=1024",
                    "serve_throughput_mode=false"], log) as proc:
        yield proc


def stream(prompt: str, max_new_tokens: int, started: threading.Event, out: list) -> None:
    try:
        with httpx.stream("POST", BASE + "/generate_stream", timeout=120, json={
                "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out.append((time.monotonic(), json.loads(line[5:])))
                    started.set()
    finally:
        started.set()


def seconds_until_serving(since: float) -> float:
    while time.monotonic() - since < RECOVERY_LIMIT_S + 30:
        try:
            r = httpx.post(BASE + "/generate", timeout=60, json={
                "inputs": "kari", "parameters": {"max_new_tokens": 2}})
            if r.status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the service did not answer again")


def test_shard_sigkill_ends_streams_with_an_error_then_serves_correct_output(server, llama_dir):
    shards = server_processes(["shard"], under=server.pid)
    assert len(shards) == 2
    outs = [[] for _ in range(8)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream, args=(f"mole dasu {i}", 400, started[i], outs[i]))
               for i in range(len(outs))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    os.kill(shards[1][1], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    # Every stream ended and said how: one that reached EOS before the kill with its
    # details, every other one with the error naming the dead rank.
    errors = 0
    for out in outs:
        at, last = out[-1]
        # A step that ended before the kill may reach the client a moment after it (seen:
        # EOS received just after killed_at); nothing a shard computes later can end well.
        if last.get("details") and at < killed_at + KILL_IN_FLIGHT_S:
            continue
        assert "shard rank" in last.get("error", ""), last
        assert last["error_type"] == "generation"
        errors += 1
    assert errors >= len(outs) // 2
    assert seconds_until_serving(killed_at) < RECOVERY_LIMIT_S
    after = server_processes(["shard"], server.pid)
    assert {pid for _, pid in after}.isdisjoint(pid for _, pid in shards)

    offline = LLM(llama_dir, num_blocks=256)
    prompts = ["Tona sefi mole dasu", "東京 😀 café"]
    expected = offline.generate(prompts, SamplingParams(max_new_tokens=16))
    for prompt, ref in zip(prompts, expected, strict=True):
        r = httpx.post(BASE + "/generate", timeout=60, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}})
        assert [t["id"] for t in r.json()["details"]["tokens"]] == ref.token_ids
    assert httpx.get(BASE + "/health", timeout=15).status_code == 200


def test_short_chaos_run_loses_nothing(server):
    import asyncio

    result = asyncio.run(chaos(BASE, duration=5, concurrency=8, kill_every=(3, 6), max_kills=2,
                               targets=["shard", "batcher"], seed=11, under=server.pid))
    assert result["kills"] == 2
    assert succeeded(result), result  # 0 hung, 0 lost, every kill recovered, KV drained
    assert all(s < RECOVERY_LIMIT_S for s in result["recovery_s"]), result
    assert result["succeeded"] > 0 and result["failed_with_error"] > 0, result
    assert 0 < result["availability"] < 1, result
    assert result["sent"] == result["succeeded"] + result["failed_with_error"]


@pytest.mark.parametrize(("title", "deployment", "expected"), [
    ("ray::ServeReplica:default:Batcher", "Batcher", True),
    # while it runs a call (a streaming one lasts seconds): missed before, which failed
    # the replica-environment check of the end-to-end modules once
    ("ray::ServeReplica:default:Batcher.handle_request_with_rejection", "Batcher", True),
    ("ray::ServeReplica:my.app:Batcher", "Batcher", True),
    ("ray::ServeReplica:default:Ingress.handle_request", "Batcher", False),
    ("ray::ShardActor.step", "Batcher", False),
])
def test_replicas_are_found_by_title_idle_or_in_a_call(title, deployment, expected):
    assert is_replica_of(title, deployment) is expected
