"""The asyncio driver: streams, cancellation, and that no failure of the step loop can
leave a request waiting forever."""

from __future__ import annotations

import asyncio
import contextvars
import random

import pytest

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.engine.fake_worker import FakeWorker, next_token


class LetterTokenizer:
    """Token i decodes to one letter: enough for the detokenizer."""

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def make() -> tuple[LLMEngine, FakeWorker]:
    worker = FakeWorker(block_size=4)
    engine = LLMEngine(SchedulerConfig(max_model_len=1024), CacheConfig(4, 256),
                       LetterTokenizer(), frozenset(), worker)
    return engine, worker


async def run_step_of(worker: FakeWorker, delay: float = 0.0):
    async def run_step(step_input):
        await asyncio.sleep(delay)
        return worker.step(step_input)
    return run_step


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


async def consume(async_engine: AsyncEngine, rid: str, prompt: list[int], n: int):
    params = SamplingParams(max_new_tokens=n)
    outputs = [o async for o in async_engine.generate(rid, prompt, params)]
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def test_streams_complete_with_the_workers_tokens():
    async def main():
        engine, worker = make()
        ae = AsyncEngine(engine, await run_step_of(worker))
        return await asyncio.gather(*(consume(ae, f"r{i}", [11 + i, 12], 5 + i) for i in range(4)))

    for i, (tokens, last) in enumerate(asyncio.run(main())):
        assert tokens == expected_tokens([11 + i, 12], 5 + i)
        assert last.finished and last.error is None


CALLER = contextvars.ContextVar("caller", default=None)


def test_steps_run_outside_the_context_of_the_request_that_started_the_loop():
    """Under Ray a context names the calling task, and cancelling that task cancels the
    calls made in it: the steps serve everyone, so they must not carry the first caller's."""
    seen = []

    async def main():
        engine, worker = make()
        run = await run_step_of(worker)

        async def run_step(step_input):
            seen.append(CALLER.get())
            return await run(step_input)

        ae = AsyncEngine(engine, run_step)

        async def request(i):
            CALLER.set(f"request {i}")
            return await consume(ae, f"r{i}", [11 + i, 12], 4)

        return await asyncio.gather(*(request(i) for i in range(3)))

    assert [tokens for tokens, _ in asyncio.run(main())] == [
        expected_tokens([11 + i, 12], 4) for i in range(3)]
    assert seen and set(seen) == {None}


def test_an_interrupted_loop_fails_its_requests_then_serves_new_ones():
    async def main():
        engine, worker = make()
        ae = AsyncEngine(engine, await run_step_of(worker, delay=0.01))
        task = asyncio.create_task(consume(ae, "r", [11, 12], 40))
        await asyncio.sleep(0.1)
        ae._loop_task.cancel()  # mid-step: that step's result is lost
        _, last = await asyncio.wait_for(task, 10)  # supervised: ends, does not hang
        tokens, after = await asyncio.wait_for(consume(ae, "s", [13, 14], 6), 10)
        return last, tokens, after, engine

    last, tokens, after, engine = asyncio.run(main())
    assert last.finished and "engine loop was interrupted" in last.error
    assert tokens == expected_tokens([13, 14], 6) and after.error is None
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_an_engine_exception_fails_requests_instead_of_hanging():
    async def main():
        engine, worker = make()
        ae = AsyncEngine(engine, await run_step_of(worker))
        original, calls = engine.process, {"n": 0}

        def flaky(scheduled, output):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ValueError("boom")
            return original(scheduled, output)

        engine.process = flaky
        _, first = await asyncio.wait_for(consume(ae, "a", [11, 12], 10), 10)
        tokens, second = await asyncio.wait_for(consume(ae, "b", [13, 14], 3), 10)
        return first, tokens, second, engine

    first, tokens, second, engine = asyncio.run(main())
    assert first.finished and "boom" in first.error
    assert tokens == expected_tokens([13, 14], 3) and second.error is None
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_failing_step_fails_everything_in_flight():
    async def main():
        engine, _ = make()

        async def broken(step_input):
            raise RuntimeError("shard rank 0 died")

        ae = AsyncEngine(engine, broken)
        return await asyncio.wait_for(asyncio.gather(
            *(consume(ae, f"r{i}", [11, 12], 5) for i in range(3))), 10), engine

    results, engine = asyncio.run(main())
    assert all(last.error and "shard rank 0 died" in last.error for _, last in results)
    assert not engine.has_unfinished_requests()


