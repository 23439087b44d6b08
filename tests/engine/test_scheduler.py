"""Scheduler semantics with a fake shard: TGI's knobs, chunking, preemption, abort,
stop criteria, and that nothing can wait forever."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.engine.fake_worker import FakeWorker, next_token

EOS = 3


def make(num_blocks=64, block_size=4, **knobs) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(**{"max_model_len": 1024, **knobs})
    scheduler = Scheduler(config, CacheConfig(block_size, num_blocks), frozenset({EOS}))
    return scheduler, FakeWorker(block_size)


def req(rid: str, n: int = 5, max_new: int = 50, **params) -> Request:
    return Request(rid, [11 + i % 50 for i in range(n)],
                   SamplingParams(max_new_tokens=max_new, **params), seed=0)


def step(s: Scheduler, w: FakeWorker):
    out = s.schedule()
    result = [r for r, _ in s.update(out, w.step(out.step_input))] if not out.is_empty else []
    s.check_integrity()
    return out, result


def test_waiting_served_ratio_and_max_waiting_tokens():
    s, w = make(waiting_served_ratio=0.3, max_waiting_tokens=5)
    for i in range(10):
        s.add_request(req(f"r{i}"))
    step(s, w)
    assert len(s.running) == 10
    s.add_request(req("late"))  # 1 waiting < floor(10 * 0.3): not worth a prefill yet
    admitted_at = None
    for i in range(10):
        out, _ = step(s, w)
        if "late" in out.step_input.num_scheduled_tokens:
            admitted_at = i
            break
    assert admitted_at == 5  # after max_waiting_tokens decode steps


def test_chunked_prefill_admits_at_every_step_within_the_step_budget():
    """TGI v3's default with chunked prefill: a newcomer joins the running batch's very
    next step, and the step's tokens, decodes included, stay within
    max_batch_prefill_tokens."""
    s, w = make(max_batch_prefill_tokens=64)
    for i in range(10):
        s.add_request(req(f"r{i}"))
    step(s, w)
    s.add_request(req("late", n=150))
    out, _ = step(s, w)
    assert out.num_admitted == 1 and out.concat_reason == "chunking"
    assert out.num_decode_tokens == 10 and out.num_prefill_tokens == 54
    assert sum(out.step_input.num_scheduled_tokens.values()) == 64
    while s.requests["late"].num_computed_tokens < 150:
        out, _ = step(s, w)
        assert sum(out.step_input.num_scheduled_tokens.values()) <= 64


def test_without_chunked_prefill_tgi_defaults_hold_the_newcomer_back():
    s, w = make(num_blocks=256, enable_chunked_prefill=False)
    assert s.config.admission == (0.3, 20)
    for i in range(10):
        s.add_request(req(f"r{i}", max_new=100))
    step(s, w)
    s.add_request(req("late"))
    waited = 0
    while "late" not in (out := step(s, w)[0]).step_input.num_scheduled_tokens:
        waited += 1
        assert waited <= 20
    assert waited == 20 and out.concat_reason == "wait_exceeded"


def test_enough_waiting_requests_are_admitted_at_once():
    s, w = make(waiting_served_ratio=0.3, max_waiting_tokens=100)
    for i in range(10):
        s.add_request(req(f"r{i}"))
    step(s, w)
    for i in range(3):
        s.add_request(req(f"late{i}"))
    out, _ = step(s, w)
    assert out.num_admitted == 3


def test_max_batch_size_and_fcfs():
    s, w = make(max_batch_size=3)
    for i in range(5):
        s.add_request(req(f"r{i}", max_new=2))
    out, _ = step(s, w)
    assert list(out.step_input.num_scheduled_tokens) == ["r0", "r1", "r2"]
    while s.has_unfinished_requests():
        out, _ = step(s, w)
        assert len(s.running) <= 3
    first_seen = [rid for st in w.steps for rid in st.num_scheduled_tokens]
    assert sorted(set(first_seen), key=first_seen.index) == [f"r{i}" for i in range(5)]


def test_chunked_prefill_respects_budget_and_samples_once():
    s, w = make(max_batch_prefill_tokens=32)
    s.add_request(req("long", n=100, max_new=2))
    chunks = []
    while s.has_unfinished_requests():
        out, updated = step(s, w)
        chunks.append(out.step_input.num_scheduled_tokens["long"])
        if len(chunks) < 4:
            assert updated == []  # no token until the prompt is done
    assert chunks == [32, 32, 32, 4, 1]


def test_unchunked_prompt_waits_for_a_whole_budget():
    s, w = make(max_batch_prefill_tokens=32, enable_chunked_prefill=False)
    s.add_request(req("a", n=20))
    s.add_request(req("b", n=20))
    out, _ = step(s, w)
    assert out.step_input.num_scheduled_tokens == {"a": 20}


def test_abort_frees_blocks_at_once_and_tells_the_shards():
    s, w = make()
    s.add_request(req("a", n=30))
    s.add_request(req("b", n=30))
    step(s, w)
    used = s.block_manager.num_used_blocks
    s.abort("a")
    assert s.block_manager.num_used_blocks < used
    out, _ = step(s, w)
    assert out.step_input.freed_request_ids == ["a"]
    assert "a" not in w.seqs


def test_decode_out_of_blocks_preempts_newest_and_recomputes():
    s, w = make(num_blocks=6, block_size=4)  # 24 slots
    s.add_request(req("old", n=7, max_new=12))
    s.add_request(req("new", n=7, max_new=12))
    outputs: dict[str, list[int]] = {}
    preempted = []
    while s.has_unfinished_requests():
        out, updated = step(s, w)
        preempted += out.preempted_ids
        for r in updated:
            outputs[r.request_id] = r.output_token_ids
    assert preempted and preempted[0] == "new"
    # Recompute gives the same tokens as an unconstrained run.
    s2, w2 = make(num_blocks=64)
    s2.add_request(req("old", n=7, max_new=12))
    s2.add_request(req("new", n=7, max_new=12))
    expected: dict[str, list[int]] = {}
    while s2.has_unfinished_requests():
        for r in step(s2, w2)[1]:
            expected[r.request_id] = r.output_token_ids
    assert outputs == expected and len(expected["old"]) == 12
    assert s.block_manager.num_used_blocks == 0


def test_request_larger_than_the_cache_ends_instead_of_hanging():
    s, w = make(num_blocks=4, block_size=4)
    s.add_request(req("huge", n=40))
    s.add_request(req("ok", n=4, max_new=2))
    for _ in range(10):
        step(s, w)
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    assert [r.finish_reason for r in s.finished_unscheduled] == [FinishReason.LENGTH]


def test_stop_criteria():
    s, w = make()
    prompt = [11, 12, 13]
    s.add_request(Request("len", prompt, SamplingParams(max_new_tokens=3), seed=0))
    s.add_request(Request("stop_id", list(prompt), SamplingParams(
        max_new_tokens=50, stop_token_ids=(next_token(prompt),)), seed=0))
    reasons = {}
    while s.has_unfinished_requests():
        for r in step(s, w)[1]:
            if r.is_finished:
                reasons[r.request_id] = (r.finish_reason, r.num_output_tokens)
    assert reasons["len"] == (FinishReason.LENGTH, 3)
    assert reasons["stop_id"] == (FinishReason.STOP_SEQUENCE, 1)


def test_eos_and_ignore_eos():
    s, w = make()
    s.eos_token_ids = frozenset({next_token([11, 12, 13])})
    s.add_request(Request("eos", [11, 12, 13], SamplingParams(max_new_tokens=5), seed=0))
    s.add_request(Request("ign", [11, 12, 13], SamplingParams(max_new_tokens=5, ignore_eos=True),
                          seed=0))
    reasons = {}
    while s.has_unfinished_requests():
        for r in step(s, w)[1]:
            if r.is_finished:
                reasons[r.request_id] = (r.finish_reason, r.num_output_tokens)
    assert reasons == {"eos": (FinishReason.EOS_TOKEN, 1), "ign": (FinishReason.LENGTH, 5)}


def test_max_batch_total_tokens_caps_the_cache():
    s, _ = make(num_blocks=64, block_size=4, max_batch_total_tokens=40)
    assert s.block_manager.num_blocks == 10
    assert s.max_batch_total_tokens == 40


def run_to_end(s: Scheduler, w: FakeWorker, limit: int = 500) -> list:
    outs = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return outs
        outs.append(step(s, w)[0])
    raise AssertionError("requests never finished")


def test_multi_step_decodes_in_one_message_what_single_steps_decode():
    """num_scheduler_steps: once nothing waits or prefills, one step carries several
    decode steps per request, each request's count capped by its length limit; the
    tokens equal one step at a time's."""
    results = {}
    for k in (1, 4):
        s, w = make(num_scheduler_steps=k, max_model_len=30)
        for i, (n, max_new) in enumerate([(5, 11), (6, 3), (22, 50)]):  # r2: max_model_len
            s.add_request(req(f"r{i}", n=n, max_new=max_new))
        outs = run_to_end(s, w)
        results[k] = ({rid: seq["tokens"] for rid, seq in w.seqs.items()}, len(outs), outs)
        assert s.block_manager.num_used_blocks == 0
    (single, single_steps, _), (multi, multi_steps, outs) = results[1], results[4]
    assert multi == single
    assert multi_steps < single_steps
    first = outs[0].step_input
    assert first.num_steps == 1 and len(first.new_requests) == 3  # prefills: one step
    second = outs[1].step_input
    # r0 has 10 tokens left, r1 2, r2 its context's last 7 (30 - 22 - the one sampled)
    assert second.num_steps == 4
    assert second.num_scheduled_tokens == {"r0": 4, "r1": 2, "r2": 4}


