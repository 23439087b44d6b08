"""The serving plane's pinning covers every thread of the replica's process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh process: pinning is for the process, not for pytest's.
SCRIPT = """
import os, threading
from shards.cpu_plan import pin_serving_plane
started, stop = threading.Event(), threading.Event()
def before():  # a thread that exists before the pinning, like a replica's event loop
    started.set(); stop.wait()
t = threading.Thread(target=before); t.start(); started.wait()
plane = pin_serving_plane(1)
after = threading.Thread(target=lambda: print("after", sorted(os.sched_getaffinity(0))))
after.start(); after.join()
for tid in sorted(os.listdir("/proc/self/task")):
    print("thread", sorted(os.sched_getaffinity(int(tid))))
print("plane", plane)
stop.set(); t.join()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_every_thread_of_the_serving_plane_is_pinned():
    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    last = [cores[-1]]
    assert f"plane {last}" in out
    threads = [line for line in out if line.startswith("thread")]
    assert len(threads) >= 2 and all(line == f"thread {last}" for line in threads), out
    assert f"after {last}" in out
