"""`make test`: every tier, in two pytest processes at once.

Much of the suite's time is waiting, not computing: Ray and `serve run` starting, replicas
deploying, autoscaling delays, steps that are slow on purpose; one lane computes while the
other waits. The first lane runs the unit tier first (a broken unit fails the run in
seconds), then the integration tier; the second runs what listens on port 8000 (the
end-to-end tier, one `serve run` at a time), then the HTTP API module.

Each lane's Ray instances are its own. In the second lane `RAY_ADDRESS=local` makes every
`ray.init` and `serve run` start a fresh instance instead of joining the last one started
(the autoscaling module's ray.cluster_utils.Cluster, in the first lane, records its address
for others to join). The first lane runs as the whole suite used to (there RAY_ADDRESS
would also override the address that Ray's state API is given). The tests that find
processes by title look only under their own `serve run`.

The first lane prints as it goes; the second's output follows when it ends. A lane that
fails stops the other (Ctrl-C, so that its fixtures stop what they started).

    python -m tests.lanes [PYTEST ARGS...]   # extra args go to both lanes
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each lane: the pytest runs it makes one after the other. The HTTP API module runs after
# the end-to-end tier so that the lanes end together (benchmarks/NOTES.md 64); the
# autoscaling module stays in the first lane, beside the end-to-end tier: beside the unit
# tier's products on both cores, one of its scale-outs took more than its 120 s.
MOVED = ["tests/deployments/test_http_api.py"]
LANES = (
    ("unit, integration", [["tests", "--ignore=tests/e2e", *(f"--ignore={m}" for m in MOVED)]]),
    ("e2e, http api", [["tests/e2e", "-p", "no:cacheprovider"],
                       [*MOVED, "-p", "no:cacheprovider"]]),
)
LANE_ENV = ({}, {"RAY_ADDRESS": "local"})

# Ray's own start can fail on a starved machine: the raylet gives its dashboard agent (a
# Python process) a few seconds to write its ports, then aborts (node_manager.cc
# WaitForDashboardAgentPorts), and ray.init raises this. Seen with two lanes: an agent took
# 65 s to import while the other lane started five apps. A user would start again; the
# suite's ray.init (conftest.py) and `serve run` (e2e/serving.py) do, up to RAY_STARTS times.
RAY_START_FAILED = "The current node timed out during startup"
RAY_STARTS = 3
# Worse, with the other lane starting five apps, Serve's HAProxy took longer than Serve
# waits for a proxy. So the set-ups that start Ray or apps take turns: each lane's pytest
# holds this lock (a file the lanes share) while such a set-up runs (conftest.py).
START_LOCK_ENV = "RAYGEN_TEST_START_LOCK"


@contextlib.contextmanager
def start_lock(needed: bool = True) -> Iterator[None]:
    path = os.environ.get(START_LOCK_ENV)
    if not (needed and path):
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Lane:
    """A lane's pytest runs, one after the other, until one fails."""

    def __init__(self, runs: list[list[str]], extra: list[str], log: Path | None,
                 basetemp: Path, env: dict[str, str]):
        self.runs, self.extra, self.basetemp = list(runs), extra, basetemp
        self.env = {**os.environ, **env}
        basetemp.mkdir(parents=True)  # pytest makes --basetemp itself, not its parents
        self.out = open(log, "wb") if log else None  # noqa: SIM115 (closed in done())
        self.proc: subprocess.Popen | None = None
        self.codes: list[int] = []
        self._next()

    def _next(self) -> None:
        selection = self.runs.pop(0)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "--durations=10", *selection,
               f"--basetemp={self.basetemp / str(len(self.codes))}", *self.extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self.out,
                                     stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        """The lane's exit status once it is done: its first failure's, or 0."""
        code = self.proc.poll()
        if code is None:
            return None
        self.codes.append(code)
        if code in (0, 5) and self.runs:  # 5: nothing collected (extra args chose)
            self._next()
            return None
        if self.out:
            self.out.close()
        ran = [c for c in self.codes if c != 5] or [5]
        return next((c for c in ran if c), 0)

    def stop(self) -> None:
        self.runs = []
        self.proc.send_signal(signal.SIGINT)  # its fixtures stop what they started


def main(extra: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="raygen-test-"))
    log = work / "lane2.log"
    started = time.monotonic()
    lock = {START_LOCK_ENV: str(work / "start.lock")}
    lanes = {name: Lane(runs, extra, None if i == 0 else log, work / f"lane{i + 1}",
                        {**env, **lock})
             for i, ((name, runs), env) in enumerate(zip(LANES, LANE_ENV, strict=True))}
    codes: dict[str, int] = {}
    while len(codes) < len(lanes):
        for name, lane in lanes.items():
            if name in codes or (code := lane.poll()) is None:
                continue
            codes[name] = code
            if code not in (0, 5):  # stop the other lane
                for other, rest in lanes.items():
                    if other not in codes:
                        rest.stop()
        time.sleep(0.5)
    print(f"\n==== lane {LANES[1][0]} ====", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    print(f"\n==== lanes: {', '.join(f'{n} exit {c}' for n, c in codes.items())}; "
          f"{time.monotonic() - started:.0f} s in all ====", flush=True)
    failures = [c for c in codes.values() if c not in (0, 5)]  # the first to fail first
    if failures:
        print(f"kept for a look: {work}")
        return failures[0]
    shutil.rmtree(work, ignore_errors=True)
    return 5 if all(c == 5 for c in codes.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
