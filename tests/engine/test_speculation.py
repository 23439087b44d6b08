"""Prompt-lookup speculation in the engine: the proposer, and the scheduler's handling of
drafts with a fake shard that checks them as a shard does (output unchanged)."""

from __future__ import annotations

from collections import deque

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculation import MAX_BACKOFF_STEPS, SpeculationState
from tests.engine.fake_worker import FakeWorker

EOS = 3


def copying_model(tokens: list[int]) -> int:
    """Repeats the text 7 tokens back, except at every 11th position: drafts looked up in
    the text are mostly right, sometimes wrong."""
    if len(tokens) % 11 == 0:
        return 10 + (tokens[-1] * 7 + len(tokens)) % 80
    return tokens[-min(7, len(tokens))]


def run(speculate: int, prompts: list[list[int]], num_blocks: int = 64, max_new: int = 40,
        **knobs) -> tuple[dict[str, list[int]], Scheduler, int]:
    # One step at a time unless asked: drafts are measured against plain decoding's steps.
    config = SchedulerConfig(max_model_len=1024, speculate=speculate,
                             **{"num_scheduler_steps": 1, **knobs})
    s = Scheduler(config, CacheConfig(4, num_blocks), frozenset({EOS}))
    w = FakeWorker(4, copying_model)
    for i, prompt in enumerate(prompts):
        s.add_request(Request(f"r{i}", list(prompt), SamplingParams(max_new_tokens=max_new),
                              seed=0))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        steps += 1
        for request, rows in s.update(out, w.step(out.step_input)):
            outputs[request.request_id] += request.token_ids[-len(rows):]
        s.check_integrity()
        assert steps < 2000
    return outputs, s, steps


PROMPTS = [[11 + (i * 5 + j) % 13 for j in range(9 + 3 * i)] for i in range(4)]


def test_proposer_drafts_what_followed_the_latest_longest_match():
    spec = SpeculationState(min_n=2, max_n=4)
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 5, 6, 1, 2, 3]
    # The longest suffix seen before is [1, 2, 3]; its latest occurrence is followed by 7.
    assert spec.propose(tokens, 4) == [7, 5, 6, 1]
    assert spec.propose(tokens, 2) == [7, 5]
    assert spec.propose(tokens + [4], 4) == []  # [3, 4] never occurred
    # The index grows with the text: the same answers as a fresh one.
    longer = tokens + [4, 9, 8, 1, 2]
    assert spec.propose(longer, 3) == SpeculationState(2, 4).propose(longer, 3) == [3, 7, 5]
    assert spec.propose(longer, 0) == []


def test_failed_drafts_back_off_doubling_and_a_kept_one_resets():
    spec = SpeculationState(2, 4)
    skips = []
    for _ in range(8):
        spec.record(4, 0)
        skips.append(spec.skip)
        while not spec.wants_draft():
            pass
    assert skips == [1, 2, 4, 8, 16, 32, 32, 32][:len(skips)]
    assert max(skips) == MAX_BACKOFF_STEPS
    spec.record(4, 1)
    assert spec.skip == 0 and spec.failures == 0 and spec.wants_draft()
    assert (spec.drafted, spec.accepted) == (36, 1)


@pytest.mark.parametrize("num_blocks", [64, 20])  # 20: preemption while drafting
def test_drafts_leave_every_output_unchanged_in_fewer_steps(num_blocks):
    plain, s0, plain_steps = run(0, PROMPTS, num_blocks)
    fast, s4, fast_steps = run(4, PROMPTS, num_blocks)
    assert fast == plain
    assert all(len(out) == 40 for out in fast.values())
    assert s0.stats.num_draft_tokens == 0
    assert 0 < s4.stats.num_accepted_tokens < s4.stats.num_draft_tokens  # some kept, some not
    assert fast_steps < 0.7 * plain_steps
    if num_blocks == 20:
        assert s4.stats.num_preemptions > 0


