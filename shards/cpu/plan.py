"""Which cores the shards of a node use: the core plan.

The shards' torch threads spin while they wait for work, so any other process that wakes
on one of their cores (Ray's daemons, the proxy, the ingress, the batcher) preempts a
thread the whole forward then waits for. With `reserved_cpus` = k, the shards keep off
the last k cores of the node and split the others, each rank on the node its own slice
(threads = the slice's size unless `cpu_threads` says otherwise); the serving plane is
not pinned, and the kernel runs it where the shards are not (pinning it to the reserved
cores measured 4-10% slower: it then queues behind itself; benchmarks/NOTES.md 27). With
k = 0 the shards still get disjoint slices. A rank alone on its node may borrow the
reserved cores (`borrow_reserved_cpus`): its steps then run a torch thread on each of its own
and the reserved cores.

Where a rank runs one torch thread per core of its slice, each thread is bound to one core
(`bind_torch_threads`), as vLLM's CPU worker binds its OpenMP threads. Until
benchmarks/NOTES.md 42 a borrowing rank kept its one-token steps to its own cores on one
thread, through a second, K x N copy of the weights. With bound threads, every step on
both cores measured as fast at concurrency 1 and 1-8% faster at 32, with one copy of the
weights. (Binding only torch's second thread, one-token steps still on one core, measured
no change.)

Unset (`reserved_cpus=None`, the serving app's default on CPU), a node keeps one core for
the serving plane where every rank on it still gets a core of its own, as vLLM's CPU server
reserves one: on 2 cores, one TP=1 rank pinned to core 0 borrowing core 1 for bigger steps
measured +5% and +15% output tok/s at concurrency 1 over two unpinned threads, and
as fast within noise at 24-32 (benchmarks/NOTES.md 38, 39); two ranks on 2 cores reserve
nothing. Since every step of a borrowing rank runs on both cores, one TP=1 rank on 2 cores
now runs its steps as it does with `reserved_cpus=0`: a bound thread on each core.

The ranks of one group know only each other, so by default two replicas on one node pin to
the same slices. With whole cores per rank (`cores_per_rank`, from the app's `shard_cpus` of
1 or more, which Ray also counts when it places replicas) each rank instead claims its cores
in a file per node that every shard on the node shares: the least-claimed shard cores
first, claims of dead processes dropped. Ranks of different replicas then get disjoint
cores wherever the node has enough, and share the least-used ones where it has not. Ranks
that split the node within their group record their cores there too, so that one which
shares cores with another replica's ranks can say so."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading

logger = logging.getLogger(__name__)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def resolve_reserved(reserved: int | None, num_cores: int, local_count: int) -> int:
    """The reserved cores in effect: `reserved` when set; unset, 1 where each of the node's
    `local_count` ranks still gets one of the other cores, else 0."""
    if reserved is not None:
        return reserved
    return 1 if num_cores - 1 >= max(1, local_count) else 0


def split(cores: list[int], reserved: int) -> tuple[list[int], list[int]]:
    """(cores for the shards, cores for the serving plane); the shards keep at least one."""
    reserved = min(reserved, len(cores) - 1)
    if reserved <= 0:
        return list(cores), []
    return cores[:-reserved], cores[-reserved:]


def shard_cores(cores: list[int], reserved: int, local_index: int, local_count: int) -> list[int]:
    """The slice of the shards' cores for the `local_index`-th of `local_count` ranks on
    this node (ranks share cores only when there are more ranks than cores)."""
    shards, _ = split(cores, reserved)
    per = max(1, len(shards) // max(1, local_count))
    start = (local_index * per) % len(shards)
    return shards[start : start + per]


def borrowed_cores(cores: list[int], reserved: int, local_count: int) -> list[int]:
    """The reserved cores a rank may borrow for its bigger steps: all of them when it is
    the only rank on the node, none otherwise (ranks would contend for them)."""
    return split(cores, reserved)[1] if local_count == 1 else []


def bind_torch_threads(cores: list[int]) -> list[int]:
    """Bind the calling thread to the first of `cores`, and each OpenMP thread torch starts
    for it to one of the others. Call it before the calling thread's first parallel op:
    torch's workers are the threads that op starts (each thread that runs torch ops gets
    its own). Returns the ids of the threads bound, the caller's first; none where torch
    runs another number of threads than `cores`, or where the threads the op started do
    not match (they are then left as they were)."""
    import torch

    threads = torch.get_num_threads()
    if threads < 2 or threads != len(cores):
        return []
    before = set(os.listdir("/proc/self/task"))
    torch.ones(1 << 20).add_(1)  # large enough for torch to run it on every thread
    started = sorted(int(t) for t in set(os.listdir("/proc/self/task")) - before)
    if len(started) != threads - 1:
        logger.info("torch's threads left unbound: %d threads started for %d threads "
                    "(the caller had run a parallel op before, or another thread started)",
                    len(started), threads)
        return []
    caller = threading.get_native_id()
    for tid, core in zip([caller, *started], cores, strict=True):
        os.sched_setaffinity(tid, [core])
    return [caller, *started]


def claims_path(node_id: str) -> str:
    """The node's claims file: one per Ray node, so one per Ray session on a machine, in a
    directory of the machine's temporary one (made here) that keeps only the files of nodes
    with a live claim."""
    folder = os.path.join(tempfile.gettempdir(), "raygen-cores")
    with contextlib.suppress(OSError):  # then claiming fails, and says so
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{node_id}.json")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (a pid reused later differs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _is_live(pid: int, claim: dict) -> bool:
    return claim.get("start") == _start_time(pid)


@contextlib.contextmanager
def _live_claims(path: str, pid: int):
    """The node's live claims but `pid`'s own, under the lock of the file's directory; what
    the caller leaves in the dict is written back. The files of other nodes in that
    directory with no live claim (Ray sessions that ended) are removed under the same lock:
    one lock for every node, so none is taken on a file being removed."""
    folder = os.path.dirname(path)
    with open(os.path.join(folder, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        claims: dict[str, dict] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            with open(path) as f:
                claims = json.load(f)
        live = {p: c for p, c in claims.items() if int(p) != pid and _is_live(int(p), c)}
        yield live
        tmp = f"{path}.{pid}.tmp"
        with open(tmp, "w") as f:
            json.dump(live, f)
        os.replace(tmp, path)
        _drop_ended_nodes(folder, path)


def _drop_ended_nodes(folder: str, keep: str) -> None:
    """Called under the directory's lock, where no writer is between writing a file and
    renaming it: a temporary file left is a dead writer's."""
    for name in os.listdir(folder):
        other = os.path.join(folder, name)
        if other == keep or not name.endswith((".json", ".tmp")):
            continue
        if name.endswith(".json"):
            try:
                with open(other) as f:
                    claims = json.load(f)
            except (OSError, ValueError):
                continue
            if any(p.isdigit() and _is_live(int(p), c) for p, c in claims.items()):
                continue
        with contextlib.suppress(OSError):
            os.remove(other)


