"""The serving plane's floor: raygen's process shape with no model and no engine.

    serve run benchmarks.serving_floor:build_app step_ms=20 [hop=none]
    python -m benchmarks.serving_floor load --num-prompts 16 --output-len 72
    python -m benchmarks.serving_floor idle --seconds 30

The app is an HTTP ingress replica streaming `/v1/completions` (SSE), a batcher replica that
the ingress streams from through a Serve handle, and a shard actor that the batcher calls
once per token, as raygen's serving app does; each "step" is a sleep of `step_ms` in the
shard, which uses no CPU (`hop=none`: in the batcher, with no shard actor, so that the
difference is the step call's own cost). Ray, Serve and HAProxy run with the settings
raygen's app gives them (throughput mode under `serve run`, `REPLICA_ENV`). At concurrency 1, every
millisecond of CPU the node spends per token here is what Ray, Serve, HAProxy, the HTTP
stack and the load generator cost on their own: the least a server of this shape can add to
a forward that keeps every core busy (benchmarks/NOTES.md 52).

`load` runs `benchmarks.serve` (at concurrency 1 unless `--concurrency`) between two
snapshots of every process's CPU time (/proc) and prints CPU per output token by process;
`idle` prints each process's CPU in ms a second over a quiet window. Both work against any
server on the node, raygen's included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from deployments.app import REPLICA_ENV, THROUGHPUT_MODE_ENV, serve_run_starts_ray


@ray.remote(num_cpus=0)
class SleepShard:
    """A shard whose step is a sleep: the step call costs what Ray's actor call costs."""

    def __init__(self, step_ms: float):
        self.step_s = step_ms / 1000

    @ray.method(enable_task_events=False)  # as ShardActor.step_in_order
    def step(self, token: int) -> int:
        time.sleep(self.step_s)
        return token + 1


@serve.deployment
class Batcher:
    def __init__(self, step_ms: float, hop: str = "actor"):
        self.shard = SleepShard.remote(step_ms) if hop == "actor" else None
        self.step_s = step_ms / 1000

    async def generate(self, max_tokens: int) -> AsyncIterator[int]:
        token = 0
        for _ in range(max_tokens):
            if self.shard is None:  # what the step call itself costs, by difference
                await asyncio.sleep(self.step_s)
                token += 1
            else:
                token = await self.shard.step.remote(token)
            yield token


@serve.deployment
class Ingress:
    def __init__(self, batcher):
        self.batcher = batcher.options(stream=True)

    async def __call__(self, request: Request):
        if request.url.path.endswith("/health"):
            return JSONResponse({})
        body = await request.json()
        max_tokens = int(body.get("max_tokens", 16))
        prompt_tokens = len(body.get("prompt") or [])

        async def events() -> AsyncIterator[str]:
            count = 0
            async for token in self.batcher.generate.remote(max_tokens):
                count += 1
                event = {"choices": [{"index": 0, "text": f" t{token}"}]}
                yield f"data: {json.dumps(event)}\n\n"  # one body message an event
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def build_app(args: dict) -> serve.Application:
    if serve_run_starts_ray():  # as raygen's builder does for `serve run IMPORT_PATH`
        for key, value in THROUGHPUT_MODE_ENV.items():
            os.environ.setdefault(key, value)
    hop = args.get("hop", "actor")
    if hop not in ("actor", "none"):
        raise ValueError(f"hop must be 'actor' (a shard actor call per step) or 'none' "
                         f"(the batcher sleeps the step itself), not {hop!r}")
    options = {"num_cpus": 0, "runtime_env": {"env_vars": dict(REPLICA_ENV)}}
    batcher = Batcher.options(ray_actor_options=options).bind(
        float(args.get("step_ms", 20)), hop)
    return Ingress.options(ray_actor_options=options).bind(batcher)


def cpu_snapshot() -> dict[str, tuple[str, float]]:
    """Every process's CPU seconds (user + system) by pid, with a short name."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (f"{comm} | {cmd[:60]}", (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_between(before: dict, after: dict, per: float, floor: float) -> tuple[float, list]:
    """Total CPU seconds / `per`, and the processes at or above `floor` of it."""
    rows = sorted(((cpu - before.get(pid, ("", 0.0))[1]) / per, name)
                  for pid, (name, cpu) in after.items())
    total = sum(v for v, _ in rows if v > 0)
    return total, [(v, name) for v, name in reversed(rows) if v >= floor]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["load", "idle"])
    p.add_argument("--seconds", type=float, default=30.0, help="idle: the window")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1,
                   help="load: requests in flight (1 shows the floor per token)")
    p.add_argument("--input-len", type=int, default=112)
    p.add_argument("--output-len", type=int, default=72)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--seed", type=int, default=None, help="load: the prompts' seed (default: "
                   "from the clock, so that a second run on one server misses its prefix cache)")
    args = p.parse_args(argv)
    if args.what == "idle":
        before = cpu_snapshot()
        time.sleep(args.seconds)
        total, rows = cpu_between(before, cpu_snapshot(), args.seconds / 1000, 1.0)
        print(f"idle over {args.seconds:.0f} s: {total:.1f} ms of CPU a second")
        for value, name in rows:
            print(f"{value:8.1f}  {name}")
        return {"cpu_ms_per_s": total, "processes": rows}
    from benchmarks import serve as load

    # Prompts the server has not seen: a repeated prompt is served from the prefix cache
    # (in one run, the warm-up's would be the measured run's first ones).
    seed = args.seed if args.seed is not None else time.time_ns() % 2**31
    print(f"prompts from seed {seed}")
    common = ["--url", args.url, "--concurrency", str(args.concurrency),
              "--input-len", str(args.input_len),
              "--output-len", str(args.output_len)]
    asyncio.run(load.run(load.parse_args([*common, "--num-prompts", "4",
                                          "--seed", str(seed + 1_000_003)])))  # warm-up
    before = cpu_snapshot()
    summary = asyncio.run(load.run(load.parse_args([*common, "--num-prompts",
                                                    str(args.num_prompts), "--seed", str(seed)])))
    tokens = summary["total_output_tokens"]
    if summary["failed"] or not tokens or summary["median_itl_ms"] is None:
        raise SystemExit(f"the load did not stream tokens from {args.url}: {summary['errors']}")
    total, rows = cpu_between(before, cpu_snapshot(), tokens / 1000, 0.05)
    print(f"{summary['output_throughput']:.1f} tok/s, ITL p50 {summary['median_itl_ms']:.1f} ms, "
          f"{total:.2f} ms of CPU per output token ({tokens} tokens)")
    for value, name in rows:
        print(f"{value:8.2f}  {name}")
    return {**summary, "cpu_ms_per_token": total, "processes": rows, "seed": seed}


if __name__ == "__main__":
    main()