def test_a_drafting_request_waits_for_its_step_and_counts_its_drafts_in_the_budget():
    # Single steps: the scheduler's own drafts (a multi-step's are the shard's).
    config = SchedulerConfig(max_model_len=1024, speculate=4, max_batch_prefill_tokens=64,
                             num_scheduler_steps=1)
    s = Scheduler(config, CacheConfig(4, 64), frozenset({EOS}))
    w = FakeWorker(4, copying_model)
    s.add_request(Request("a", [11, 12, 13, 14, 15, 16, 17, 11, 12],
                          SamplingParams(max_new_tokens=30), seed=0))
    out = s.schedule()
    s.update(out, w.step(out.step_input))  # the prompt; its first token, 13
    first = s.schedule()
    assert first.step_input.draft_token_ids == {"a": [14, 15, 16, 17]}
    assert first.step_input.num_scheduled_tokens == {"a": 5}
    assert (first.num_decode_tokens, first.num_prefill_tokens) == (1, 0)  # a decode step
    # Scheduled again before that step returns (async scheduling): it waits, since its
    # next positions depend on how many drafts the step keeps.
    assert s.schedule().is_empty
    s.update(first, w.step(first.step_input))
    request = s.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1
    s.check_integrity()
    # A step budget of 3 tokens, one of them the decode's own: two drafts at most.
    tight = Scheduler(SchedulerConfig(max_model_len=1024, speculate=4, num_scheduler_steps=1,
                                      max_batch_prefill_tokens=3), CacheConfig(4, 64))
    w = FakeWorker(4, copying_model)
    tight.add_request(Request("a", [11, 12, 13, 14, 15, 16, 17, 11, 12],
                              SamplingParams(max_new_tokens=30), seed=0))
    while not (out := tight.schedule()).step_input.draft_token_ids:
        tight.update(out, w.step(out.step_input))
    assert out.step_input.draft_token_ids["a"] == [14, 15]


@pytest.mark.parametrize("steps", [1, 4])  # the scheduler's drafts; a multi-step's
def test_drafts_stay_within_the_length_limits(steps):
    outputs, s, _ = run(4, PROMPTS, max_new=6, num_scheduler_steps=steps)
    assert all(len(out) == 6 for out in outputs.values())
    outputs, s, _ = run(4, PROMPTS[:1], num_blocks=300, max_new=2000, num_scheduler_steps=steps)
    assert len(PROMPTS[0]) + len(outputs["r0"]) == 1024  # max_model_len, not a token more
    assert s.stats.num_accepted_tokens > 0


def test_a_full_batch_does_not_draft():
    config = SchedulerConfig(max_model_len=1024, speculate=4, speculate_max_rows=4)
    s = Scheduler(config, CacheConfig(4, 64), frozenset({EOS}))
    w = FakeWorker(4, copying_model)
    for i in range(4):  # four running requests fill speculate_max_rows: no drafts
        s.add_request(Request(f"r{i}", [11, 12, 13, 11, 12, 13], SamplingParams(), seed=0))
    for _ in range(5):
        out = s.schedule()
        assert not out.step_input.draft_token_ids and out.step_input.drafting is None
        s.update(out, w.step(out.step_input))


def test_a_batch_with_a_grammar_row_drafts_in_single_steps():
    """A grammar's row never multi-steps (its matcher advances a token a step), so a
    small batch with one drafts from the scheduler, in single steps, the constrained row
    included (rank 0 masks each draft's row: tests/shards/test_grammar.py)."""
    config = SchedulerConfig(max_model_len=1024, speculate=4, num_scheduler_steps=4)
    s = Scheduler(config, CacheConfig(4, 64), frozenset({EOS}))
    w = FakeWorker(4, copying_model)
    s.add_request(Request("g", [11, 12, 13, 11, 12, 13],
                          SamplingParams(max_new_tokens=30, grammar='{"type": "object"}'),
                          seed=0))
    s.add_request(Request("p", [11, 12, 13, 11, 12, 13], SamplingParams(max_new_tokens=30),
                          seed=0))
    drafted = set()
    while s.has_unfinished_requests():
        out = s.schedule()
        if "g" in out.step_input.num_scheduled_tokens:
            assert out.step_input.num_steps == 1 and out.step_input.drafting is None
        drafted |= set(out.step_input.draft_token_ids)
        s.update(out, w.step(out.step_input))
    assert drafted == {"g", "p"} and s.stats.num_accepted_tokens > 0


def test_with_two_steps_in_flight_only_as_many_wait_as_the_next_step_has_drafts_for():
    """Async scheduling: a request waits for its step in flight only to draft, and no more
    of them wait than the next step has draft rows for (here 6 - 4 running = 2 rows, so
    one request of 4 drafts at a time); the others decode on, overlapped. Output is the
    same as one step at a time without drafts."""
    plain, _, _ = run(0, PROMPTS)
    config = SchedulerConfig(max_model_len=1024, speculate=4, speculate_max_rows=6,
                             num_scheduler_steps=1)
    s = Scheduler(config, CacheConfig(4, 64), frozenset({EOS}))
    w = FakeWorker(4, copying_model)
    for i, prompt in enumerate(PROMPTS):
        s.add_request(Request(f"r{i}", list(prompt), SamplingParams(max_new_tokens=40), seed=0))
    outputs = {f"r{i}": [] for i in range(len(PROMPTS))}
    in_flight: deque = deque()
    most_waiting = steps = 0
    while s.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2 and not (out := s.schedule()).is_empty:
            in_flight.append((out, w.step(out.step_input)))  # the shard runs them in order
        waiting = sum(r.num_draft_tokens > 0 or r.speculation.hold for r in s.running)
        most_waiting = max(most_waiting, waiting)
        out, result = in_flight.popleft()
        for request, rows in s.update(out, result):
            outputs[request.request_id] += request.token_ids[-len(rows):]
        steps += 1
        assert steps < 1000
    assert outputs == plain
    assert most_waiting == 1 and s.stats.num_accepted_tokens > 0


