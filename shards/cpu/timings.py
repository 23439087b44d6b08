"""Start-up timings, kept per machine: a shard times some products at start-up to choose
how its steps multiply (worker/weight_plan.py: the one-row weight copy, the panels, a GGUF file's
blocks), about 5 s of a core for SmolLM2's Q4_1 file. The same products on the same CPU,
kernel build and threads time the same, so each timing is written beside the kernel build
(`shards.cpu.kernels.build_dir()/timings`) and a later start reads it. Deleting that
directory times them again; a new kernel build starts without any.

A timing taken while other processes kept the cores busy (a first start beside the other
replicas' starts: a one-row product once read 13.2 ms there against 6.1 ms quiet,
benchmarks/NOTES.md 95) is not final: the next start times it again and keeps the faster of
each (other work only slows a product), until a start times it quietly or BUSY_STARTS
starts have."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Other processes' CPU while the products were timed, in cores, up to which a timing is final.
QUIET_CORES = 0.5
# Timings taken beside more than that: the fastest of this many starts' is final.
BUSY_STARTS = 3
_busy_said = []  # the log says it once a process


@cache
def directory() -> Path:
    from shards.cpu.kernels import build_dir

    return build_dir() / "timings"


@cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine_busy_s() -> float | None:
    """Seconds of CPU the whole machine has spent busy (hypervisor steal included): /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def busy_meter() -> Callable[[], float]:
    """Starts counting the CPU that other processes use; the function returned says how
    many cores they kept busy on average since (0 where /proc/stat cannot be read). Two
    clock ticks of slack: /proc/stat counts in ticks."""
    start, machine, own = time.monotonic(), _machine_busy_s(), sum(os.times()[:2])
    slack = 2 / os.sysconf("SC_CLK_TCK")

    def cores() -> float:
        now = _machine_busy_s()
        wall = time.monotonic() - start
        if machine is None or now is None or wall <= 0:
            return 0.0
        others = (now - machine) - (sum(os.times()[:2]) - own) - slack
        return max(0.0, others) / wall
    return cores


def _saved(path: Path, key: str) -> dict | None:
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return {"seconds": tuple(float(s) for s in saved["seconds"]),
                    "final": bool(saved.get("final", True)), "starts": int(saved.get("starts", 1))}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def timed(what: tuple, measure: Callable[[], tuple[float, ...]]) -> tuple[tuple[float, ...], bool]:
    """`measure()`'s seconds for the products that `what` names (shapes, rows, rounds), and
    whether they were read rather than timed. The CPU's name and this process's torch
    threads complete the key; the directory's name holds the CPU's flags, torch's version
    and the kernel sources. Ranks of one group that time the same products at once keep
    the first one's (each rank's own timing ran beside the others, as it did before). A
    timing that is not final yet (see the module's note) is timed again and combined."""
    key = json.dumps([*what, _cpu_name(), torch.get_num_threads()])
    path = directory() / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    saved = _saved(path, key)
    if saved is not None and saved["final"]:
        return saved["seconds"], True
    others = busy_meter()
    seconds, busy, starts = tuple(measure()), others(), 1
    if saved is not None:  # timed beside other work before: the faster of each
        seconds = tuple(map(min, seconds, saved["seconds"]))
        starts += saved["starts"]
    final = busy <= QUIET_CORES or starts >= BUSY_STARTS
    if not final and not _busy_said:
        _busy_said.append(busy)
        logger.info("start-up timings taken while other processes kept %.1f cores busy: "
                    "timed again at the next start (start %d of up to %d)", busy, starts,
                    BUSY_STARTS)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "seconds": seconds, "final": final, "starts": starts}, f)
        os.replace(tmp, path)  # whole or not at all: ranks of one group time at once
    except OSError as exc:  # a read-only home: time again at every start
        logger.info("start-up timing not kept (%s)", exc)
    return seconds, False
