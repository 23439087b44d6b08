"""Soak: a bounded mixed load on a running server (loopback only), then the account.

    python -m benchmarks.soak [--url http://127.0.0.1:8000] [--duration 60] [--concurrency 16]
    python -m benchmarks.soak --chaos [--duration 300] [--kill-every 30 60] [--kills K]

Mixes streaming and plain TGI requests, OpenAI chat, streams cancelled part way, and bad
requests. Every request must end in one of: succeeded (complete output), rejected as
expected (a bad request got its 4xx), failed with a clear error (an error body or event).
A request that gets nothing for the client's read timeout is hung; one that ends otherwise
(a cut connection, a stream with neither details nor error) is lost. The run exits non-zero
when anything hung or was lost. `--chaos` kills server processes under load (chaos.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from benchmarks.mixed_load import Tally, one

KINDS = ["stream", "generate", "chat", "cancel", "bad"]
WEIGHTS = [35, 20, 15, 15, 15]


def server_rss_mib() -> float:
    """Resident memory of this machine's Ray worker processes (the server's replicas)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if not cmdline.startswith(b"ray::"):
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def soak(url: str, duration: float, concurrency: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tally = Tally()
    rss_start = server_rss_mib()
    deadline = time.monotonic() + duration

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await one(client, url, rng.choices(KINDS, WEIGHTS)[0], rng, tally)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return {**tally.as_dict(), "rss_start_mib": round(rss_start, 1),
            "rss_end_mib": round(server_rss_mib(), 1), "lost_examples": tally.lost[:5]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds (default 60; 300 with --chaos)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos", action="store_true",
                        help="streams only, and SIGKILL a shard or batcher process now and "
                             "then (benchmarks/chaos.py); duration defaults to 300 s")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(30.0, 60.0),
                        metavar=("MIN", "MAX"), help="--chaos: seconds between kills")
    parser.add_argument("--kills", type=int, default=None,
                        help="--chaos: stop after this many kills, once they recovered")
    parser.add_argument("--targets", default="shard,batcher",
                        help="--chaos: which processes to kill (shard, batcher)")
    parser.add_argument("--result-file", default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        parser.error("soak only targets this machine (loopback)")
    if args.chaos:
        from benchmarks.chaos import chaos, succeeded

        result = asyncio.run(chaos(
            args.url, args.duration or 300.0, args.concurrency,
            tuple(args.kill_every), args.kills, args.targets.split(","), args.seed))
        ok = succeeded(result)
    else:
        result = asyncio.run(soak(args.url, args.duration or 60.0, args.concurrency, args.seed))
        ok = not result["lost"] and not result["hung"]
    for key, value in result.items():
        print(f"{key + ':':24s} {value}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
