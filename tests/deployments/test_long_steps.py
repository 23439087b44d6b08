"""A step's duration is never a failure: steps made longer on purpose than every deadline the
step path ever had (a test double, tests/doubles.py: each shard sleeps before a step that
admits requests) complete at tensor_parallel_size=2 (compiled graph) and at TP=1 with
one thread (actor calls), while Serve health-checks the replica and /health is asked."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray
from ray import serve
from transformers import AutoTokenizer

from deployments.app import build_app
from deployments.config import AppArgs
from tests.doubles import slow_steps_runtime_env
from tests.reference import hf_greedy

pytestmark = pytest.mark.integration  # Ray in the test process

PORT = 8126
BASE = f"http://127.0.0.1:{PORT}"
# Longer than the old deadlines: the watchdog interval (1 s), the shard health-check call
# (10 s, queued behind the step) and Ray's compiled-graph read (RAY_CGRAPH_get_timeout, 10 s);
# Serve health-checks the batcher replica every 2 s (health_check_period_s), five times a step.
LONG_STEP_S = 11.0
APPS = {"tp2": {"tensor_parallel_size": 2}, "tp1": {"cpu_threads": 1}}


@pytest.fixture(scope="module")
def apps(llama_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env=slow_steps_runtime_env({llama_dir: LONG_STEP_S}))
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run_many([  # deployed together: their replicas start side by side
        serve.RunTarget(build_app(AppArgs(model=llama_dir, num_blocks=256, **knobs)),
                        name=name, route_prefix=f"/{name}") for name, knobs in APPS.items()])
    yield
    serve.shutdown()
    ray.shutdown()


def test_long_steps_complete_equal_transformers_and_health_stays_200(apps, llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompts = ["Tona sefi mole dasu kari", "Zuti guyoyi fiul eesordi"]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            requests = asyncio.gather(*(
                client.post(f"{BASE}/{app}/generate", json={
                    "inputs": p, "parameters": {"max_new_tokens": 8, "details": True}})
                for app in APPS for p in prompts))
            health = []
            while not requests.done():
                for app in APPS:
                    health.append((await client.get(f"{BASE}/{app}/health")).status_code)
                await asyncio.sleep(1)
            return await requests, health

    responses, health = asyncio.run(main())
    assert len(health) >= 2 * LONG_STEP_S / 2 and set(health) == {200}, health
    expected = [hf_greedy(llama_dir, tokenizer(p).input_ids, 8) for p in prompts]
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        assert [t["id"] for t in response.json()["details"]["tokens"]] == expected[i % 2]
    for app in APPS:
        assert httpx.get(f"{BASE}/{app}/health", timeout=15).status_code == 200
        stats = serve.get_deployment_handle("Batcher", app_name=app).stats.remote().result()
        assert stats["healthy"] and stats["integrity"] == "ok"
        assert stats["kv_blocks_used"] == 0