def claim(path: str, pool: list[int], want: int, pid: int | None = None,
          group: str = "") -> tuple[list[int], int]:
    """Claim `want` cores of `pool` for process `pid` (this one) in the claims file at
    `path`: the cores fewest live processes hold, lowest first. A process claims once (a
    second claim replaces its first). Returns (the cores, how many of them another live
    process also holds: more than zero only where the pool has too few free)."""
    pid = os.getpid() if pid is None else pid
    try:
        with _live_claims(path, pid) as live:
            held = collections.Counter(core for c in live.values() for core in c["cores"])
            cores = sorted(sorted(pool, key=lambda core: (held[core], core))[:max(1, want)])
            live[str(pid)] = {"start": _start_time(pid), "cores": cores, "group": group}
    except OSError as exc:  # no claims file: the first cores, as if the node were empty
        logger.warning("cannot claim cores in %s (%s): taking the first %d", path, exc, want)
        return sorted(pool[:max(1, want)]), 0
    return cores, sum(1 for core in cores if held[core])


def register(path: str, cores: list[int], group: str, pid: int | None = None) -> int:
    """Record that process `pid` (this one), a rank of `group`, uses `cores` (a slice its
    group chose alone); returns how many of them live ranks of other groups use too."""
    pid = os.getpid() if pid is None else pid
    try:
        with _live_claims(path, pid) as live:
            others = {core for c in live.values() if c.get("group") != group
                      for core in c["cores"]}
            live[str(pid)] = {"start": _start_time(pid), "cores": sorted(cores), "group": group}
    except OSError as exc:  # only a warning is lost
        logger.warning("cannot record cores in %s (%s)", path, exc)
        return 0
    return len(others & set(cores))
