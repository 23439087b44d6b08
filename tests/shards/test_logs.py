"""shards.worker.logs: the engine's and shards' lines reach a handler in Ray's processes, once."""

from __future__ import annotations

import logging

import pytest

from shards.worker import logs


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def clean_loggers():
    names = (*logs.PACKAGES, "ray.serve")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level,
                 logging.getLogger(n).propagate) for n in names}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_to_stderr_tags_each_line_once_however_often_installed(clean_loggers, capsys):
    logs.to_stderr("shard rank 1/2")
    logs.to_stderr("shard rank 1/2")  # a second install replaces the first
    logging.getLogger("shards.worker.actor").info("core plan: %s", "x")
    logging.getLogger("shards.worker.actor").debug("not at INFO")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("INFO ")
    assert "shard rank 1/2 shards.worker.actor -- core plan: x" in err[0]


def test_to_serve_hands_lines_to_serves_logger_at_its_level(clean_loggers):
    serve_logger = logging.getLogger("ray.serve")
    sink = Records()
    serve_logger.handlers, serve_logger.propagate = [sink], False
    serve_logger.setLevel(logging.WARNING)
    logs.to_serve()
    logs.to_serve()
    logging.getLogger("engine.async_engine").info("dropped: Serve's logger is at WARNING")
    logging.getLogger("shards.worker.group").warning("KV cache: %d blocks", 7)
    assert [r.getMessage() for r in sink.records] == ["KV cache: 7 blocks"]
    assert sink.records[0].name == "shards.worker.group"
    serve_logger.setLevel(logging.INFO)
    logging.getLogger("engine.async_engine").info("kept")
    assert [r.getMessage() for r in sink.records][-1] == "kept"
    assert len(sink.records) == 2


def test_a_replica_that_fails_to_start_says_why_on_the_process_stderr(capfd, monkeypatch):
    """Serve's throughput mode points a replica's sys.stderr and print at its log file; the
    line must reach the process's own stderr (fd 2), which Ray copies to the console."""
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # as Serve's StreamToLogger would
    # A Ray task error: the traceback first, the cause on its last line.
    error = RuntimeError("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                         "RuntimeError: DefaultCPUAllocator: can't allocate memory\n")
    with pytest.raises(RuntimeError) as raised, logs.start_failure_to_console("Batcher"):
        raise error
    assert raised.value is error  # re-raised as it was: Serve still sees the failure
    assert capfd.readouterr().err == ("raygen: the Batcher replica failed to start: "
                                      "RuntimeError: DefaultCPUAllocator: can't allocate memory\n")
    with pytest.raises(KeyError), logs.start_failure_to_console("Ingress"):
        raise KeyError("tokenizer.json")
    assert capfd.readouterr().err == \
        "raygen: the Ingress replica failed to start: KeyError: 'tokenizer.json'\n"
    with logs.start_failure_to_console("Ingress"):
        pass
    assert capfd.readouterr().err == "" and sys.stderr.getvalue() == ""
