"""Multi-turn sessions against several batcher replicas: does each turn find its prefix?

    python -m benchmarks.sessions [--model models/demo-small] [--sessions 16] [--turns 4]

One `serve run` holds three applications of the same model, measured one after the other
with the same workload: `ideal` (one batcher replica: every turn meets the cache its
session left), `default` (two replicas, Serve's power-of-two router) and `raygen` (two
replicas, deployments/router.py). Each session has its own long system prompt; its turns
go in order (each resends the history: system prompt, earlier turns, the answers), the
sessions run concurrently. Greedy, streamed /v1/completions with token-id prompts.
Reported per application: cached prompt tokens (usage.prompt_tokens_details.cached_tokens)
over prompt tokens, and over the ideal's; TTFT p50/p99; output tok/s; requests per
replica (from /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.serve import StreamError, default_sigint, serve_config_file, sse_events

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


@dataclass
class Turn:
    session: int
    turn: int
    prompt: list[int]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    text: str = ""
    error: str | None = None


@dataclass
class Workload:
    sessions: int = 16
    turns: int = 4
    system_len: int = 512
    user_len: int = 32
    max_tokens: int = 16
    seed: int = 0
    vocab: int = 8000
    think_s: float = 0.0  # pause before each later turn (a user reading the answer)

    def make(self) -> list[tuple[list[int], list[list[int]]]]:
        rng = random.Random(self.seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(5, self.vocab) for _ in range(n)]

        return [(ids(self.system_len), [ids(self.user_len) for _ in range(self.turns)])
                for _ in range(self.sessions)]


async def _turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                max_tokens: int, result: Turn) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for event in sse_events(r):
                _add(result, event, start)
    except StreamError as exc:
        result.error = str(exc)


def _add(result: Turn, event: dict, start: float) -> None:
    """Fold one streamed event into the turn: its text, first-token time, usage."""
    for choice in event.get("choices") or []:
        if choice.get("text"):
            if not result.text:
                result.ttft = time.perf_counter() - start
            result.text += choice["text"]
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = usage["prompt_tokens"]
        result.output_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


async def run_sessions(url: str, model: str, tokenizer, workload: Workload,
                       timeout: float = 600) -> dict:
    """Every session's turns in order, the sessions concurrently. Returns the summary and
    each turn's result (in session, turn order)."""
    plan = workload.make()
    results: list[Turn] = []

    async def session(client: httpx.AsyncClient, i: int) -> None:
        system, users = plan[i]
        history = list(system)
        for t, user in enumerate(users):
            if t and workload.think_s:
                await asyncio.sleep(workload.think_s)
            prompt = history + user
            result = Turn(i, t, prompt)
            results.append(result)
            await _turn(client, url, model, prompt, workload.max_tokens, result)
            if result.error:
                return
            history = prompt + tokenizer.encode(result.text, add_special_tokens=False)

    limits = httpx.Limits(max_connections=2 * workload.sessions + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(session(client, i) for i in range(workload.sessions)))
        duration = time.perf_counter() - start
    results.sort(key=lambda r: (r.session, r.turn))
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft for r in ok if r.ttft)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "requests": len(results), "errors": [r.error for r in results if r.error],
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "cached_ratio": cached / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "duration_s": duration, "turns": results,
    }


def requests_per_replica(metrics_text: str) -> dict[str, float]:
    """Prefill and decode steps' requests are not exported; prompt tokens looked up in
    the prefix cache are, per replica: a replica that served nothing looked up none."""
    found = re.findall(r'^raygen_prefix_cache_queries_total\{replica="([^"]+)"\} (\S+)$',
                       metrics_text, re.M)
    return {replica: float(value) for replica, value in found}


def serve_config(model: str, port: int, apps: dict[str, tuple]) -> str:
    """One `serve run` config: each app name -> (batcher replicas, router class or None
    for raygen's[, request_router_kwargs])."""
    applications = []
    for name, (replicas, router, *kwargs) in apps.items():
        batcher = {"name": "Batcher", "num_replicas": replicas}
        if router or kwargs:
            from deployments.router import ROUTER_PATH

            batcher["request_router_config"] = {
                "request_router_class": router or ROUTER_PATH,
                "request_router_kwargs": kwargs[0] if kwargs else {},
                "request_routing_stats_period_s": 1}
        applications.append({
            "name": name, "route_prefix": f"/{name}", "import_path": "deployments.app:build_app",
            "args": {"model": model, "max_concurrent_requests": 256},
            "deployments": [batcher]})
    config = {"http_options": {"host": "127.0.0.1", "port": port}, "applications": applications}
    return serve_config_file(config)


def wait_healthy(base: str, apps, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(apps)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError("serve run exited early")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy in {timeout:.0f} s: {sorted(pending)}")
        for name in list(pending):
            try:
                if httpx.get(f"{base}/{name}/health", timeout=5).status_code == 200:
                    pending.discard(name)
            except httpx.HTTPError:
                pass
        time.sleep(1)


def table(results: dict[str, dict]) -> str:
    ideal = results.get("ideal", {}).get("cached_tokens") or 0
    rows = ["| application | replicas | cached / prompt tokens | of ideal | TTFT p50 | TTFT p99 "
            "| output tok/s | prefix lookups per replica |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        of_ideal = f"{r['cached_tokens'] / ideal:.0%}" if ideal else "-"
        per = " / ".join(f"{v:,.0f}" for v in r["per_replica"].values())
        rows.append(f"| {name} | {len(r['per_replica'])} | {r['cached_ratio']:.1%} | {of_ideal} "
                    f"| {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms "
                    f"| {r['output_tok_s']:.1f} | {per} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo-small")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=0.0, help="pause before each later turn")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="benchmarks/reports/sessions.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workload = Workload(args.sessions, args.turns, args.system_len, args.user_len,
                        args.max_tokens, vocab=min(tokenizer.vocab_size, 8000),
                        think_s=args.think_s)
    apps = {"ideal": (1, None), "default": (2, DEFAULT_ROUTER), "raygen": (2, None)}
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "RAY_ENABLE_AUTO_CONNECT": "0"}
    serve_bin = str(Path(sys.executable).with_name("serve"))
    log = open(Path(tempfile.gettempdir()) / "raygen-sessions-serve.log", "wb")
    proc = subprocess.Popen([serve_bin, "run", serve_config(args.model, args.port, apps)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=default_sigint)
    results = {}
    try:
        wait_healthy(base, apps, proc, timeout=600)
        for name in apps:
            summary = asyncio.run(run_sessions(f"{base}/{name}", args.model, tokenizer, workload))
            time.sleep(2)  # replicas push their metrics every 0.5 s
            summary["per_replica"] = requests_per_replica(
                httpx.get(f"{base}/{name}/metrics", timeout=10).text)
            summary.pop("turns")
            results[name] = summary
            print(name, {k: v for k, v in summary.items() if k != "errors"},
                  f"{len(summary['errors'])} errors", flush=True)
    finally:
        os.killpg(proc.pid, 2)
        proc.wait(120)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": vars(workload), "results": results},
                                         indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
