"""Start-up timings are kept per machine (shards/cpu/timings.py): a second start of the same
products reads them and chooses as the first did; anything else times again."""

from __future__ import annotations

import json

import pytest
import torch

from shards.cpu import timings as startup_timings


@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)
    monkeypatch.setattr(startup_timings, "busy_meter", lambda: lambda: 0.0)  # a quiet machine
    return tmp_path


def test_a_timing_taken_beside_other_work_is_timed_again_and_the_fastest_kept(kept,
                                                                            monkeypatch):
    """Other processes' work only slows a product: each start that times beside it keeps
    the faster of each figure, until a quiet start or BUSY_STARTS starts make it final."""
    what = ("quant", "576x576 Q4_1", 30, 8)
    monkeypatch.setattr(startup_timings, "busy_meter", lambda: lambda: 1.5)
    assert startup_timings.timed(what, lambda: (1.0, 2.0)) == ((1.0, 2.0), False)
    assert startup_timings.timed(what, lambda: (0.5, 3.0)) == ((0.5, 2.0), False)
    assert startup_timings.BUSY_STARTS == 3
    assert startup_timings.timed(what, lambda: (0.8, 0.9)) == ((0.5, 0.9), False)
    assert startup_timings.timed(what, lambda: (9.0, 9.0)) == ((0.5, 0.9), True)  # final
    # A quiet start makes a busy one's timing final at once.
    other = ("quant", "576x576 Q4_1", 30, 16)
    assert startup_timings.timed(other, lambda: (4.0, 4.0)) == ((4.0, 4.0), False)
    monkeypatch.setattr(startup_timings, "busy_meter", lambda: lambda: 0.1)
    assert startup_timings.timed(other, lambda: (3.0, 5.0)) == ((3.0, 4.0), False)
    assert startup_timings.timed(other, lambda: (9.0, 9.0)) == ((3.0, 4.0), True)


def test_a_file_from_before_the_busy_rule_reads_as_final(kept):
    what = ("copy", [[8, 8]], 1, 5)
    startup_timings.timed(what, lambda: (1.0, 1.0))
    (path,) = kept.glob("*.json")
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({"key": saved["key"], "seconds": [2.0, 2.5]}))
    assert startup_timings.timed(what, lambda: (7.0, 7.0)) == ((2.0, 2.5), True)


def test_the_busy_meter_counts_other_processes_not_this_one():
    """A child process that spins for 0.6 s reads as about a core (the machine has two: it
    gets one); this process's own spinning does not count. Other work on the machine (a
    build, another suite) only adds to both readings, so the second check compares the
    meter with the whole machine's busy time over the same window rather than with zero."""
    import os
    import subprocess
    import sys
    import time

    others = startup_timings.busy_meter()
    subprocess.run([sys.executable, "-c", "import time\nt = time.monotonic()\n"
                    "while time.monotonic() - t < 0.6: pass"], check=True)
    assert others() >= 0.5
    machine, own, t = startup_timings._machine_busy_s(), sum(os.times()[:2]), time.monotonic()
    mine = startup_timings.busy_meter()
    while time.monotonic() - t < 0.6:
        pass
    spun = mine()
    wall = time.monotonic() - t
    whole = (startup_timings._machine_busy_s() - machine) / wall
    own = (sum(os.times()[:2]) - own) / wall
    assert own >= 0.3, own  # the spin ran (it gets a share of a core even on a busy machine)
    # Had our own spinning counted, the meter would read the whole machine's busy cores.
    assert spun <= whole - own + 0.15, (spun, whole, own)


def test_a_timing_is_read_back_and_another_key_times_again(kept):
    calls = []

    def measure(seconds):
        return lambda: calls.append(seconds) or (seconds, 2 * seconds)

    assert startup_timings.timed(("quant", "576x576 Q4_1", 30, 8), measure(1.0)) == \
        ((1.0, 2.0), False)
    assert startup_timings.timed(("quant", "576x576 Q4_1", 30, 8), measure(9.0)) == \
        ((1.0, 2.0), True)
    assert startup_timings.timed(("quant", "576x576 Q4_1", 30, 16), measure(3.0)) == \
        ((3.0, 6.0), False)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:  # the same products on more threads time differently
        assert startup_timings.timed(("quant", "576x576 Q4_1", 30, 8), measure(4.0))[1] is False
    finally:
        torch.set_num_threads(threads)
    assert calls == [1.0, 3.0, 4.0]
    assert len(list(kept.glob("*.json"))) == 3 and not list(kept.glob(".tmp-*"))


def test_a_damaged_or_foreign_file_is_timed_again_and_replaced(kept):
    what = ("copy", [[8, 8]], 1, 5)
    startup_timings.timed(what, lambda: (1.0, 1.0))
    (path,) = kept.glob("*.json")
    for text in ("{not json", json.dumps({"key": "another", "seconds": [5.0, 5.0]})):
        path.write_text(text)
        assert startup_timings.timed(what, lambda: (2.0, 3.0)) == ((2.0, 3.0), False)
        assert startup_timings.timed(what, lambda: (7.0, 7.0)) == ((2.0, 3.0), True)


def test_a_second_start_reads_every_timing_and_chooses_the_same(llama_dir, kept):
    from deployments.offline import LLM

    first = LLM(llama_dir, num_blocks=16, quantize="q8_0").runner.weights
    second = LLM(llama_dir, num_blocks=16, quantize="q8_0").runner.weights
    assert first.timings_read[False] > 0 and first.timings_read[True] == 0
    assert second.timings_read == {True: first.timings_read[False], False: 0}
    assert second.quant_timings == first.quant_timings and second.quant_timings
    assert second.quant_rows_by_kind == first.quant_rows_by_kind
    assert second.one_row_timings == first.one_row_timings
    assert second.panel_timings == first.panel_timings
