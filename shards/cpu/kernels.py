"""raygen's own CPU kernels (shards/cpu/csrc), built on the machine that runs them.

    python -m shards.cpu.kernels     # build now (`make install` does); prints where

The decode attention kernel reads K and V in place through the block table; the torch
backend gathers them into padded tensors first (shards/model/attention.py). A decoder layer's
RMSNorm and rotary embedding each run in one pass (shards/model/layers.py). They are built with
torch's C++ extension tooling into a cache directory named after the CPU's instruction
set and the sources, since it is compiled for that CPU (-march=native): nodes that share a
home directory but not a CPU build their own, and a clean clone of built sources reuses
the build. Without a compiler the shards use
the torch path and say so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-fopenmp", "-march=native"]
STALE_LOCK_S = 300
KEEP_BUILDS = 4
NAME = "raygen_cpu_kernels"
BUILT = "built"  # written once a build has succeeded

_lock = threading.Lock()
_module = None
_error: str | None = None


def _signature() -> str:
    """What the compiled code depends on: the machine, the CPU's flags, python, torch, the
    compiler flags and the sources' bytes. Checkouts of the same sources share one build (a
    clean clone builds nothing); changed sources get a directory of their own, so a build
    never replaces a library that a running server has loaded."""
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha256(f"{platform.machine()}|{flags}|{sys.version_info[:2]}|"
                            f"{torch.__version__}|{FLAGS}".encode())
    for source in _source_files():
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


def _source_files() -> list[Path]:
    return sorted(f for f in CSRC.iterdir() if f.suffix in (".cpp", ".h"))


def build_dir() -> Path:
    root = Path(os.environ.get("RAYGEN_KERNEL_CACHE", Path.home() / ".cache" / "raygen"))
    return root / f"cpu-kernels-{_signature()}"


def _staged_sources(directory: Path) -> list[str]:
    """The sources, copied into the build directory once: torch's ninja file names them by
    path, and ninja rebuilds when a command changes, so each checkout compiling its own
    copy would rebuild the shared library."""
    src = directory / "src"
    if not src.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=directory))
        for source in _source_files():
            shutil.copy2(source, tmp / source.name)
        try:
            os.rename(tmp, src)
        except OSError:  # another process staged the same bytes first
            shutil.rmtree(tmp, ignore_errors=True)
    return [str(f) for f in sorted(src.glob("*.cpp"))]


def _import_built(directory: Path):
    """A finished build of the same sources, imported as it is. torch's builder would run
    ninja first, and ninja compiles again for another virtualenv: torch's include paths are
    in the commands. The library finds libtorch among the libraries this process has loaded
    (it has no rpath), of the same torch version, since the version is in the directory's
    name."""
    import importlib.util

    import torch  # noqa: F401  (libtorch and libc10, for the library's links)

    spec = importlib.util.spec_from_file_location(NAME, directory / f"{NAME}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prune(directory: Path, keep: int = KEEP_BUILDS) -> None:
    """Drop the builds of older sources beyond the `keep` most recently used. A server that
    loaded one keeps its mapped library; a build in progress is among the recent ones."""
    os.utime(directory)
    builds = sorted(directory.parent.glob("cpu-kernels-*"), key=lambda d: d.stat().st_mtime,
                    reverse=True)
    for old in builds[keep:]:
        shutil.rmtree(old, ignore_errors=True)


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
            if (directory / BUILT).exists():
                _module = _import_built(directory)
            else:
                _module = load_extension(NAME, _staged_sources(directory), extra_cflags=FLAGS,
                                         extra_ldflags=["-fopenmp"],
                                         build_directory=str(directory))
                (directory / BUILT).touch()
            _prune(directory)
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
