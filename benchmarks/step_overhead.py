"""What Ray costs per step: the same decode steps run in-process, through shard actors
(TP=1, TP=2) with one object ref per step, and the bare round trip of an actor call
against a Ray Compiled Graph (ray.dag, shared-memory channels).

    python -m benchmarks.step_overhead [--model DIR] [--batch 8] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ray  # noqa: E402

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from shards.model.config import ModelConfig  # noqa: E402
from shards.worker.group import ShardGroup  # noqa: E402
from shards.worker.model_runner import ModelRunner, ShardConfig  # noqa: E402


def decode_step_ms(worker, model: str, num_blocks: int, batch: int, steps: int) -> float:
    """Median time of a decode step (batch requests) once every prompt is in."""
    from transformers import AutoTokenizer

    mc = ModelConfig.from_pretrained(model)
    engine = LLMEngine(SchedulerConfig(max_model_len=2048), CacheConfig(16, num_blocks),
                       AutoTokenizer.from_pretrained(model), mc.eos_token_ids, worker)
    for i in range(batch):
        engine.add_request(f"r{i}", [1] + [10 + i] * 31,
                           SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
    engine.step()  # the prefills
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[:-1]) * 1000


@ray.remote(num_cpus=0)
class Echo:
    def step(self, x):
        return None


def round_trip_us(n: int, tp: int) -> tuple[float, float]:
    """Bare per-step cost: ray.put + a call on each rank + wait, vs a compiled graph."""
    from ray.dag import InputNode, MultiOutputNode

    payload = {"r": list(range(64))}
    actors = [Echo.remote() for _ in range(tp)]
    ray.get([a.step.remote(None) for a in actors])
    t0 = time.perf_counter()
    for _ in range(n):
        ref = ray.put(payload)
        ray.get([a.step.remote(ref) for a in actors])
    plain = (time.perf_counter() - t0) / n * 1e6
    with InputNode() as inp:
        dag = MultiOutputNode([a.step.bind(inp) for a in actors])
    compiled = dag.experimental_compile()
    ray.get(compiled.execute(payload))
    t0 = time.perf_counter()
    for _ in range(n):
        ray.get(compiled.execute(payload))
    graph = (time.perf_counter() - t0) / n * 1e6
    compiled.teardown()
    for a in actors:
        ray.kill(a)
    return plain, graph


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/demo-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run")
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from shards.demo_model import write_demo_model

        write_demo_model(args.model, "small")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = ShardConfig(model=args.model, num_blocks=256)

    runner = ModelRunner(config)
    runner.allocate_kv_cache(256)
    local = decode_step_ms(runner, args.model, 256, args.batch, args.steps)
    del runner
    print(f"decode step, batch {args.batch}, in-process:             {local:7.2f} ms")
    for tp in tps:
        for compiled in (False, True):
            group = ShardGroup(config, tp, num_cpus_per_shard=0, compiled_graph=compiled)
            group.warmup(4096)
            remote = decode_step_ms(group, args.model, group.num_blocks, args.batch, args.steps)
            group.shutdown()
            how = "compiled graph" if compiled else "actor calls   "
            print(f"decode step, batch {args.batch}, TP={tp} {how}: {remote:7.2f} ms "
                  f"({remote - local:+.2f} ms, {remote / local:.2f}x in-process)")
    for tp in tps:
        plain, graph = round_trip_us(300, tp)
        print(f"bare round trip TP={tp}: actor calls {plain:7.0f} us, "
              f"compiled graph {graph:7.0f} us")
    ray.shutdown()


if __name__ == "__main__":
    main()
