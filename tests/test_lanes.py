"""`make test`'s two lanes (tests/lanes.py), on throwaway test files: a lane's runs go one
after the other, a failure stops the other lane and is the exit status, and a run that
collects nothing does not fail its lane."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests import lanes

PASSING = "def test_passes():\n    assert True\n"
FAILING = "def test_fails():\n    assert False\n"
WAITING = "import time\n\n\ndef test_waits():\n    time.sleep(120)\n"


def write(folder, **files: str) -> dict[str, str]:
    folder.mkdir()
    for name, text in files.items():
        (folder / f"test_{name}.py").write_text(text)
    return {name: str(folder / f"test_{name}.py") for name in files}


def run(monkeypatch, capfd, runs_a, runs_b) -> tuple[int, str]:
    monkeypatch.setattr(lanes, "LANES", (("a", runs_a), ("b", runs_b)))
    code = lanes.main(["-p", "no:cacheprovider"])
    return code, capfd.readouterr().out


def test_runs_follow_each_other_and_both_lanes_pass(tmp_path, monkeypatch, capfd):
    f = write(tmp_path / "t", one=PASSING, two=PASSING, three=PASSING)
    code, out = run(monkeypatch, capfd, [[f["one"]]], [[f["two"]], [f["three"]]])
    assert code == 0
    assert re.search(r"lanes: .*a exit 0.*b exit 0|lanes: .*b exit 0.*a exit 0", out), out
    assert out.count("1 passed") == 3  # lane b's two runs, printed after lane a's


def test_a_failure_stops_the_other_lane_and_is_the_status(tmp_path, monkeypatch, capfd):
    f = write(tmp_path / "t", bad=FAILING, slow=WAITING, never=PASSING)
    code, out = run(monkeypatch, capfd, [[f["bad"]]], [[f["slow"]], [f["never"]]])
    assert code == 1  # a's failure, not what b's interruption (Ctrl-C) made of b's status
    b = re.search(r"b exit (-?\d+)", out)
    assert "a exit 1" in out and b and int(b[1]) != 0, out
    assert "1 passed" not in out  # b's second run never started
    kept = re.search(r"kept for a look: (\S+)", out)
    assert kept and Path(kept[1], "lane1").is_dir(), out
    shutil.rmtree(kept[1])


def test_a_run_that_collects_nothing_does_not_fail_its_lane(tmp_path, monkeypatch, capfd):
    f = write(tmp_path / "t", one=PASSING)
    code, out = run(monkeypatch, capfd, [[f["one"]]], [[f["one"], "-k", "no_such_test"]])
    assert code == 0, out
