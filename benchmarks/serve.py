"""Serving load generator: latency and throughput of an HTTP text-generation server.

    python -m benchmarks.serve --url http://127.0.0.1:8000 --backend openai \\
        --num-prompts 64 --concurrency 32 --input-len 128 --output-len 64

Sends prompts of exact token lengths (random token ids; `--range-ratio` varies them) at a
fixed concurrency, or at `--request-rate` requests/s with Poisson (`--burstiness 1`) or
gamma arrivals, streaming every response. Prints vLLM `bench serve`'s labels and writes a
JSON result file. Backends: `openai` (/v1/completions, token-id prompts, `ignore_eos`),
`openai-chat` (/v1/chat/completions) and `tgi` (/generate_stream). With `--tokenizer`,
every backend gets text prompts that this tokenizer encodes to exactly `--input-len`
tokens (for servers that take only strings). Loopback only."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def default_sigint() -> None:
    """`preexec_fn` for a server that is stopped with Ctrl-C (SIGINT) as a user would: a
    shell that starts jobs in the background without job control starts them with SIGINT
    ignored, Python then installs no KeyboardInterrupt handler, and `serve run` would
    sleep through the stop until it is killed (leaving Serve's HAProxy behind)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def serve_config_file(config: dict) -> str:
    """A `serve run` config file holding `config` (YAML is a superset of JSON), named by its
    contents in one directory under the temporary one: the same config is the same file, so
    runs leave no directory behind each (a run may end by os._exit, with no clean-up)."""
    text = json.dumps(config, sort_keys=True)
    directory = Path(tempfile.gettempdir()) / "raygen-serve-configs"
    directory.mkdir(exist_ok=True)
    path = directory / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # whole: another run may read it at once
    return str(path)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def make_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                  seed: int, output_range: tuple[int, int] | None = None
                  ) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    def out_len() -> int:
        return rng.randint(*output_range) if output_range else length(output_len)

    return [([rng.randrange(5, vocab) for _ in range(length(input_len))], out_len())
            for _ in range(num)]


def exact_text(tokenizer, token_ids: list[int]) -> str:
    """Text that `tokenizer` encodes to exactly len(token_ids) tokens, made of those ids'
    pieces (decoding a whole random id list rarely round-trips: pieces merge). A piece
    that would overshoot is skipped for the next id."""
    n, text, i = len(token_ids), "", 0
    count = 0
    while count < n:
        token = token_ids[i % len(token_ids)] + i // len(token_ids)  # wraps to fresh ids
        i += 1
        if i > 50 * n:
            raise ValueError(f"no text of exactly {n} tokens found")
        candidate = text + tokenizer.decode([token], skip_special_tokens=True)
        length = len(tokenizer.encode(candidate, add_special_tokens=False))
        if length <= n and candidate.strip():
            text, count = candidate, length
    return text


def _payload(backend: str, model: str, prompt: list[int] | str, output_len: int,
             ignore_eos: bool, text: str) -> tuple[str, dict]:
    extra = {"ignore_eos": True} if ignore_eos else {}  # some servers refuse unknown fields
    if backend == "openai":
        return "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    if backend == "openai-chat":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    return "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": output_len}}