def test_multi_step_waits_for_newcomers_and_grammars():
    s, w = make(num_scheduler_steps=4)
    s.add_request(req("a"))
    step(s, w)
    s.add_request(req("b"))  # waiting: this step admits it, one step
    out, _ = step(s, w)
    assert out.step_input.num_steps == 1 and out.num_admitted == 1
    out, _ = step(s, w)
    assert out.step_input.num_steps == 4
    s.add_request(req("g", grammar=("regex", "[a-z]+")))
    step(s, w)
    out, _ = step(s, w)  # a grammar's matcher takes a token at a time
    assert out.step_input.num_steps == 1 and len(out.step_input.num_scheduled_tokens) == 3


def test_multi_step_only_for_small_batches():
    from engine.lookahead import MULTI_STEP_MAX_ROWS

    for n, num_steps in ((MULTI_STEP_MAX_ROWS, 4), (MULTI_STEP_MAX_ROWS + 1, 1)):
        s, w = make(num_scheduler_steps=4)
        for i in range(n):
            s.add_request(req(f"r{i}"))
        step(s, w)
        out, _ = step(s, w)
        assert out.step_input.num_steps == num_steps


def test_multi_step_cut_short_computes_again_from_where_it_stopped():
    s, w = make(num_scheduler_steps=6)
    s.add_request(req("a", max_new=20))
    s.add_request(req("b", max_new=20))
    step(s, w)
    w.cuts = [1, 3]  # the next two multi-steps end after 1 and 3 of their 6 steps
    out, _ = step(s, w)
    assert out.step_input.num_steps == 6
    for rid in "ab":
        request = s.requests[rid]
        assert request.num_output_tokens == 2 and request.num_computed_tokens == 5 + 1
    out, _ = step(s, w)  # the mirror agrees (FakeWorker checks each diff)
    assert out.step_input.num_scheduled_tokens == {"a": 6, "b": 6}
    run_to_end(s, w)
    expected = [11 + i % 50 for i in range(5)]
    for _ in range(20):
        expected.append(next_token(expected))
    assert w.seqs["a"]["tokens"][:25] == expected


def test_multi_step_needs_blocks_for_all_its_steps():
    """A multi-step takes the blocks of all its steps, or stays one step (never preempts
    for them)."""
    for num_blocks, num_steps in ((3, 8), (2, 1)):
        s, w = make(num_blocks=num_blocks, block_size=4, num_scheduler_steps=8)
        s.add_request(req("a", n=4, max_new=30))
        step(s, w)  # the prompt's 4 slots: 1 block
        out, _ = step(s, w)  # 8 steps from slot 4 need 12 slots: 3 blocks
        assert out.step_input.num_steps == num_steps and out.preempted_ids == []
        assert s.requests["a"].num_output_tokens == 1 + num_steps