def test_batches_that_multi_step_draft_inside_their_multi_steps():
    """With multi-steps on, a batch of a few requests drafts inside its multi-steps, where
    the shard knows every token (StepDrafting), filling their steps up to
    MULTI_STEP_DRAFT_MAX_ROWS rows: the scheduler sends no drafts of its own and takes
    blocks for every token a request may keep. A batch of 8 (the most that multi-steps)
    drafts a token each; where speculate_max_rows leaves no room it multi-steps without
    drafts. Output equals decoding without drafts, in fewer messages than multi-steps
    alone, drafts counted."""
    from engine.lookahead import MULTI_STEP_DRAFT_MAX_ROWS, MULTI_STEP_MAX_ROWS

    prompts = [[11 + (i * 5 + j) % 13 for j in range(9 + i)] for i in range(4)]
    plain, _, _ = run(0, prompts, num_blocks=256)
    multi, _, multi_steps = run(0, prompts, num_blocks=256, num_scheduler_steps=4)
    fast, s, fast_steps = run(4, prompts, num_blocks=256, num_scheduler_steps=4)
    assert multi == plain and fast == plain
    assert fast_steps < 0.8 * multi_steps
    assert 0 < s.stats.num_accepted_tokens < s.stats.num_draft_tokens
    alone, lone, _ = run(4, prompts[:1], num_blocks=256, num_scheduler_steps=4)
    assert alone["r0"] == plain["r0"] and lone.stats.num_accepted_tokens > 0

    def first_step_of_plain_decodes(num_requests: int, speculate_max_rows: int = 16):
        config = SchedulerConfig(max_model_len=1024, speculate=4,
                                 speculate_max_rows=speculate_max_rows, num_scheduler_steps=4)
        s = Scheduler(config, CacheConfig(4, 256), frozenset({EOS}))
        w = FakeWorker(4, copying_model)
        for i in range(num_requests):
            s.add_request(Request(f"r{i}", [11, 12, 13, 11, 12, 13],
                                  SamplingParams(max_new_tokens=100), seed=0))
        out = s.schedule()  # the prompts
        s.update(out, w.step(out.step_input))
        return s, s.schedule().step_input

    assert MULTI_STEP_DRAFT_MAX_ROWS == 2 * MULTI_STEP_MAX_ROWS
    for num_requests in (1, 4, MULTI_STEP_MAX_ROWS):
        s, step = first_step_of_plain_decodes(num_requests)
        assert not step.draft_token_ids and step.num_steps == 4
        assert step.drafting.speculate == 4
        assert step.drafting.max_rows == MULTI_STEP_DRAFT_MAX_ROWS - num_requests
        # Blocks for 4 steps of 1 + 4 tokens: every draft could be kept.
        assert set(step.num_scheduled_tokens.values()) == {20}
        for request_id in step.num_scheduled_tokens:
            request = s.requests[request_id]
            assert len(s.block_manager.get_block_ids(request_id)) * 4 >= request.num_computed_tokens
    _, step = first_step_of_plain_decodes(MULTI_STEP_MAX_ROWS, speculate_max_rows=8)
    assert step.num_steps == 4 and step.drafting is None and not step.draft_token_ids
    assert set(step.num_scheduled_tokens.values()) == {4}
    _, step = first_step_of_plain_decodes(MULTI_STEP_MAX_ROWS + 1)
    assert step.draft_token_ids and step.num_steps == 1


def test_a_multi_step_without_blocks_for_its_drafts_goes_without_them():
    config = SchedulerConfig(max_model_len=1024, speculate=4, num_scheduler_steps=4)
    s = Scheduler(config, CacheConfig(4, 6), frozenset({EOS}))  # 24 slots
    w = FakeWorker(4, copying_model)
    s.add_request(Request("a", [11, 12, 13, 11, 12, 13], SamplingParams(max_new_tokens=30),
                          seed=0))
    out = s.schedule()
    s.update(out, w.step(out.step_input))
    out = s.schedule()  # 6 computed; 4 steps of 5 tokens would need 26 slots, 4 of 1 fit
    assert out.step_input.num_steps == 4 and out.step_input.drafting is None
    assert out.step_input.num_scheduled_tokens == {"a": 4}
