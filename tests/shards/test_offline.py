"""The offline API on the demo model: stop strings, streaming, abort on cancel."""

from __future__ import annotations

import asyncio

import pytest

from deployments.offline import LLM
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.reference import make_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, num_blocks=128)


def test_stop_string_spanning_tokens_ends_generation(llm):
    prompt = make_prompts(2048, [10], seed=31)[0]
    full = llm.generate([prompt], SamplingParams(max_new_tokens=30))[0]
    # Per-token texts from a streamed run, to find a token boundary.
    pieces = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    k = next(i for i in range(3, 25)
             if len(pieces[i - 1]) >= 2 and len(pieces[i]) - len(pieces[i - 1]) >= 2)
    cut = len(pieces[k - 1])
    stop = full.text[cut - 2 : cut + 2]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=30, stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP_SEQUENCE and out.stop_reason == stop
    assert full.stop_reason is None  # it ran to its length
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) <= k + 1


def test_stream_matches_generate(llm):
    prompts = make_prompts(2048, [5, 40, 17], seed=32)
    params = SamplingParams(max_new_tokens=20)
    expected = llm.generate(prompts, params)

    async def consume(prompt):
        outputs = [o async for o in llm.stream(prompt, params)]
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        return [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs)

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    results = asyncio.run(main())
    for (tokens, text), ref in zip(results, expected, strict=True):
        assert tokens == ref.token_ids
        assert text == ref.text


def test_closing_a_stream_aborts_and_frees_blocks(llm):
    prompt = make_prompts(2048, [60], seed=33)[0]
    scheduler = llm.engine.scheduler

    async def main():
        stream = llm.stream(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(main()) == 3
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.stats.num_aborted >= 1
    scheduler.check_integrity()