def test_closing_a_stream_aborts_and_frees_blocks():
    async def main():
        engine, worker = make()
        ae = AsyncEngine(engine, await run_step_of(worker, delay=0.005))
        stream = ae.generate("r", [11, 12, 13, 14, 15], SamplingParams(max_new_tokens=500))
        async for output in stream:
            if output.token_ids:
                break
        await stream.aclose()
        await asyncio.sleep(0.05)
        return engine

    engine = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert engine.scheduler.stats.num_aborted == 1


class InOrderWorker:
    """Runs steps one at a time in the order they were started, as a Ray actor does, and
    counts how many were started before the previous one returned."""

    def __init__(self, worker: FakeWorker, delay: float = 0.001):
        self.worker, self.delay = worker, delay
        self.lock = asyncio.Lock()  # FIFO: steps run in the order they were started
        self.started = self.max_in_flight = 0

    async def run_step(self, step_input):
        self.started += 1
        self.max_in_flight = max(self.max_in_flight, self.started)
        try:
            async with self.lock:
                await asyncio.sleep(self.delay)
                return self.worker.step(step_input)
        finally:
            self.started -= 1


def run_mix(max_steps_in_flight: int, num_scheduler_steps: int = 1, cuts=()):
    """Requests that end every way (EOS, a stop string, length), on a cache small enough
    to preempt, one stream aborted early."""
    async def main():
        worker = FakeWorker(block_size=4)
        worker.cuts = list(cuts)
        engine = LLMEngine(SchedulerConfig(max_model_len=1024,
                                           num_scheduler_steps=num_scheduler_steps),
                           CacheConfig(4, 14),
                           LetterTokenizer(), frozenset({37}), worker)
        runner = InOrderWorker(worker)
        ae = AsyncEngine(engine, runner.run_step, max_steps_in_flight=max_steps_in_flight)

        async def one(i: int):
            params = SamplingParams(max_new_tokens=6 + 3 * i, stop=("q",) if i % 3 == 0 else ())
            outputs = [o async for o in ae.generate(f"r{i}", [11 + 7 * i, 12, 13 + i], params)]
            return [t for o in outputs for t in o.token_ids], outputs[-1].finish_reason

        async def aborted():
            stream = ae.generate("gone", [50, 51, 52], SamplingParams(max_new_tokens=400,
                                                                      ignore_eos=True))
            async for output in stream:
                if len(output.token_ids) and engine.scheduler.stats.num_steps > 6:
                    break
            await stream.aclose()

        results = await asyncio.gather(*(one(i) for i in range(10)), aborted())
        await asyncio.sleep(0.05)
        return results[:-1], engine, runner

    return asyncio.run(main())


def test_async_scheduling_gives_what_one_step_at_a_time_gives():
    sync, sync_engine, sync_runner = run_mix(1)
    pipelined, engine, runner = run_mix(2)
    assert sync_runner.max_in_flight == 1 and runner.max_in_flight == 2
    assert pipelined == sync
    reasons = {reason.value for _, reason in sync}
    assert {"eos_token", "stop_sequence", "length"} <= reasons, reasons  # every way to end
    assert engine.scheduler.stats.num_preemptions > 0  # preempted with samples in flight
    for e in (sync_engine, engine):
        assert not e.has_unfinished_requests() and e.scheduler.stats.num_aborted == 1
        assert e.scheduler.block_manager.num_used_blocks == 0
        e.scheduler.check_integrity()