class StreamError(Exception):
    """A streamed request that failed: its HTTP status or its `error` event."""


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of a streamed response (SSE `data:` lines; `[DONE]` skipped)."""
    if response.status_code != 200:
        raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
    async for line in response.aiter_lines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise StreamError(str(event["error"])[:200])
        yield event


async def post_stream(client: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    """POST `body` and return the response with its body unread (close it after reading).
    A kept-alive connection that the server closed after its last answer fails the next
    request before any response (llama.cpp's server does, about one request in ten).
    Nothing ran: the request goes again once, on a new connection, as the openai client
    retries it. A response that breaks off once begun is the caller's failure."""
    try:
        return await client.send(client.build_request("POST", url, json=body), stream=True)
    except httpx.RemoteProtocolError:
        return await client.send(client.build_request("POST", url, json=body), stream=True)


async def send(client: httpx.AsyncClient, url: str, backend: str, model: str,
               prompt: list[int] | str, output_len: int, ignore_eos: bool,
               text: str) -> RequestResult:
    path, body = _payload(backend, model, prompt, output_len, ignore_eos, text)
    result = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    try:
        r = await post_stream(client, url + path, body)
        try:
            async for event in sse_events(r):
                now = time.perf_counter()
                produced = _tokens_in(backend, event)
                if produced:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    if backend == "tgi":
                        result.output_tokens += produced
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        finally:
            await r.aclose()
        result.latency = time.perf_counter() - start
        result.success = result.output_tokens > 0
    except StreamError as exc:
        result.error = str(exc)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _tokens_in(backend: str, event: dict) -> int:
    if backend == "tgi":
        return 1 if "token" in event else 0
    choices = event.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if backend == "openai":
        content = choice.get("text")
    else:
        content = (choice.get("delta") or {}).get("content")
    return 1 if content else 0


async def run(args: argparse.Namespace) -> dict:
    output_range = (tuple(int(x) for x in args.output_range.split(","))
                    if args.output_range else None)
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                             args.vocab_size, args.seed, output_range)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        texts = [exact_text(tokenizer, prompt) for prompt, _ in requests]
    else:
        texts = [" ".join(f"w{t}" for t in prompt) for prompt, _ in requests]
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 64) * 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        warm_prompt = texts[0][:40] if args.tokenizer else requests[0][0][:8]
        warm = await send(client, args.url, args.backend, args.model, warm_prompt, 4,
                          args.ignore_eos, texts[0][:40])
        if not warm.success:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        semaphore = asyncio.Semaphore(args.concurrency or len(requests))

        async def one(i: int) -> RequestResult:
            async with semaphore:
                prompt, out_len = requests[i]
                if args.tokenizer:
                    prompt = texts[i]
                return await send(client, args.url, args.backend, args.model, prompt, out_len,
                                  args.ignore_eos, texts[i])

        start = time.perf_counter()
        tasks = []
        for i in range(len(requests)):
            tasks.append(asyncio.ensure_future(one(i)))
            if args.request_rate != float("inf"):
                # Gamma inter-arrival times; shape 1 (burstiness 1) is Poisson.
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


def _stats(values: list[float], name: str, unit_scale: float = 1000.0) -> dict:
    if not values:  # e.g. no ITL from a server that sends the whole answer at once
        return {f"{kind}_{name}_ms": None for kind in ("mean", "median", "p99")}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q / 100 * len(values)))]  # noqa: E731
    return {f"mean_{name}_ms": statistics.fmean(values) * unit_scale,
            f"median_{name}_ms": statistics.median(values) * unit_scale,
            f"p99_{name}_ms": pick(99) * unit_scale}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.success]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "backend": args.backend, "url": args.url, "num_prompts": len(results),
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (output + sum(r.prompt_len for r in ok)) / duration,
        **_stats([r.ttft for r in ok], "ttft"), **_stats(tpot, "tpot"),
        **_stats([x for r in ok for x in r.itl], "itl"), **_stats([r.latency for r in ok], "e2el"),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    return summary


def print_summary(s: dict) -> None:
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for metric, title in (("ttft", "Time to First Token"),
                          ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-----{title}-----", None))
        for kind in ("Mean", "Median", "P99"):
            value = s[f"{kind.lower()}_{metric}_ms"]
            rows.append((f"{kind} {metric.upper()} (ms):",
                         "n/a" if value is None else f"{value:.2f}"))
    for label, value in rows:
        print(label if value is None else f"{label:<40} {value:<10}")
    print("=" * 50)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--backend", choices=["openai", "openai-chat", "tgi"], default="openai")
    p.add_argument("--model", default="demo")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="fixed number in flight")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by +-ratio")
    p.add_argument("--output-range", default=None, metavar="LO,HI",
                   help="output lengths uniform in LO..HI (overrides --output-len)")
    p.add_argument("--tokenizer", default=None,
                   help="send text prompts of exactly --input-len tokens of this tokenizer")
    p.add_argument("--vocab-size", type=int, default=2000, help="token ids are drawn below this")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error("the load generator only targets this machine (loopback)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.result_file:
        with open(args.result_file, "w") as f:
            shown = {k: v for k, v in vars(args).items()
                     if k != "request_rate" or v != float("inf")}
            json.dump({**summary, "args": shown}, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
