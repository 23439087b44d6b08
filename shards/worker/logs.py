"""Where the engine's and the shards' log lines go in the processes Ray starts.

`engine.*` and `shards.*` log under their module names. Python's root logger drops INFO
and has no handler in a Ray worker, so without this their start-up lines (the core plan,
the KV cache, compile progress) went nowhere. In a Serve replica they are handed to Serve's
own logger (the replica's log file, and stderr where Serve logs there); in a shard actor,
which is no Serve component, they go to stderr, which Ray copies to the worker's log file
and to the driver's console (`(ShardActor pid=...) INFO ...` under `serve run`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

PACKAGES = ("engine", "shards")


class _Forward(logging.Handler):
    """Hands records to another logger's handlers (with that logger's filters)."""

    def __init__(self, target: logging.Logger):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.isEnabledFor(record.levelno):
            self.target.handle(record)


def _install(handler: logging.Handler, level: int) -> None:
    for name in PACKAGES:
        package = logging.getLogger(name)
        package.handlers = [h for h in package.handlers if not getattr(h, "_raygen", False)]
        handler._raygen = True
        package.addHandler(handler)
        package.setLevel(level)
        package.propagate = False  # one copy of each line, whatever the root logger does


def to_serve(level: int = logging.INFO) -> None:
    """In a Serve replica: engine and shard lines go where the replica's own lines go."""
    _install(_Forward(logging.getLogger("ray.serve")), level)


def to_stderr(prefix: str, level: int = logging.INFO) -> None:
    """In a plain Ray actor: to stderr, each line tagged with `prefix` (the rank)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(levelname)s %(asctime)s {prefix} %(name)s -- %(message)s"))
    _install(handler, level)


@contextlib.contextmanager
def start_failure_to_console(component: str) -> Iterator[None]:
    """Around a Serve replica's constructor: a failure is also one line on the process's
    stderr, which Ray copies to the driver's console. In Serve's throughput mode a replica's
    own log lines stay off the console, and `serve run` says only "Failed to update the
    deployments", so without this line the cause never reached the user."""
    try:
        yield
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(exc).__name__  # a Ray error ends with the cause
        if not reason.startswith(type(exc).__name__) and ":" not in reason[:40]:
            reason = f"{type(exc).__name__}: {reason}"
        # To the process's own stderr: Serve's throughput mode points `sys.stderr` and
        # `print` of a replica at its log file.
        os.write(2, f"raygen: the {component} replica failed to start: {reason}\n".encode())
        raise
