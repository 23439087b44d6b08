"""What constrained rows cost a step: decode steps at batch 32 with none and with half the
rows held to a JSON schema, in one run, in-process (the engine and one shard, no Ray).

The constrained rows' schema forces at least 100 array items, so they cannot end early;
every row runs `--steps` decode steps after its prefill. Reported: mean decode step time
for each mix, their ratio, and rank 0's grammar time (mask + advance) per constrained token.

    python -m benchmarks.grammar_step --model models/demo-small
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llguidance

from benchmarks.grammar_engines import _version
from deployments.offline import LLM
from engine.sampling_params import SamplingParams

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "tag"], "additionalProperties": False}, "minItems": 100}


def run(llm: LLM, constrained: int, batch: int, steps: int) -> list[float]:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    rng = random.Random(constrained)  # random ids past the specials, 32 a prompt
    prompts = [[rng.randrange(5, len(llm.tokenizer)) for _ in range(32)] for _ in range(batch)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        grammar_i = grammar if i < constrained else None
        engine.add_request(f"{constrained}-{i}", prompt, SamplingParams(
            max_new_tokens=steps + 1, grammar=grammar_i, ignore_eos=grammar_i is None))
    times = []
    while engine.has_unfinished_requests():
        scheduled = engine.schedule()
        t0 = time.perf_counter()
        output = engine.worker.step(scheduled.step_input)
        if scheduled.step_input.new_requests == [] and len(output.token_ids) == batch:
            times.append(time.perf_counter() - t0)
        engine.process(scheduled, output)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/demo-small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each mix")
    args = parser.parse_args()
    llm = LLM(args.model, num_blocks=2048)
    grammars = llm.runner.grammars
    timer = {"s": 0.0, "tokens": 0}
    for name in ("mask", "advance"):
        inner = getattr(grammars, name)

        def timed(*a, _inner=inner, _name=name):
            t0 = time.perf_counter()
            result = _inner(*a)
            timer["s"] += time.perf_counter() - t0
            if _name == "advance":
                timer["tokens"] += len(a[0])
            return result
        setattr(grammars, name, timed)
    run(llm, args.batch // 2, args.batch, 4)  # warm-up: compile the grammar
    timer.update(s=0.0, tokens=0)
    free, half = [], []
    for _ in range(args.rounds):
        free += run(llm, 0, args.batch, args.steps)
        half += run(llm, args.batch // 2, args.batch, args.steps)
    f, h = statistics.mean(free), statistics.mean(half)
    print(f"{_version('llguidance')}, batch {args.batch}, {len(free)} + {len(half)} decode steps")
    print(f"  no rows constrained     {f * 1e3:7.2f} ms/step")
    print(f"  half rows constrained   {h * 1e3:7.2f} ms/step   ratio {h / f:.3f}")
    print(f"  grammar (mask+advance)  {timer['s'] / max(1, timer['tokens']) * 1e6:7.1f} us "
          "per constrained token")


if __name__ == "__main__":
    main()
