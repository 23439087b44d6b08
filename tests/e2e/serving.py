"""Starting and stopping `serve run` as a user does, for the end-to-end modules."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.serve import default_sigint

BASE = "http://127.0.0.1:8000"
ROOT = Path(__file__).resolve().parents[2]


def port_closed() -> bool:
    try:
        httpx.get(BASE + "/health", timeout=2)
        return False
    except httpx.HTTPError:
        return True


@contextlib.contextmanager
def serve_run(args: list[str], log: Path, env: dict[str, str] | None = None,
              start_timeout: float = 240, target: str = "deployments.app:build_app",
              health_paths: tuple[str, ...] = ("/health",)) -> Iterator[subprocess.Popen]:
    """`serve run TARGET ARGS` (the app, or a config file) until every health path answers
    200; stopped with Ctrl-C after."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "RAY_ENABLE_AUTO_CONNECT": "0", **(env or {})}
    serve_bin = Path(sys.executable).with_name("serve")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(serve_bin), "run", target, *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + start_timeout
        pending = list(health_paths)
        while pending:
            if proc.poll() is not None:
                pytest.fail(f"serve run exited early:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(BASE + pending[0], timeout=5).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve run not healthy in time:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)  # as a user stops it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        deadline = time.monotonic() + 30  # HAProxy included: the port is free again
        while not port_closed() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert port_closed(), "something still serves on port 8000 after serve run stopped"
