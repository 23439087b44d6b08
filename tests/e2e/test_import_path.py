"""`serve run deployments.app:build_app model=...`: the builder starts Ray in Serve's
throughput mode itself (`serve_throughput_mode`), so this way in serves as the shipped
config does (test_serve_run.py runs the full client suite there); here, what differs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from text_generation import Client

from benchmarks.disconnects import run_round
from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.e2e.serving import BASE, ROOT, listener, replica_environ, serve_run


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


@pytest.mark.parametrize("args, line", [
    (["model=/no/such/model"], "raygen: model=/no/such/model: no such file or directory"),
    (["tensor_parallel_size=3"], "raygen: tensor_parallel_size=3: the model's 4 attention "
                                 "heads (2 key/value heads) do not split over 3 ranks"),
])
def test_a_bad_start_is_one_line_and_a_failed_exit(args, line, llama_dir, tmp_path):
    """Checked in the builder before Ray starts: no cluster, no waiting for replicas."""
    args = [f"model={llama_dir}", *args] if args[0].startswith("tensor") else args
    serve_bin = Path(sys.executable).with_name("serve")
    started = time.monotonic()
    done = subprocess.run([str(serve_bin), "run", "deployments.app:build_app", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == line
    assert time.monotonic() - started < 60
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(dict(a.split("=", 1) for a in args))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    preflight = subprocess.run([sys.executable, "-m", "deployments.preflight",
                                str(tmp_path / "config.yaml")], capture_output=True,
                               text=True, timeout=120, cwd=ROOT)
    assert preflight.returncode == 1
    assert preflight.stderr.strip() == line.replace("raygen: ", "raygen: application raygen: ")
