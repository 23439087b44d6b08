"""Which cores the shards of a node use: the core plan.

The shards' torch threads spin while they wait for work, so any other process that wakes
on one of their cores (Ray's daemons, the proxy, the ingress, the batcher) preempts a
thread the whole forward then waits for. With `reserved_cpus` = k, the shards keep off
the last k cores of the node and split the others, each rank on the node its own slice
(threads = the slice's size unless `cpu_threads` says otherwise); the serving plane is
not pinned, and the kernel runs it where the shards are not (pinning it to the reserved
cores measured 4-10% slower: it then queues behind itself; benchmarks/NOTES.md 27). With
k = 0 the shards still get disjoint slices. A rank alone on its node may borrow the
reserved cores for steps of more than one token (`borrow_reserved_cpus`): its one-token
steps keep to its own cores, so decoding one sequence never waits for a preempted thread,
and prefill still has every core.

Unset (`reserved_cpus=None`, the serving app's default on CPU), a node keeps one core for
the serving plane where every rank on it still gets a core of its own, as vLLM's CPU server
reserves one: on 2 cores, one TP=1 rank pinned to core 0 borrowing core 1 for bigger steps
measured +5% and +15% output tok/s at concurrency 1 over two unpinned threads, and
as fast within noise at 24-32 (benchmarks/NOTES.md 38, 39); two ranks on 2 cores reserve nothing."""

from __future__ import annotations

import os


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
