"""Prompt-lookup speculation on the real model (SmolLM2's GGUF file, in process): drafts
change how many steps a generation takes, never what it outputs, greedy or seeded, with
logprobs, penalties and stop strings."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from deployments.offline import LLM
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.reference import smollm2_gguf

PARAGRAPH = ("Ray Serve runs Python code as deployments, scales them across a cluster, and "
             "streams tokens over HTTP. Each replica holds its own copy of the model.")
PROMPTS = [
    f"Repeat this text exactly, word for word.\n\nText: {PARAGRAPH}\n\nRepeated text:",
    f"Fix the spelling: {PARAGRAPH.replace('cluster', 'clustr').replace('tokens', 'tokns')}"
    "\n\nCorrected:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(smollm2_gguf()), speculate=4, num_blocks=256)


@contextlib.contextmanager
def configured(llm, **changes):
    """The same engine and weights with scheduler settings changed for one run."""
    scheduler = llm.engine.scheduler
    config = scheduler.config
    scheduler.config = dataclasses.replace(config, **changes)
    try:
        yield
    finally:
        scheduler.config = config


def generate(llm, params, prompts=PROMPTS, drafts=True, **changes):
    """The reference run has speculation off; runs with multi-steps unless `changes`
    say otherwise."""
    stats = llm.engine.scheduler.stats
    before = (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens)
    with configured(llm, **changes, **({} if drafts else {"speculate": 0})):
        outputs = llm.generate(prompts, params)
    after = (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens)
    return outputs, [b - a for a, b in zip(before, after, strict=True)]


def test_greedy_output_is_the_same_with_drafts_in_fewer_steps(llm):
    params = SamplingParams(max_new_tokens=48)  # steps counted one at a time
    plain, (plain_steps, drafted, _) = generate(llm, params, drafts=False, num_scheduler_steps=1)
    fast, (fast_steps, drafted, accepted) = generate(llm, params, num_scheduler_steps=1)
    for a, b in zip(plain, fast, strict=True):
        assert b.token_ids == a.token_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason
    assert accepted > 0.5 * drafted > 0
    assert fast_steps <= plain_steps  # the batch lasts as long as its longest answer
    # The batch in multi-steps: the shard drafts inside them.
    multi, (_, multi_drafted, multi_accepted) = generate(llm, params)
    assert [m.token_ids for m in multi] == [a.token_ids for a in plain]
    assert multi_accepted > 0.5 * multi_drafted > 0
    # One request alone (concurrency 1): the copy takes well under a step a token.
    alone, (steps, _, accepted) = generate(llm, params, PROMPTS[:1])
    assert alone[0].token_ids == plain[0].token_ids
    print(f"alone: {len(alone[0].token_ids)} tokens in {steps} steps; batch: {drafted} "
          f"drafted, {accepted} kept")
    assert steps < 0.6 * len(alone[0].token_ids) and accepted > 0


def test_seeded_sampling_with_penalties_and_logprobs_is_the_same_with_drafts(llm):
    # min_p, a logit bias (token 198 is "\n" in SmolLM2's vocabulary) and min_tokens are
    # drawn the same way in draft rows too.
    params = SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.9, seed=1234,
                            repetition_penalty=1.05, top_n_tokens=2, min_p=0.02,
                            logit_bias=((198, -2.0),), min_tokens=30)
    plain, _ = generate(llm, params, drafts=False)
    # The scheduler's drafts in single steps, and the shard's inside multi-steps.
    for steps in (1, 4):
        fast, (_, drafted, accepted) = generate(llm, params, num_scheduler_steps=steps)
        assert accepted > 0
        for a, b in zip(plain, fast, strict=True):
            assert b.token_ids == a.token_ids
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
            assert [[t for t, _ in top] for top in b.top_logprobs] == \
                [[t for t, _ in top] for top in a.top_logprobs]


def test_a_stop_string_inside_a_step_of_drafts_ends_there(llm):
    plain, _ = generate(llm, SamplingParams(max_new_tokens=48), PROMPTS[:1], drafts=False)
    text = plain[0].text
    stop = "scales them"
    assert stop in text[5:]
    fast, (_, _, accepted) = generate(
        llm, SamplingParams(max_new_tokens=48, stop=(stop,)), PROMPTS[:1])
    assert accepted > 0
    assert fast[0].finish_reason is FinishReason.STOP_SEQUENCE
    assert fast[0].text == text[: text.index(stop)]
    assert fast[0].token_ids == plain[0].token_ids[: len(fast[0].token_ids)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_draft_rows_score_as_decoding_one_step_at_a_time(llama_dir, backend):
    """Each row of a drafting request attends as a decode of its own (its context: the
    cache up to its position): the tokens and logprobs a step of drafts gives equal those
    of decoding one step at a time, on the reference backend and raygen's CPU kernel."""
    from engine.messages import NewRequestData, StepInput
    from tests.reference import make_prompts

    llm = LLM(llama_dir, attention_backend=backend, num_blocks=64, num_scheduler_steps=1)
    prompt = make_prompts(2048, [21], seed=3)[0]
    params = SamplingParams(max_new_tokens=6)
    ref = llm.generate([prompt], params)[0]  # one step a token, no drafts
    runner = llm.runner  # every block is free again: the request below takes 0-3
    first = runner.step(StepInput([NewRequestData("d", list(prompt), len(prompt), [0, 1, 2, 3],
                                                  0, params, 0)], [], {"d": len(prompt)}))
    drafts = ref.token_ids[1:5]  # what decoding drew: every draft is kept
    out = runner.step(StepInput([], [], {"d": 1 + len(drafts)}, draft_token_ids={"d": drafts}))
    assert first.token_ids + out.token_ids == ref.token_ids
    assert first.logprobs + out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def test_a_constrained_answer_drafts_beside_a_free_one_and_both_stay_the_same(llm):
    """A grammar's row never multi-steps, so a batch with one drafts from the scheduler
    in single steps, the constrained row included: rank 0 masks each draft's row as
    decoding would mask it once the drafts before are kept (tests/shards/test_grammar.py).
    Both answers are the same token for token as without drafts."""
    import json

    import llguidance

    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 400}},
              "required": ["text"], "additionalProperties": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})
    prompts = [f'Put this text in the "text" field of a JSON object, word for word.\n\n'
               f"Text: {PARAGRAPH}\n\nJSON:", PROMPTS[0]]
    params = [SamplingParams(max_new_tokens=64, grammar=grammar),
              SamplingParams(max_new_tokens=48)]
    plain, _ = generate(llm, params, prompts, drafts=False)
    fast, _ = generate(llm, params, prompts)
    assert [f.token_ids for f in fast] == [p.token_ids for p in plain]
    assert fast[0].text.startswith('{"text":"') and PARAGRAPH[:40] in fast[0].text
    # Alone, so that the drafts counted are the constrained row's own.
    alone, (steps, drafted, accepted) = generate(llm, params[:1], prompts[:1])
    assert alone[0].token_ids == plain[0].token_ids
    assert accepted > 0.5 * drafted > 0 and steps < 0.7 * len(plain[0].token_ids)
