"""The shard actor's step calls, in-process (no Ray): two calls may be in the actor at
once, and the torch thread must still run the steps in the order the group sent them."""

from __future__ import annotations

import threading

import pytest

from shards.worker import actor as actor_module
from shards.worker.actor import ShardActor
from shards.worker.model_runner import ShardConfig


class Recorder:
    """Stands in for the model runner: records each step's input and thread."""

    def __init__(self, fail_on: str | None = None):
        self.seen: list[str] = []
        self.threads: set[int] = set()
        self.fail_on = fail_on

    def step(self, step_input: str) -> str:
        self.seen.append(step_input)
        self.threads.add(threading.get_ident())
        if step_input == self.fail_on:
            raise ValueError(f"failed on {step_input}")
        return step_input.upper()


@pytest.fixture
def actor(monkeypatch) -> ShardActor:
    monkeypatch.setattr(actor_module.logs, "to_stderr", lambda *args, **kwargs: None)
    shard = ShardActor(ShardConfig(model="unused"), 0, 1)
    shard.runner = Recorder()
    yield shard
    if shard._torch is not None:
        shard._torch.shutdown()


def call_in_thread(shard: ShardActor, step_input: str, call: int, results: dict):
    def run():
        try:
            results[call] = shard.step_in_order(step_input, call)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[call] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_step_call_that_arrives_first_waits_for_the_call_numbered_before_it(actor):
    results: dict = {}
    second = call_in_thread(actor, "second", 1, results)
    second.join(0.3)
    assert second.is_alive() and actor.runner.seen == []  # it waits for call 0
    assert actor.step_in_order("first", 0) == "FIRST"
    second.join(10)
    assert results == {1: "SECOND"}
    assert actor.runner.seen == ["first", "second"]
    # Both ran on the torch thread, not on the threads that called.
    assert len(actor.runner.threads) == 1
    assert threading.get_ident() not in actor.runner.threads


def test_a_failed_step_fails_its_own_call_and_the_next_one_still_runs(actor):
    actor.runner = Recorder(fail_on="first")
    with pytest.raises(ValueError, match="failed on first"):
        actor.step_in_order("first", 0)
    assert actor.step_in_order("second", 1) == "SECOND"
    # A compiled graph's steps (step()) run on the same torch thread.
    assert actor.step("third") == "THIRD"
    assert actor.runner.seen == ["first", "second", "third"]
    assert len(actor.runner.threads) == 1


def test_a_call_whose_predecessor_never_comes_fails_instead_of_hanging(actor, monkeypatch):
    monkeypatch.setattr(actor_module, "PREVIOUS_CALL_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="step call 1 waited 0.2 s for call 0"):
        actor.step_in_order("second", 1)
    assert actor.runner.seen == []


def test_step_calls_send_no_task_events_and_stay_in_their_concurrency_group():
    # A call per token: task events would cost the batcher and the GCS CPU on every step
    # (benchmarks/NOTES.md 51), and the two step threads keep a step queued behind a running one.
    assert ShardActor.step_in_order.__ray_enable_task_events__ is False
    assert ShardActor.step_in_order.__ray_concurrency_group__ == actor_module.STEP_CALLS
