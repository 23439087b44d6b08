"""The limit: the shard's forward alone, no scheduler, no Ray, no HTTP.

    python -m benchmarks.limit [--model DIR] [--input-len 128] [--output-len 64]

Times one prefill of `--input-len` tokens and one decode step at each batch size, then
derives, for each concurrency C, the work-conserving limit of output tokens/s for that
workload: every request's prefill plus `--output-len` decode steps at batch C, nothing
else. A server's end-to-end throughput divided by this is its efficiency."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.messages import CachedRequestData, NewRequestData, StepInput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from shards.worker.model_runner import ModelRunner, ShardConfig  # noqa: E402


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: str, input_len: int, batch_sizes: list[int], repeats: int = 5,
            decode_context: int | None = None, cpu_matmul: str = "auto",
            dtype: str = "auto") -> dict:
    """Prefill of `input_len` tokens; decode steps with `decode_context` tokens already in
    each sequence (default input_len; a workload's mean is input_len + output_len / 2)."""
    block_size = 16
    decode_context = decode_context or input_len
    longest = max(input_len, decode_context)
    blocks_per_seq = -(-(longest + 2 * repeats + 8) // block_size)
    num_blocks = blocks_per_seq * max(batch_sizes) + 1
    runner = ModelRunner(ShardConfig(model=model, num_blocks=num_blocks, block_size=block_size,
                                     cpu_matmul=cpu_matmul, dtype=dtype))
    runner.warmup(0)  # allocates the KV cache
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)

    def new(i: int, length: int = input_len) -> NewRequestData:
        blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        tokens = [1] + [10 + j % 1000 for j in range(length - 1)]
        return NewRequestData(f"r{i}", tokens, length, blocks, 0, params, seed=i)

    def prefill_one() -> None:
        runner.step(StepInput([new(0)], [], {"r0": input_len}, ["r0"]))

    result = {"prefill_s": _timed(prefill_one, repeats), "decode_step_s": {}}
    for batch in batch_sizes:
        ids = [f"r{i}" for i in range(batch)]
        runner.step(StepInput([new(i, decode_context) for i in range(batch)], [],
                              dict.fromkeys(ids, decode_context), list(runner.seqs)))
        position = {"n": decode_context}

        def decode(ids: list[str] = ids, position: dict = position) -> None:
            cached = [CachedRequestData(r, [], position["n"]) for r in ids]
            runner.step(StepInput([], cached, dict.fromkeys(ids, 1)))
            position["n"] += 1

        result["decode_step_s"][batch] = _timed(decode, repeats)
    return result


def limit_tok_s(timings: dict, concurrency: int, output_len: float) -> float:
    """C requests: C prefills, then output_len decode steps at batch C (with varied
    lengths, output_len is the mean and the batch is assumed kept full)."""
    step = timings["decode_step_s"][concurrency]
    return concurrency * output_len / (concurrency * timings["prefill_s"] + output_len * step)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/demo-small")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=float, default=64,
                        help="output tokens per request (a workload's mean)")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-context", type=int, default=None,
                        help="tokens in each sequence during the timed decode steps "
                             "(default: input-len + output-len / 2, the workload's mean)")
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "onednn", "torch"],
                        help="who multiplies by the weights on CPU (shards/model/layers.py)")
    parser.add_argument("--dtype", default="auto", help="as the server's `dtype=`")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv)
    if not args.model.endswith(".gguf") and not (Path(args.model) / "config.json").exists():
        from shards.demo_model import write_demo_model

        write_demo_model(args.model, "small")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    decode_context = args.decode_context or int(args.input_len + args.output_len / 2)
    timings = measure(args.model, args.input_len, batches, args.repeats, decode_context,
                      args.cpu_matmul, args.dtype)
    print(f"prefill of {args.input_len} tokens: {timings['prefill_s'] * 1000:.1f} ms; "
          f"decode steps at {decode_context} tokens of context")
    out = {"timings": timings, "limit_output_tok_s": {}}
    for batch in batches:
        step = timings["decode_step_s"][batch]
        limit = limit_tok_s(timings, batch, args.output_len)
        out["limit_output_tok_s"][batch] = limit
        print(f"batch {batch:3d}: decode step {step * 1000:7.1f} ms = {batch / step:7.1f} tok/s; "
              f"work-conserving limit at concurrency {batch}: {limit:7.1f} output tok/s")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
