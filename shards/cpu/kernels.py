"""raygen's own CPU kernels (shards/cpu/csrc), built on the machine that runs them.

    python -m shards.cpu.kernels     # build now (`make install` does); prints where

The decode attention kernel reads K and V in place through the block table; the torch
backend gathers them into padded tensors first (shards/model/attention.py). A decoder layer's
RMSNorm and rotary embedding each run in one pass (shards/model/layers.py). They are built with
torch's C++ extension tooling into a cache directory named after the CPU's instruction
set (and the checkout), since it is compiled for that CPU (-march=native): nodes that
share a home directory but not a CPU build their own. Without a compiler the shards use
the torch path and say so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # one module: csrc/module.cpp registers them all
FLAGS = ["-O3", "-fopenmp", "-march=native"]
STALE_LOCK_S = 300

_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_signature() -> str:
    """What the compiled code depends on: the machine, the CPU's flags, python and torch;
    and which checkout it came from, so that two checkouts never rebuild one library
    under each other's running servers."""
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    text = f"{platform.machine()}|{flags}|{sys.version_info[:2]}|{torch.__version__}|{CSRC}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_dir() -> Path:
    root = Path(os.environ.get("RAYGEN_KERNEL_CACHE", Path.home() / ".cache" / "raygen"))
    return root / f"cpu-kernels-{_cpu_signature()}"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits beside this Python,
    which is not on PATH when the venv is not activated (Ray workers, `.venv/bin/python`)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _clear_stale_lock(directory: Path) -> None:
    """torch's builder waits, without a limit, for a lock file that the process building
    removes when done; a builder killed mid-build leaves it behind. A build takes ~20 s."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale kernel build lock (%s)", lock)
    except FileNotFoundError:
        pass


def load():
    """The compiled module, building it on first use (about 20 s); None if it cannot be
    built here (the reason is in `load_error()`)."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_extension

            _put_ninja_on_path()

            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(directory)
            t0 = time.perf_counter()
            _module = load_extension("raygen_cpu_kernels", [str(f) for f in SOURCES],
                                     extra_cflags=FLAGS,
                                     extra_ldflags=["-fopenmp"], build_directory=str(directory))
            logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - t0, directory)
        except Exception as exc:  # no compiler, no ninja, a build error: use the torch path
            last_line = (str(exc).strip().splitlines() or [""])[-1]  # compilers say a lot
            _error = f"{type(exc).__name__}: {last_line[:300]}"
            logger.warning("CPU kernels unavailable, using the torch path: %s", _error)
        return _module


def load_error() -> str | None:
    return _error


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    if module is None:
        print(f"not built ({load_error()}); the shards will use the torch attention path")
    else:
        print(f"built: {module.__file__}")
