"""Chaos soak: keep N streams going while shard and batcher processes are SIGKILLed.

    python -m benchmarks.soak --chaos [--duration 300] [--concurrency 16] [--kill-every 30 60]

Runs on the server's own machine: it finds the server's processes by their Ray titles
(`ray::ShardActor...`, `ray::ServeReplica:<app>:Batcher`) and kills one at random every
MIN-MAX seconds, never before the previous kill has recovered. Traffic goes to loopback only.

Reports requests sent, succeeded, failed with a clear error (an error body or event), hung
(nothing for HANG_AFTER_S: must be 0) and lost (ended with neither output nor error: must
be 0); availability, the share of the run's time that GET /health answered 200 within
HEALTH_TIMEOUT_S; each kill's recovery time (from the kill until a request sent after it
succeeds); and the KV blocks in use once the load has stopped (must come back to 0)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.mixed_load import Tally, one

# A request that gets no byte for this long is hung (a recovery takes well under it).
HANG_AFTER_S = 120.0
HEALTH_PERIOD_S = 0.5
# A /health probe answered later than this counts as down, as a load balancer's or
# Kubernetes' probe (timeout 1 s by default) would count it. While a replica is replaced,
# the ingress's call to the batcher waits for the new one, and a probe without a deadline
# gets 200 seconds later: the outage would count as up.
HEALTH_TIMEOUT_S = 2.0
RECOVERY_TIMEOUT_S = 180.0
KV_DRAIN_TIMEOUT_S = 30.0


def is_replica_of(title: str, deployment: str) -> bool:
    """Whether a process title is a Serve replica of `deployment`. Ray titles a replica
    `ray::ServeReplica:<app>:<deployment>`, and `...:<deployment>.<method>` while it runs a
    call (a streaming one can last seconds)."""
    if not title.startswith("ray::ServeReplica:"):
        return False
    return title.strip().rsplit(":", 1)[-1].split(".", 1)[0] == deployment


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` (/proc), None where it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descends_from(pid: int, root: int) -> bool:
    """Whether `root` is `pid` or one of its ancestors: a Ray worker is a child of its
    node's raylet, which is a child of the process that started that Ray instance."""
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid == root:
            return True
        pid, seen = parent_pid(pid), seen + 1
    return False


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill `proc` (a `serve run`, say) and every process under it at once. Not its process
    group alone: Serve's HAProxy runs in the group of the actor that started it and
    outlived a group kill, still on port 8000. Each is stopped before any is killed, so
    none starts a child that escapes."""
    if proc.poll() is not None:  # exited (and reaped): its pid may be another's now
        return
    stopped: set[int] = set()
    while found := {int(p) for p in os.listdir("/proc") if p.isdigit()
                    and descends_from(int(p), proc.pid)} - stopped - {proc.pid}:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= found
    proc.kill()
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def server_processes(targets: list[str], under: int | None = None) -> list[tuple[str, int]]:
    """(kind, pid) of this machine's shard actors and batcher replicas, by process title;
    with `under`, only those of the Ray instance that process started (another Ray instance
    on the machine, a second test lane's, keeps its processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        if under is not None and not descends_from(int(proc.name), under):
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if "shard" in targets and title.startswith("ray::ShardActor"):
            found.append(("shard", int(proc.name)))
        elif "batcher" in targets and is_replica_of(title, "Batcher"):
            found.append(("batcher", int(proc.name)))
    return sorted(found)


async def kv_blocks_used(client: httpx.AsyncClient, url: str) -> float | None:
    """raygen_kv_blocks_used summed over the series GET /metrics shows (None: no answer)."""
    try:
        text = (await client.get(url + "/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    values = re.findall(r"^raygen_kv_blocks_used(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


async def _watch_health(client: httpx.AsyncClient, url: str, stop: asyncio.Event,
                        samples: list[tuple[float, bool]]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            ok = (await client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            ok = False
        samples.append((t, ok))
        await asyncio.sleep(max(0.0, HEALTH_PERIOD_S - (time.monotonic() - t)))


def availability(samples: list[tuple[float, bool]], end: float) -> float:
    """Share of time /health said 200: each probe's answer holds until the next probe."""
    if not samples:
        return 0.0
    starts = [t for t, _ in samples[1:]] + [end]
    up = sum(min(nxt, end) - t for (t, ok), nxt in zip(samples, starts, strict=True)
             if ok and t < end)
    return up / max(end - samples[0][0], 1e-9)


async def _await_recovery(client: httpx.AsyncClient, url: str, killed_at: float) -> float | None:
    """Seconds from the kill until a request sent after it succeeds (None: not in time)."""
    while time.monotonic() - killed_at < RECOVERY_TIMEOUT_S:
        try:
            r = await client.post(url + "/generate", timeout=60, json={
                "inputs": "kari tona", "parameters": {"max_new_tokens": 2}})
            if r.status_code == 200:
                return round(time.monotonic() - killed_at, 1)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    return None


async def _kill_now_and_then(client, url, rng, kill_every, max_kills, targets, stop_killing,
                             kills: list[dict], under: int | None) -> None:
    last_kill = time.monotonic()
    while not stop_killing.is_set() and (max_kills is None or len(kills) < max_kills):
        wait = last_kill + rng.uniform(*kill_every) - time.monotonic()
        try:
            await asyncio.wait_for(stop_killing.wait(), max(wait, 0.0))
            return
        except asyncio.TimeoutError:
            pass
        victims = server_processes(targets, under)
        if not victims:  # between replicas: try again shortly
            last_kill = time.monotonic() - kill_every[0] + 1
            continue
        kind, pid = rng.choice(victims)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        last_kill = time.monotonic()
        kill = {"target": kind, "pid": pid, "recovery_s": None}
        kills.append(kill)
        kill["recovery_s"] = await _await_recovery(client, url, last_kill)


async def chaos(url: str, duration: float, concurrency: int,
                kill_every: tuple[float, float] = (30.0, 60.0), max_kills: int | None = None,
                targets: list[str] | None = None, seed: int = 0, under: int | None = None) -> dict:
    rng = random.Random(seed)
    targets = targets or ["shard", "batcher"]
    tally, kills, samples = Tally(), [], []
    stop_load, stop_killing, stop_health = asyncio.Event(), asyncio.Event(), asyncio.Event()
    timeout = httpx.Timeout(HANG_AFTER_S, connect=30)
    limits = httpx.Limits(max_connections=concurrency * 2 + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def stream_forever() -> None:
            while not stop_load.is_set():
                failed_before = tally.counts["failed_with_error"]
                await one(client, url, "stream", rng, tally)
                if tally.counts["failed_with_error"] > failed_before:
                    await asyncio.sleep(1.0)  # as a client would before retrying

        health = asyncio.create_task(_watch_health(client, url, stop_health, samples))
        workers = [asyncio.create_task(stream_forever()) for _ in range(concurrency)]
        killer = asyncio.create_task(_kill_now_and_then(
            client, url, rng, kill_every, max_kills, targets, stop_killing, kills, under))
        started = time.monotonic()
        await asyncio.sleep(duration)
        if max_kills is not None:  # a bounded run ends once its kills have recovered
            await asyncio.wait({killer}, timeout=max_kills * (kill_every[1] + RECOVERY_TIMEOUT_S))
        stop_killing.set()
        await killer  # a recovery under way is awaited (bounded by RECOVERY_TIMEOUT_S)
        stop_load.set()
        await asyncio.gather(*workers)  # each ends within HANG_AFTER_S
        ended = time.monotonic()
        stop_health.set()
        await health
        kv = await kv_blocks_used(client, url)
        deadline = time.monotonic() + KV_DRAIN_TIMEOUT_S
        while kv != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            kv = await kv_blocks_used(client, url)
    return {**tally.as_dict(), "duration_s": round(ended - started, 1),
            "availability": round(availability(samples, ended), 3), "kills": len(kills),
            "recovery_s": [k["recovery_s"] for k in kills],
            "killed": [k["target"] for k in kills], "kv_blocks_used_after": kv,
            "lost_examples": tally.lost[:5]}


def succeeded(result: dict) -> bool:
    """Nothing hung or lost, every kill recovered, and the KV cache drained."""
    return (not result["hung"] and not result["lost"] and result["kv_blocks_used_after"] == 0
            and None not in result["recovery_s"])
