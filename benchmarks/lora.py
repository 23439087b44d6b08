"""Multi-LoRA throughput: requests spread over several adapters against the base model
alone, on the same server in one run.

    python -m benchmarks.lora --model models/SmolLM2-135M-Instruct.Q4_1.gguf

Writes `--adapters` random PEFT adapters of rank `--rank` over every attention and MLP
projection of the model (what a full LoRA fine-tune saves), starts raygen once with them
(`serve run`, the builder's defaults plus `lora_adapters`), and sends `--requests` prompts
at `--concurrency` through `/v1/completions` (`ignore_eos`, so every request generates
`--max-tokens`): to the base model, or spread round-robin over the adapters (`model` = the
adapter's name), `--passes` times each in alternation (base, adapters, adapters, base, ...:
each sees the same share of a machine that drifts). Each run has prompts of its own, so
none is served from the prefix cache that another run filled. Reports output
tokens/s of each and their ratio (the target: >= 0.85x)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import compare
from benchmarks.speculation import free_prompts

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model: str, path: Path, rank: int, seed: int) -> None:
    """A PEFT adapter of `rank` over every projection of `model`, A and B random (small)."""
    import torch
    from safetensors.torch import save_file

    from shards.model.config import ModelConfig

    c = ModelConfig.from_pretrained(model)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
              "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for name, (out, inp) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS), "bias": "none", "base_model_name_or_path": model}))


async def load(models: list[str], prompts: list[str], concurrency: int,
               max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{compare.PORT}",
                                 timeout=1800) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            async with sem:
                r = await client.post("/v1/completions", json={
                    "model": models[i % len(models)], "prompt": prompts[i],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        duration = time.perf_counter() - start
    return {"output_tokens": tokens, "duration_s": round(duration, 2),
            "output_tok_s": round(tokens / duration, 2)}


async def load_while_streaming(late: tuple[str, str] | None, prompts: list[str],
                               streams: int = 8, tokens: int = 96, after_s: float = 1.0) -> dict:
    """`streams` base-model streams; `after_s` into them the adapter `late` (name, path) is
    loaded (`/v1/load_lora_adapter`) and asked for once (None: the base model is asked,
    the control: what any request arriving costs the streams). What the streams saw:
    failures, and the longest gap between two of a stream's tokens while the load and that
    request ran, against the streams' median gap (a step)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{compare.PORT}",
                                 timeout=600) as client:
        async def stream(prompt: str) -> list[float]:
            stamps = []
            # TGI's stream, an event a token. Its parameters have no `ignore_eos` (refused
            # there; before, silently dropped): on the demo models' random weights EOS is rare.
            async with client.stream("POST", "/generate_stream", json={"inputs": prompt,
                    "parameters": {"max_new_tokens": tokens}}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"token"' in line:
                        stamps.append(time.perf_counter())
            return stamps

        async def load_and_ask() -> tuple[float, float, int]:
            await asyncio.sleep(after_s)
            start = time.perf_counter()
            parameters = {"max_new_tokens": 8}
            if late is not None:
                r = await client.post("/v1/load_lora_adapter", json={"lora_name": late[0],
                                                                      "lora_path": late[1]})
                r.raise_for_status()
                parameters["adapter_id"] = late[0]
            asked = await client.post("/generate", json={"inputs": prompts[-1],
                                                         "parameters": parameters})
            return start, time.perf_counter(), asked.status_code

        *stamps, loaded = await asyncio.gather(
            *(stream(p) for p in prompts[:streams]), load_and_ask(), return_exceptions=True)
    if isinstance(loaded, BaseException):
        raise loaded
    start, end, status = loaded
    failed = [s for s in stamps if isinstance(s, BaseException)]
    ok = [s for s in stamps if not isinstance(s, BaseException)]
    pairs = [(a, b) for s in ok for a, b in zip(s[:-1], s[1:], strict=True)]
    gaps = sorted(b - a for a, b in pairs)
    during = [b - a for a, b in pairs if b > start and a < end]
    median = gaps[len(gaps) // 2] if gaps else None
    return {"streams": streams, "failed": len(failed) + sum(len(s) != tokens for s in ok),
            "late_status": status, "load_and_request_s": round(end - start, 3),
            "median_gap_ms": median and round(1000 * median, 1),
            "max_gap_during_ms": round(1000 * max(during), 1) if during else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--extra", default="", help="more builder args, `key=value+key=value`")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="raygen-lora-"))
    adapters = {}
    for i in range(args.adapters):
        adapters[f"lora{i}"] = str(scratch / f"lora{i}")
        write_random_adapter(args.model, scratch / f"lora{i}", args.rank, seed=i)
    write_random_adapter(args.model, scratch / "late", args.rank, seed=args.adapters)
    builder = {"model": args.model, "lora_adapters": adapters, "max_loras": args.adapters}
    builder.update(dict(kv.split("=", 1) for kv in args.extra.split("+") if kv))
    server = compare.Server(
        "raygen-lora", "raygen with LoRA adapters",
        [str(Path(sys.executable).with_name("serve")), "run",
         compare._serve_config("deployments.app:build_app", builder)],
        {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "RAY_ENABLE_AUTO_CONNECT": "0"})
    prompts = free_prompts(args.requests, seed=7)  # the warm-up's and the streams'
    base_name = Path(args.model).name
    runs: dict[str, list[dict]] = {"base": [], "adapters": []}
    order = [("base", "adapters"), ("adapters", "base")] * args.passes  # alternating
    results = {"model": args.model, "machine": compare.machine_description(args.model),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    proc = compare.start(server, scratch / "server.log")
    try:
        asyncio.run(load([base_name, *adapters], prompts[:5], 5, 4))  # warm every path
        for pair in order[:args.passes]:
            for kind in pair:
                models = [base_name] if kind == "base" else list(adapters)
                fresh = free_prompts(args.requests, seed=100 + len(runs["base"] + runs["adapters"]))
                row = asyncio.run(load(models, fresh, args.concurrency, args.max_tokens))
                runs[kind].append(row)
                print(f"  {kind}: {row['output_tok_s']} tok/s ({row['output_tokens']} tokens)",
                      flush=True)
        for key, late in (("request_while_streaming", None),
                          ("load_while_streaming", ("late", str(scratch / "late")))):
            results[key] = asyncio.run(load_while_streaming(late, prompts))
            print(f"  {key}: {results[key]}", flush=True)
    finally:
        compare.stop(proc, server.stop_signal)
    mean = {k: sum(r["output_tok_s"] for r in v) / len(v) for k, v in runs.items()}
    results.update(runs=runs, mean_tok_s=mean, ratio=round(mean["adapters"] / mean["base"], 3))
    print(f"\nconcurrency {args.concurrency}, {args.adapters} adapters of rank {args.rank}: "
          f"base {mean['base']:.1f} tok/s, adapters {mean['adapters']:.1f} tok/s, "
          f"{results['ratio']:.2f}x")
    path = out_dir / f"lora-{time.strftime('%Y-%m-%d-%H%M')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"written: {path}")
    return results


if __name__ == "__main__":
    main()
