"""shards.cpu.plan.claim: whole cores per rank, claimed in a file every shard of a node
shares; live processes keep their claims, dead ones lose them. bind_torch_threads: one
core per torch thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shards.cpu import plan as cpu_plan


def started(seconds: float = 30) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_claims_take_the_free_cores_first_and_share_only_when_none_are_left(tmp_path):
    path = str(tmp_path / "cores.json")
    pool = list(range(8))
    a, b, c = started(), started(), started()
    try:
        assert cpu_plan.claim(path, pool, 3, a.pid) == ([0, 1, 2], 0)
        assert cpu_plan.claim(path, pool, 3, b.pid) == ([3, 4, 5], 0)
        # Two cores are free: c takes them, then the least-held (all held once), lowest first.
        assert cpu_plan.claim(path, pool, 3, c.pid) == ([0, 6, 7], 1)
        # A second claim by the same process replaces its first.
        assert cpu_plan.claim(path, pool, 2, c.pid) == ([6, 7], 0)
        with open(path) as f:
            assert {int(p): v["cores"] for p, v in json.load(f).items()} == {
                a.pid: [0, 1, 2], b.pid: [3, 4, 5], c.pid: [6, 7]}
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait()


def test_a_dead_process_s_cores_are_free_again(tmp_path):
    path = str(tmp_path / "cores.json")
    a, b = started(), started()
    try:
        assert cpu_plan.claim(path, [0, 1], 1, a.pid) == ([0], 0)
        a.kill()
        a.wait()
        assert cpu_plan.claim(path, [0, 1], 1, b.pid) == ([0], 0)  # a's claim dropped
        with open(path) as f:
            assert list(json.load(f)) == [str(b.pid)]
    finally:
        b.kill()
        b.wait()


def test_a_reused_pid_does_not_keep_a_dead_claim(tmp_path):
    """A claim names its process by pid and start time: the same pid with another start
    time (the pid reused by a new process) holds nothing."""
    path = str(tmp_path / "cores.json")
    a = started()
    try:
        cpu_plan.claim(path, [0, 1], 1, a.pid)
        with open(path) as f:
            claims = json.load(f)
        claims[str(a.pid)]["start"] -= 1
        with open(path, "w") as f:
            json.dump(claims, f)
        assert cpu_plan.claim(path, [0, 1], 1) == ([0], 0)  # this process: core 0 is free
    finally:
        a.kill()
        a.wait()


def test_more_cores_wanted_than_the_pool_has_gives_the_pool(tmp_path):
    assert cpu_plan.claim(str(tmp_path / "c.json"), [4, 5], 3) == ([4, 5], 0)


def test_register_counts_only_other_groups_live_ranks_on_the_same_cores(tmp_path):
    path = str(tmp_path / "cores.json")
    a, b, c = started(), started(), started()
    try:
        assert cpu_plan.register(path, [0, 1], "g1", a.pid) == 0
        assert cpu_plan.register(path, [0], "g2", b.pid) == 1  # g1 uses core 0
        assert cpu_plan.register(path, [0], "g2", c.pid) == 1  # b is of its own group
        a.kill()
        a.wait()
        assert cpu_plan.register(path, [1], "g3") == 0  # a is dead
        with open(path) as f:
            assert {v["group"] for v in json.load(f).values()} == {"g2", "g3"}
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait()


def test_a_node_s_file_goes_once_none_of_its_claims_is_live(tmp_path, monkeypatch):
    """Each Ray node (so each Ray session) has its own claims file in one directory; a
    claim on any node removes the files whose processes have all exited, and what a writer
    that died mid-write left: the directory does not grow by a file per session."""
    monkeypatch.setattr(cpu_plan.tempfile, "tempdir", str(tmp_path))
    ours = cpu_plan.claims_path("ours")
    folder = os.path.dirname(ours)
    assert folder == str(tmp_path / "raygen-cores") and os.path.isdir(folder)
    ended, live = cpu_plan.claims_path("ended"), cpu_plan.claims_path("live")
    a, b = started(), started()
    try:
        cpu_plan.claim(ended, [0, 1], 1, a.pid)
        cpu_plan.claim(live, [0, 1], 1, b.pid)
        assert sorted(os.listdir(folder)) == [".lock", "ended.json", "live.json"]
        a.kill()
        a.wait()
        with open(os.path.join(folder, "live.json.4242.tmp"), "w") as f:
            f.write("{")
        assert cpu_plan.claim(ours, [0, 1], 1) == ([0], 0)  # other nodes' claims: not ours
        assert sorted(os.listdir(folder)) == [".lock", "live.json", "ours.json"]
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_an_unwritable_claims_file_costs_only_the_claims(tmp_path):
    """A node where the claims file cannot be written still pins its shards: the first
    cores of the pool, and no sharing reported."""
    path = str(tmp_path / "missing-dir" / "cores.json")
    assert cpu_plan.claim(path, [2, 3, 4], 2) == ([2, 3], 0)
    assert cpu_plan.register(path, [0, 1], "g") == 0


BIND = """
import json, os, sys, torch
from shards.cpu import plan as cpu_plan
cores = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, cores)
torch.set_num_threads(2)
if sys.argv[1] == "used":
    torch.ones(1 << 20).add_(1)  # torch's workers for this thread exist already
tids = cpu_plan.bind_torch_threads(cores)
print(json.dumps({"cores": cores, "tids": tids,
                  "bound": [sorted(os.sched_getaffinity(t)) for t in tids],
                  "caller": sorted(os.sched_getaffinity(0)),
                  "sum": float(torch.arange(1 << 20, dtype=torch.float64).sum())}))
"""


def bind_in_fresh_process(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", BIND, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_threads_are_bound_one_per_core_before_their_first_parallel_op():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    got = bind_in_fresh_process("fresh")
    a, b = got["cores"]
    assert len(got["tids"]) == 2
    assert got["bound"] == [[a], [b]] and got["caller"] == [a]
    assert got["sum"] == float(sum(range(1 << 20)))  # the bound threads still compute
    # Once the caller has run a parallel op, its workers cannot be told apart: nothing is
    # bound and the caller keeps its cores.
    used = bind_in_fresh_process("used")
    assert used["tids"] == [] and used["caller"] == used["cores"]