def test_async_scheduling_samples_nothing_past_the_length_limit():
    async def main(max_steps_in_flight: int):
        engine, worker = make()
        runner = InOrderWorker(worker)
        ae = AsyncEngine(engine, runner.run_step, max_steps_in_flight=max_steps_in_flight)
        results = await asyncio.gather(*(consume(ae, f"r{i}", [11 + i, 12], 3 + 2 * i)
                                         for i in range(4)))
        return results, worker.num_sampled, runner.max_in_flight

    sync, sync_sampled, _ = asyncio.run(main(1))
    pipelined, sampled, in_flight = asyncio.run(main(2))
    assert in_flight == 2 and [t for t, _ in pipelined] == [t for t, _ in sync]
    assert sampled == sync_sampled == sum(3 + 2 * i for i in range(4))


def test_async_engine_refuses_a_pipeline_it_cannot_keep():
    engine, worker = make()
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        AsyncEngine(engine, worker.step, max_steps_in_flight=3)


def test_multi_steps_give_what_one_step_at_a_time_gives():
    """Multi-steps, some cut short, beside async scheduling, preemption, every way to end
    and an abort: the same tokens and ends."""
    sync, _, _ = run_mix(1)
    multi, engine, _ = run_mix(2, num_scheduler_steps=4, cuts=[1, 2, 4, 3, 1])
    assert multi == sync
    assert engine.scheduler.stats.num_steps < run_mix(2)[1].scheduler.stats.num_steps
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_request_arriving_cuts_the_multi_step_in_flight_short():
    """The newcomer's prefill is the step right after the multi-step's current one."""
    async def main():
        worker = FakeWorker(block_size=4)
        engine = LLMEngine(SchedulerConfig(max_model_len=1024, num_scheduler_steps=8),
                           CacheConfig(4, 256), LetterTokenizer(), frozenset(), worker)
        started, proceed = asyncio.Event(), asyncio.Event()
        interrupts = []

        async def run_step(step_input):
            if step_input.num_steps > 1 and not proceed.is_set():
                started.set()
                await proceed.wait()
            return worker.step(step_input)

        def interrupt():  # as the shard is told to: stop after the step it is in
            interrupts.append(len(worker.steps))
            worker.cuts.append(1)

        ae = AsyncEngine(engine, run_step, max_steps_in_flight=2, interrupt=interrupt)

        async def outputs(rid, prompt, n):
            params = SamplingParams(max_new_tokens=n)
            return [o.token_ids async for o in ae.generate(rid, prompt, params)]

        first = asyncio.ensure_future(outputs("a", [11, 12], 30))
        await asyncio.wait_for(started.wait(), 5)
        late = asyncio.ensure_future(outputs("b", [13, 14, 15], 5))
        for _ in range(100):
            if interrupts:
                break
            await asyncio.sleep(0)
        proceed.set()
        return await first, await late, worker.steps, interrupts

    a, b, steps, interrupts = asyncio.run(main())
    assert len(interrupts) == 1
    multi = next(i for i, st in enumerate(steps) if st.num_steps > 1)
    assert [len(tokens) for tokens in a[:2]] == [1, 1]  # the prefill's, the cut multi-step's
    assert [r.request_id for r in steps[multi + 1].new_requests] == ["b"]
    assert [t for tokens in a for t in tokens] == expected_tokens([11, 12], 30)
    assert [t for tokens in b for t in tokens] == expected_tokens([13, 14, 15], 5)
    assert max(map(len, a)) == 8  # with b gone, multi-steps again


@pytest.mark.parametrize("max_new_tokens, stop, tokens, text", [
    (20, "e", [3, 4], "d"), (3, "e", [3, 4], "d"), (3, "f", [3, 4, 5], "de")],
    ids=["then-eos", "then-length", "at-the-length"])
