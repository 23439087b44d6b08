"""Autoscaling on a local two-node Ray cluster (the second node has two logical GPUs):
load scales the batcher from one replica to two, quiet scales it back to one, and no
request fails throughout, including streams on the replica that goes away."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import ray
from ray import serve
from ray._common.utils import get_default_ray_temp_dir
from ray.cluster_utils import Cluster

from deployments.app import BatcherDeployment
from deployments.config import AppArgs
from deployments.ingress import Ingress

pytestmark = pytest.mark.integration  # Ray in the test process

PORT = 8127
BASE = f"http://127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    # Cluster writes the head's address to the default temp dir's ray_current_cluster
    # whatever temp_dir says, and fails where that dir does not exist yet (a fresh CI
    # machine, where this is the suite's first Ray start).
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "temp_dir": str(tmp_path_factory.mktemp("ray"))})
    cluster.add_node(num_cpus=1, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def num_running_replicas() -> int:
    status = serve.status().applications["scale"].deployments["Batcher"]
    return status.replica_states.get("RUNNING", 0)


def wait_replicas(n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while num_running_replicas() != n:
        assert time.monotonic() - t0 < timeout, f"not {n} replicas after {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - t0


def load_until_replicas(n: int, timeout: float, stop: threading.Event, worker, args: list,
                        join_s: float) -> tuple[float, list[threading.Thread]]:
    """Run worker(*a) for each a in args on threads until the app has n replicas, then
    stop them; returns the time it took and the (joined) threads."""
    threads = [threading.Thread(target=worker, args=a) for a in args]
    for t in threads:
        t.start()
    try:
        return wait_replicas(n, timeout), threads
    finally:
        stop.set()
        for t in threads:
            t.join(join_s)


def test_scales_out_under_load_and_back_in_without_failures(cluster, llama_dir):
    args = AppArgs(model=llama_dir, device="cuda", num_blocks=512, max_concurrent_requests=256)
    batcher = BatcherDeployment.options(
        ray_actor_options={"num_cpus": 0.1}, placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy="STRICT_PACK", graceful_shutdown_timeout_s=120,
        autoscaling_config={"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                            "target_ongoing_requests": 4, "metrics_interval_s": 0.5,
                            "look_back_period_s": 2, "upscale_delay_s": 1,
                            "downscale_delay_s": 4}).bind(args)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(Ingress.options(ray_actor_options={"num_cpus": 0}).bind(batcher, args),
              name="scale", route_prefix="/")
    assert num_running_replicas() == 1

    results: list[tuple[int, bool]] = []
    stop = threading.Event()

    def stream_loop(max_new_tokens: int):
        while not stop.is_set():
            with httpx.stream("POST", BASE + "/generate_stream", timeout=120, json={
                    "inputs": "kari tona", "parameters": {"max_new_tokens": max_new_tokens}}) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        last = line
                results.append((r.status_code, last is not None and '"details": {' in last))

    up, heavy = load_until_replicas(2, 90, stop, stream_loop, [(150,)] * 8, join_s=120)
    # Quiet (below target), but two streams run back to back through the scale-in, so
    # the replica that goes away is serving one when it is told to stop.
    stop.clear()
    tails = [threading.Thread(target=stream_loop, args=(400,)) for _ in range(2)]
    for t in tails:
        t.start()
    down = wait_replicas(1, timeout=90)
    time.sleep(2)
    stop.set()
    for t in tails:
        t.join(180)
    assert not any(t.is_alive() for t in heavy + tails)
    assert results and all(status == 200 and complete for status, complete in results), \
        [r for r in results if r != (200, True)][:5]
    assert len(results) >= 18
    print(f"scaled out in {up:.1f} s, back in {down:.1f} s, {len(results)} requests, 0 failed")


def test_llm_load_policy_scales_on_queued_prompt_tokens(cluster, llama_dir):
    """Long prompts, few of them: 10 requests in flight against a target of 1,000 ongoing
    requests a replica, so Serve's default policy stays at one replica; the LLM-load policy
    sees the queued prompt tokens, scales to two, and back to one once the burst ends."""
    from deployments.autoscaling import POLICY_PATH
    from tests.reference import make_prompts

    args = AppArgs(model=llama_dir, device="cuda", num_blocks=1024, max_concurrent_requests=256,
                   max_batch_prefill_tokens=2048)
    batcher = BatcherDeployment.options(
        name="Batcher", ray_actor_options={"num_cpus": 0.1},
        placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy="STRICT_PACK", graceful_shutdown_timeout_s=120,
        autoscaling_config={"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                            "target_ongoing_requests": 1000, "metrics_interval_s": 0.5,
                            "look_back_period_s": 2,
                            "upscale_delay_s": 1, "downscale_delay_s": 4,
                            "policy": {"policy_function": POLICY_PATH,
                                       "policy_kwargs": {"target_queued_tokens": 2048}}}
    ).bind(args)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(Ingress.options(ray_actor_options={"num_cpus": 0}).bind(batcher, args),
              name="scale", route_prefix="/")
    assert num_running_replicas() == 1
    results: list[int] = []
    stop = threading.Event()

    def burst(i: int):
        seed = 1000 * i
        while not stop.is_set():  # a fresh prompt each time: nothing comes from the cache
            seed += 1
            r = httpx.post(BASE + "/v1/completions", timeout=300, json={
                "model": llama_dir, "prompt": make_prompts(2048, [1600], seed=seed)[0],
                "max_tokens": 4, "temperature": 0})
            results.append(r.status_code)

    up, _ = load_until_replicas(2, 120, stop, burst, [(i,) for i in range(10)], join_s=300)
    down = wait_replicas(1, timeout=120)
    assert results and all(code == 200 for code in results), sorted(set(results))
    print(f"LLM-load policy: scaled out in {up:.1f} s, back in {down:.1f} s, "
          f"{len(results)} requests, 0 failed")
