"""`serve run deployments.app:build_app model=...`: the builder starts Ray in Serve's
throughput mode itself (`serve_throughput_mode`), so this way in serves as the shipped
config does (test_serve_run.py runs the full client suite there); here, what differs."""

from __future__ import annotations

import os

import httpx
import pytest
from text_generation import Client

from benchmarks.disconnects import run_round
from engine.sampling_params import SamplingParams
from shards.offline import LLM
from tests.e2e.serving import BASE, listener, replica_environ, serve_run


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    assert not [k for k in os.environ if k.startswith("RAY_SERVE_")], "unset RAY_SERVE_*"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_run([f"model={llama_dir}", "num_blocks=1024"], log):
        yield log


def test_builder_starts_ray_in_throughput_mode(server):
    """HAProxy answers on port 8000, and every replica has both the mode (from the Ray
    instance that `serve run` started) and its in-process settings."""
    from deployments.app import REPLICA_ENV, THROUGHPUT_MODE_ENV

    assert listener(8000) == "haproxy"
    assert httpx.get(BASE + "/health", timeout=10).status_code == 200
    for deployment in ("Ingress", "Batcher", "Metrics"):
        environ = replica_environ(deployment)
        assert {k: environ.get(k) for k in REPLICA_ENV} == REPLICA_ENV, deployment
        assert {k: environ.get(k) for k in THROUGHPUT_MODE_ENV} == THROUGHPUT_MODE_ENV


def test_streams_equal_offline_and_leaving_clients_are_aborted(server, llama_dir):
    prompt = "Tona sefi mole dasu"
    expected = LLM(llama_dir, num_blocks=64).generate(
        [prompt], SamplingParams(max_new_tokens=12))[0].token_ids
    streamed = list(Client(BASE, timeout=60).generate_stream(prompt, max_new_tokens=12))
    assert [s.token.id for s in streamed] == expected
    result = run_round(BASE, streams=16)
    assert result.blocks_used == 0 and result.running == 0
    assert result.aborted == 16