def test_a_stop_string_inside_a_multi_step_ends_the_output_there(max_new_tokens, stop,
                                                                tokens, text):
    """A multi-step's tokens can hold a stop string and, after it, the output's end (EOS,
    or its length): the output ends at the stop string, as one step at a time ends it,
    with that text, finish reason and stop_reason. A string that ends at the length's own
    token wins over the length too (vLLM's order: its text was cut there)."""
    got = {}
    for steps in (1, 4):
        worker = FakeWorker(block_size=4, model=lambda ids: ids[-1] + 1)
        engine = LLMEngine(SchedulerConfig(max_model_len=64, num_scheduler_steps=steps),
                           CacheConfig(4, 32), LetterTokenizer(), frozenset({6}), worker)
        engine.add_request("r", [1, 2], SamplingParams(max_new_tokens=max_new_tokens,
                                                       stop=(stop,)))  # token 4 is "e"
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        last = outputs[-1]
        got[steps] = ([t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs),
                      last.finish_reason, last.stop_reason)
        assert (max(s.num_steps for s in worker.steps) > 1) == (steps > 1)
    assert got[4] == got[1] == (tokens, text, FinishReason.STOP_SEQUENCE, stop)


def test_ends_are_the_same_one_step_at_a_time_in_multi_steps_and_with_drafts():
    """Differential: random greedy requests, one at a time, whose stop strings and stop
    tokens are cut from their own free outputs, with min_tokens, max_new_tokens,
    include_stop_str_in_output and ignore_eos drawn at random, end with the same tokens,
    text, finish reason and stop_reason in single steps, in multi-steps of 4 and with
    drafts. The model copies the token four back, so drafts are kept, and some prompts
    hold its EOS. Two bugs this found: a stop string followed in the same multi-step by
    EOS or the length limit ended nothing, and with min_tokens a stop string lying in the
    unchecked text ended the output later."""
    def engine(**knobs) -> LLMEngine:
        return LLMEngine(SchedulerConfig(max_model_len=256, **knobs), CacheConfig(4, 64),
                         LetterTokenizer(), frozenset({6}),
                         FakeWorker(block_size=4, model=lambda ids: ids[-4]))

    def run(e: LLMEngine, prompt: list[int], params: SamplingParams):
        e.add_request("r", prompt, params)
        outputs = []
        while e.has_unfinished_requests():
            outputs += e.step()
        return ([t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs),
                outputs[-1].finish_reason, outputs[-1].stop_reason)

    engines = {"single": engine(num_scheduler_steps=1), "multi": engine(num_scheduler_steps=4),
               "drafts": engine(num_scheduler_steps=4, speculate=4)}
    rng = random.Random(5)
    kinds = set()
    for n in range(120):
        prompt = [rng.randrange(26) for _ in range(rng.randint(4, 9))]
        ids, text, _, _ = run(engines["single"], prompt, SamplingParams(max_new_tokens=32,
                                                                         ignore_eos=True))
        knobs: dict = {"max_new_tokens": rng.randint(1, 32), "ignore_eos": rng.random() < 0.2}
        knobs["min_tokens"] = rng.choice([0, rng.randint(0, knobs["max_new_tokens"])])
        if rng.random() < 0.8:
            cuts = [rng.randrange(len(text)) for _ in range(rng.randint(1, 2))]
            knobs["stop"] = tuple({text[a:a + rng.randint(1, 5)] for a in cuts})
            knobs["include_stop_str_in_output"] = rng.random() < 0.3
        if rng.random() < 0.3:
            knobs["stop_token_ids"] = (rng.choice(ids),)
        got = {name: run(e, prompt, SamplingParams(**knobs)) for name, e in engines.items()}
        assert got["multi"] == got["drafts"] == got["single"], (n, prompt, knobs)
        kinds.add(got["single"][2])
    assert kinds == set(FinishReason) - {FinishReason.ABORTED, FinishReason.ERROR}
    assert engines["drafts"].scheduler.stats.num_accepted_tokens > 0
    assert engines["multi"].scheduler.stats.num_steps < engines["single"].scheduler.stats.num_steps
