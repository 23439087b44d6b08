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

from benchmarks.chaos import descends_from, is_replica_of, kill_tree
from benchmarks.serve import default_sigint

BASE = "http://127.0.0.1:8000"
ROOT = Path(__file__).resolve().parents[2]


def port_closed() -> bool:
    try:
        httpx.get(BASE + "/health", timeout=2)
        return False
    except httpx.HTTPError:
        return True


def listener(port: int) -> str | None:
    """The name (`comm`) of the process that listens on TCP `port`, from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fd_dir = f"/proc/{pid}/fd"
            if any(os.readlink(f"{fd_dir}/{fd}") in inodes for fd in os.listdir(fd_dir)):
                return Path(f"/proc/{pid}/comm").read_text().strip()
    return None


def replica_pid(deployment: str, under: int) -> int:
    """The Serve replica process of `deployment` (found by its Ray process title, idle or
    running a call) in the Ray instance that process `under` started."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if not descends_from(int(pid), under):
            continue
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
            if is_replica_of(title, deployment):
                return int(pid)
    raise LookupError(f"no replica process of {deployment}")


def replica_environ(deployment: str, under: int) -> dict[str, str]:
    """The environment of that replica process, from /proc."""
    entries = Path(f"/proc/{replica_pid(deployment, under)}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if b"=" in e)


@contextlib.contextmanager
def serve_run(args: list[str], log: Path, env: dict[str, str] | None = None,
              start_timeout: float = 240, target: str = "deployments.app:build_app",
              health_paths: tuple[str, ...] = ("/health",),
              ctrl_c: bool = False) -> Iterator[subprocess.Popen]:
    """`serve run TARGET ARGS` (the app, or a config file) until every health path answers
    200. Stopped after with Ctrl-C as a user stops it (`ctrl_c`: about 10 s, Serve's and
    Ray's shutdowns; test_serve_run.py's server), else killed with every process it
    started (`kill_tree`)."""
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
        if ctrl_c:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(proc)
        deadline = time.monotonic() + 30  # HAProxy included: the port is free again
        while not port_closed() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert port_closed(), "something still serves on port 8000 after serve run stopped"
