"""Metrics reach Prometheus: a real Prometheus (Debian's package) on loopback scrapes Ray's
metrics export while the app serves; its HTTP API must show request count, TTFT and KV
usage series moving, under the names the Grafana dashboard queries."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from deployments.config import AppArgs

PORT = 8126
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="prometheus not installed (make test installs it)")]


# Ray's fixed default ports (GCS, dashboard, Ray client, the dashboard agent's HTTP port):
# ray.init refuses a port given to another component that equals one of them.
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}


def free_port(taken: frozenset[int] = frozenset()) -> int:
    """A port below the OS's ephemeral range, where nothing that binds port 0 lands: Ray
    picks its own random ports that way after this one is chosen, and the range holds
    52365 (CI once failed on exactly that collision)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 12000), low)
        if port in RAY_DEFAULT_PORTS | taken | {PORT}:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def prometheus(llama_dir, tmp_path_factory):
    export_port = free_port()
    prom_port = free_port(frozenset({export_port}))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _metrics_export_port=export_port,
             _system_config={"metrics_report_interval_ms": 1000})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(AppArgs(model=llama_dir, num_blocks=256)), name="prom", route_prefix="/")
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        f"scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{export_port}']\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{prom_port}"
    finally:
        proc.terminate()
        proc.wait(30)
        serve.shutdown()
        ray.shutdown()


def query(base: str, expr: str) -> float | None:
    try:
        body = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=5).json()
    except httpx.HTTPError:
        return None
    result = body.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def wait_for(base: str, expr: str, predicate, timeout: float = 90) -> float:
    deadline = time.monotonic() + timeout
    value = query(base, expr)
    while (value is None or not predicate(value)) and time.monotonic() < deadline:
        time.sleep(1)
        value = query(base, expr)
    assert value is not None and predicate(value), f"{expr} = {value}"
    return value


def test_request_ttft_and_kv_series_move_in_prometheus(prometheus):
    for i in range(6):
        r = httpx.post(f"http://127.0.0.1:{PORT}/generate", timeout=60, json={
            "inputs": f"kari tona {i}", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200
    assert wait_for(prometheus, 'sum(ray_tgi_request_count_total{application="prom"})',
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, 'sum(ray_tgi_request_success_total{application="prom"})',
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, 'sum(ray_raygen_time_to_first_token_seconds_count)',
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, 'sum(ray_raygen_kv_blocks_capacity{deployment="Batcher"})',
                    lambda v: v == 256) == 256
    # KV usage moves while a long request holds blocks, and returns to zero after.
    with httpx.stream("POST", f"http://127.0.0.1:{PORT}/generate_stream", timeout=60, json={
            "inputs": "mole dasu", "parameters": {"max_new_tokens": 1000}}) as r:
        assert wait_for(prometheus, "max(ray_raygen_kv_blocks_used)", lambda v: v > 0) > 0
        r.close()
    assert wait_for(prometheus, "max(ray_raygen_kv_blocks_used)", lambda v: v == 0) == 0
    # Tagged per replica, so the dashboard can split by it.
    tagged = httpx.get(prometheus + "/api/v1/series", timeout=5,
                       params={"match[]": "ray_tgi_batch_current_size"}).json()["data"]
    assert tagged and {"application", "deployment", "replica"} <= set(tagged[0])
