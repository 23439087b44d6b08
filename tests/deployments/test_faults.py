"""Faults and overload on a live Serve app: disconnect storms, KV exhaustion, deadlines,
steps longer than every deadline, a shard or a whole batcher replica dying. Nothing
accepted may hang or vanish."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from deployments.config import AppArgs
from deployments.ingress import HEALTH_TIMEOUT_S
from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.doubles import set_slow_steps, slow_model, slow_steps_runtime_env
from tests.reference import hf_greedy

pytestmark = pytest.mark.integration  # Ray in the test process

PORT = 8124
BASE = f"http://127.0.0.1:{PORT}"


# The owner apps' shards sleep this long before each step that admits requests
# (tests/doubles.py), but in the long-step test.
OWNER_STEP_S = 2.0
# Longer than the old deadlines: the watchdog interval (1 s), the shard health-check call
# (10 s, queued behind the step) and Ray's compiled-graph read (RAY_CGRAPH_get_timeout, 10 s);
# Serve health-checks the batcher replica every 2 s (health_check_period_s), five times a step.
LONG_STEP_S = 11.0
SLOW: dict = {}  # "model": the slow model's path; "delays": the file of its delay


@pytest.fixture(scope="module")
def apps(llama_dir, tmp_path_factory):
    slow = SLOW["model"] = slow_model(llama_dir, tmp_path_factory.mktemp("slow"))
    delays = SLOW["delays"] = tmp_path_factory.mktemp("slow-steps") / "delays.json"
    set_slow_steps(delays, {slow: OWNER_STEP_S})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env=slow_steps_runtime_env(delays))
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    specs = [
        ("faults", "/", AppArgs(model=llama_dir, max_concurrent_requests=512, num_blocks=1024,
                                max_total_tokens=512)),
        ("kv", "/kv", AppArgs(model=llama_dir, num_blocks=32, max_total_tokens=128)),
        ("slow", "/slow", AppArgs(model=llama_dir, request_timeout=1.0, num_blocks=512)),
    ]
    # An app per step pipeline depth, slow admitting steps: one step in flight (TP=2, a
    # compiled graph) and two (TP=1 on one thread, async scheduling).
    for mode, knobs in (("sync", {"tensor_parallel_size": 2}), ("async", {"cpu_threads": 1})):
        specs.append((f"owner-{mode}", f"/owner-{mode}",
                      AppArgs(model=slow, num_blocks=256, **knobs)))
    # Deployed together: their replicas start side by side instead of one app after another.
    serve.run_many([serve.RunTarget(build_app(args), name=name, route_prefix=prefix)
                    for name, prefix, args in specs])
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, num_blocks=1024)


def stats(app: str) -> dict:
    return serve.get_deployment_handle("Batcher", app_name=app).stats.remote().result()


def wait_for_free_blocks(app: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    s = stats(app)
    while s["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
        s = stats(app)
    return s


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def test_disconnect_storm(apps, offline, tokenizer):
    rng = random.Random(7)
    prompts = [f"kari tona {i} sefi" for i in range(200)]
    lengths = [rng.randint(8, 24) for _ in prompts]
    close_after = {i: rng.randint(1, 6) for i in rng.sample(range(200), 100)}

    async def one(client: httpx.AsyncClient, i: int) -> list[dict]:
        got = []
        async with client.stream("POST", BASE + "/generate_stream", json={
                "inputs": prompts[i], "parameters": {"max_new_tokens": lengths[i]}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    got.append(json.loads(line[5:]))
                    if len(got) == close_after.get(i, -1):
                        break
        return got

    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(main())
    kept = [i for i in range(200) if i not in close_after]
    expected = offline.generate([prompts[i] for i in kept],
                                [SamplingParams(max_new_tokens=lengths[i]) for i in kept])
    for i, ref in zip(kept, expected, strict=True):
        assert all("token" in e for e in results[i]), (i, results[i][-1])
        assert [e["token"]["id"] for e in results[i]] == ref.token_ids, i
        assert results[i][-1]["details"]["finish_reason"] in ("length", "eos_token")
    s = wait_for_free_blocks("faults")
    assert s["kv_blocks_used"] == 0
    assert s["integrity"] == "ok"
    assert s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_client_whose_request_started_the_step_loop_leaving_fails_no_one_else(
        apps, offline, mode):
    """The step loop starts inside the first request's call. When that client leaves, Serve
    cancels its call, and Ray cancels every call made in its context with it: the step loop
    must not run in that context, or the shard steps in flight (running or queued) fail
    every request in them. Here the first client leaves during a 2 s step admitting B."""
    app = f"/owner-{mode}"

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", BASE + app + "/generate_stream", json={
                    "inputs": "kari tona", "parameters": {"max_new_tokens": 400}}) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()  # held, so the stream stays open after the break
                async for line in lines:
                    if line.startswith("data:"):
                        break  # the loop runs: send B, then leave while B's step runs
                other = asyncio.ensure_future(client.post(BASE + app + "/generate", json={
                    "inputs": "mole dasu sefi", "parameters": {"max_new_tokens": 8,
                                                               "details": True}}))
                await asyncio.sleep(1.0)
            return await other

    response = asyncio.run(main())
    assert response.status_code == 200, response.text
    expected = offline.generate(["mole dasu sefi"], SamplingParams(max_new_tokens=8))[0]
    assert [t["id"] for t in response.json()["details"]["tokens"]] == expected.token_ids
    s = wait_for_free_blocks(f"owner-{mode}")
    assert s["kv_blocks_used"] == 0 and s["integrity"] == "ok" and s["healthy"]
    assert s["aborted"] >= 1  # the first client's request, ended by its leaving
    # B's outputs came through the output channel that the first client's request opened:
    # that channel too outlives the request whose call happened to open it.
    assert s["output_channels"]["tokens"] >= 8, s["output_channels"]


def test_long_steps_complete_equal_transformers_and_health_stays_200(apps, llama_dir,
                                                                     tokenizer):
    """A step's duration is never a failure: steps longer than every deadline the step path
    ever had complete at tensor_parallel_size=2 (compiled graph) and at TP=1 on one thread
    (actor calls), while Serve health-checks the replica and /health is asked."""
    prompts = ["Tona sefi mole dasu kari", "Zuti guyoyi fiul eesordi"]
    owners = ("owner-sync", "owner-async")

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            requests = asyncio.gather(*(
                client.post(f"{BASE}/{app}/generate", json={
                    "inputs": p, "parameters": {"max_new_tokens": 8, "details": True}})
                for app in owners for p in prompts))
            health = []
            while not requests.done():
                for app in owners:
                    health.append((await client.get(f"{BASE}/{app}/health")).status_code)
                await asyncio.sleep(1)
            return await requests, health

    set_slow_steps(SLOW["delays"], {SLOW["model"]: LONG_STEP_S})
    try:
        responses, health = asyncio.run(main())
    finally:
        set_slow_steps(SLOW["delays"], {SLOW["model"]: OWNER_STEP_S})
    assert len(health) >= 2 * LONG_STEP_S / 2 and set(health) == {200}, health
    expected = [hf_greedy(llama_dir, tokenizer(p).input_ids, 8) for p in prompts]
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        assert [t["id"] for t in response.json()["details"]["tokens"]] == expected[i % 2]
    for app in owners:
        assert httpx.get(f"{BASE}/{app}/health", timeout=15).status_code == 200
        s = stats(app)
        assert s["healthy"] and s["integrity"] == "ok"
        assert s["kv_blocks_used"] == 0


def generate_all(prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*[client.post(BASE + "/generate", json={
                "inputs": p, "parameters": {"max_new_tokens": max_new_tokens, "details": True}})
                for p in prompts])
        for r in responses:
            assert r.status_code == 200, r.text
        return [[t["id"] for t in r.json()["details"]["tokens"]] for r in responses]

    return asyncio.run(main())


def wait_for_channels(app: str, condition, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not condition(channels := stats(app)["output_channels"]):
        assert time.monotonic() < deadline, channels
        time.sleep(0.1)
    return channels


def test_a_steps_outputs_cross_to_the_ingress_in_one_message(apps, offline):
    """With a channel open, every output of a generation goes through it, and one
    message carries a step's outputs for all of the ingress's generations."""
    assert generate_all(["tona kari"], 4)  # a generation on the replica asks for the channel
    before = wait_for_channels("faults", lambda c: c["open"] == 1, 10)
    prompts = [f"sefi kari {i} mole" for i in range(16)]
    got = generate_all(prompts, 16)
    after = stats("faults")["output_channels"]
    expected = offline.generate(prompts, SamplingParams(max_new_tokens=16))
    assert got == [e.token_ids for e in expected]
    outputs = after["outputs"] - before["outputs"]
    messages = after["messages"] - before["messages"]
    assert after["tokens"] - before["tokens"] == sum(len(ids) for ids in got)  # all this way
    assert messages * 4 <= outputs, (messages, outputs)  # 16 at once: many per message


def test_an_idle_channel_ends_and_the_next_generation_opens_it_again(apps, offline):
    from deployments.batcher import CHANNEL_IDLE_S

    idle = wait_for_channels("faults", lambda c: c["open"] == 0, CHANNEL_IDLE_S + 30)
    assert generate_all(["dasu tona"], 4)  # in its own call; asks for a channel again
    reopened = wait_for_channels("faults", lambda c: c["open"] == 1, 10)
    assert reopened["opened"] == idle["opened"] + 1
    got = generate_all(["mole sefi dasu"], 12)
    expected = offline.generate(["mole sefi dasu"], SamplingParams(max_new_tokens=12))[0]
    assert got == [expected.token_ids]
    assert stats("faults")["output_channels"]["tokens"] - reopened["tokens"] == len(got[0])


def test_kv_exhaustion_preempts_and_everything_finishes_correctly(apps, offline):
    prompts = [f"tona sefi mole {i}" for i in range(64)]

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(c.post(BASE + "/kv/generate", json={
                "inputs": p, "parameters": {"max_new_tokens": 60, "details": True}})
                for p in prompts))

    responses = asyncio.run(main())
    expected = offline.generate(prompts, SamplingParams(max_new_tokens=60))
    for response, ref in zip(responses, expected, strict=True):
        assert response.status_code == 200, response.text
        assert [t["id"] for t in response.json()["details"]["tokens"]] == ref.token_ids
    s = wait_for_free_blocks("kv")
    assert s["preemptions"] > 0 and s["kv_blocks_total"] == 32
    assert s["kv_blocks_used"] == 0 and s["integrity"] == "ok"


def test_request_timeout_ends_the_request_and_frees_blocks(apps):
    t0 = time.monotonic()
    r = httpx.post(BASE + "/slow/generate", timeout=60,
                   json={"inputs": "kari", "parameters": {"max_new_tokens": 2000}})
    assert r.status_code == 424
    assert r.json() == {"error": "request timed out after 1 s", "error_type": "generation"}
    assert time.monotonic() - t0 < 10
    assert wait_for_free_blocks("slow")["kv_blocks_used"] == 0


def shard_actor_names(app: str) -> list[tuple[str, str]]:
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted((a["name"], a["namespace"]) for a in actors
                  if a["name"].startswith(f"{app}-") and "-shard-" in a["name"])


def wait_until_serving(path: str, timeout: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            r = httpx.post(BASE + path, timeout=30,
                           json={"inputs": "kari", "parameters": {"max_new_tokens": 4}})
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{path} did not recover within {timeout} s")


def run_streams(n: int, path: str, max_new_tokens: int) -> tuple[list, threading.Event, list]:
    """n streams in threads; returns (results, 'all started' event, threads)."""
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]

    def one(i):
        lines = []
        try:
            body = {"inputs": f"mole dasu {i}", "parameters": {"max_new_tokens": max_new_tokens}}
            with httpx.stream("POST", BASE + path, timeout=60, json=body) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started[i].set()
            results[i] = ("ok", r.status_code, lines)
        except Exception as exc:
            results[i] = ("exception", type(exc).__name__, lines)
        finally:
            started[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    all_started = threading.Event()
    threading.Thread(target=lambda: ([e.wait(60) for e in started], all_started.set())).start()
    return results, all_started, threads


def test_shard_death_fails_streams_fast_then_a_fresh_replica_serves(apps):
    before = shard_actor_names("faults")
    assert before
    results, all_started, threads = run_streams(16, "/generate_stream", 400)
    assert all_started.wait(60)
    name, namespace = before[0]
    ray.kill(ray.get_actor(name, namespace=namespace))
    killed = time.monotonic()
    for t in threads:
        t.join(30)
    assert time.monotonic() - killed < 10 + 1  # joins return as the streams end
    failed = 0
    for kind, status, lines in results:
        assert kind == "ok" and status == 200
        last = events(lines)[-1]
        if (last.get("details") or {}).get("finish_reason") == "eos_token":
            continue  # it ended before the kill (a short greedy answer): nothing was lost
        assert last.get("error_type") == "generation" and "shard rank" in last["error"], last
        failed += 1
    assert failed >= len(results) // 2  # most were mid-stream: they end with the error
    # Until Serve replaces the replica, its health check fails: /health says so.
    deadline, health = time.monotonic() + 5, httpx.get(BASE + "/health", timeout=30)
    while health.status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.2)
        health = httpx.get(BASE + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["error_type"] == "healthcheck"
    took = wait_until_serving("/generate")
    assert took < 60
    after = shard_actor_names("faults")
    assert after and set(after).isdisjoint(before)  # new replica, new shards: no zombie


def batcher_replicas(app: str, timeout: float = 90) -> list[dict]:
    """The app's batcher replica actors, once only one is left: a replica that Serve
    replaced (the shard-death test's) can still be stopping when the next test starts
    (its graceful shutdown: up to 60 s), and it is still a named actor until it ends."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if f"{app}#Batcher" in a["name"]]
        if len(replicas) <= 1 or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


def test_batcher_replica_death_ends_requests_then_serves_again(apps):
    replicas = batcher_replicas("faults")
    assert len(replicas) == 1
    results, all_started, threads = run_streams(8, "/generate_stream", 400)
    assert all_started.wait(60)
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]),
             no_restart=True)
    # While Serve replaces the replica, /health says 503 within its own deadline: it does
    # not wait for the new replica and then answer 200.
    t0 = time.monotonic()
    health = httpx.get(BASE + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["error_type"] == "healthcheck"
    assert time.monotonic() - t0 < HEALTH_TIMEOUT_S + 3
    for t in threads:
        t.join(60)
    for kind, status, lines in results:
        # Each stream ends: with an error event, or with the connection closed by the proxy.
        assert kind in ("ok", "exception"), (kind, status)
        if kind == "ok" and events(lines):
            last = events(lines)[-1]
            assert last.get("error_type") == "generation" or last.get("details"), last
    assert not any(t.is_alive() for t in threads)
    assert wait_until_serving("/generate", timeout=90) < 90
