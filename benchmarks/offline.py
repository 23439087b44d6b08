"""Offline throughput: raygen's engine vs transformers' own continuous batching
(`generate_batch`) vs one-at-a-time `generate`, same model, same prompts, one run.

    python -m benchmarks.offline [--model DIR] [--num-prompts 64] [--max-new-tokens 64]

Reports output tokens/s of each and the ratios; all three run greedy, so it also reports
how many outputs agree token for token with one-at-a-time `generate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]


def bench_raygen(model: str, prompts, max_new: int) -> tuple[float, list[list[int]]]:
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model, max_batch_prefill_tokens=2048, kv_cache_memory=4 << 30)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def bench_generate_batch(model: str, prompts, max_new: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    if not torch.cuda.is_available():
        # transformers 4.x sizes its cache from GPU memory stats, None on CPU. Blocks and
        # batch tokens are fixed below, so only its final footprint check reads memory:
        # give that check the same 4 GiB budget raygen's KV cache gets.
        cb_cache.PagedAttentionMemoryHandler.get_available_memory = staticmethod(
            lambda max_memory_percent=1.0: 4 << 30)
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa_paged",
                                              dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                              pad_token_id=0, num_blocks=4096, max_batch_tokens=512)
    hf.generate_batch(prompts[:2], config, progress_bar=False)  # warm-up
    t0 = time.perf_counter()
    results = hf.generate_batch(prompts, config, progress_bar=False)
    elapsed = time.perf_counter() - t0
    ordered = sorted(results.values(), key=lambda r: int(r.request_id.split("_")[-1]))
    return elapsed, [r.generated_tokens for r in ordered]


def bench_generate(model: str, prompts, max_new: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def one(p):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, attention_mask=torch.ones(1, len(p)),
                              pad_token_id=0)
        return out[0, len(p):].tolist()

    one(prompts[0][:8])  # warm-up
    t0 = time.perf_counter()
    outs = [one(p) for p in prompts]
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/demo-small")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sequential-prompts", type=int, default=16,
                        help="one-at-a-time generate is slow: time this many (a rate is reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if not (Path(args.model) / "config.json").exists():
        from shards.demo_model import write_demo_model

        write_demo_model(args.model, "small")
    import json

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab,
                           args.seed)
    print(f"model {args.model}, {len(prompts)} prompts of {args.min_prompt_len}-"
          f"{args.max_prompt_len} tokens, {args.max_new_tokens} new tokens each, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    rows = {}
    seq = prompts[: args.sequential_prompts]
    for name, fn, batch in (("raygen", bench_raygen, prompts),
                            ("transformers generate_batch", bench_generate_batch, prompts),
                            ("transformers generate (one at a time)", bench_generate, seq)):
        elapsed, outs = fn(args.model, batch, args.max_new_tokens)
        tokens = sum(len(o) for o in outs)
        rows[name] = (tokens / elapsed, elapsed, tokens, outs)
        print(f"{name:40s} {tokens:6d} tokens in {elapsed:7.2f} s = {tokens / elapsed:8.1f} tok/s",
              flush=True)

    ref = rows["transformers generate (one at a time)"][3]
    base = rows["raygen"][0]
    eos = set(json.loads((Path(args.model) / "generation_config.json").read_text())["eos_token_id"])

    def until_eos(tokens: list[int]) -> list[int]:
        # generate's min_new_tokens masks EOS; the others ignore it: compare up to it.
        return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]

    print()
    for name, (rate, _, _, outs) in rows.items():
        same = sum(until_eos(a) == until_eos(b) for a, b in zip(outs, ref, strict=False))
        print(f"raygen / {name:40s} = {base / rate:5.2f}x   "
              f"(outputs equal to one-at-a-time generate up to EOS: {same}/{len(ref)})")


if __name__ == "__main__":
    main()
