"""Start-up timings, kept per machine: a shard times some products at start-up to choose
how its steps multiply (worker/weight_plan.py: the one-row weight copy, the panels, a GGUF file's
blocks), about 5 s of a core for SmolLM2's Q4_1 file. The same products on the same CPU,
kernel build and threads time the same, so each timing is written beside the kernel build
(`shards.cpu.kernels.build_dir()/timings`) and a later start reads it. Deleting that
directory times them again; a new kernel build starts without any."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


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


def timed(what: tuple, measure: Callable[[], tuple[float, ...]]) -> tuple[tuple[float, ...], bool]:
    """`measure()`'s seconds for the products that `what` names (shapes, rows, rounds), and
    whether they were read rather than timed. The CPU's name and this process's torch
    threads complete the key; the directory's name holds the CPU's flags, torch's version
    and the kernel sources. Ranks of one group that time the same products at once keep
    the first one's (each rank's own timing ran beside the others, as it did before)."""
    key = json.dumps([*what, _cpu_name(), torch.get_num_threads()])
    path = directory() / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return tuple(saved["seconds"]), True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    seconds = tuple(measure())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "seconds": seconds}, f)
        os.replace(tmp, path)  # whole or not at all: ranks of one group time at once
    except OSError as exc:  # a read-only home: time again at every start
        logger.info("start-up timing not kept (%s)", exc)
    return seconds, False
