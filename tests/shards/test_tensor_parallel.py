"""Tensor-parallel shard actors on a real (local) Ray cluster with logical GPUs."""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.messages import CachedRequestData, StepInput
from engine.sampling_params import SamplingParams
from shards.model.config import ModelConfig
from shards.worker.group import ShardError, ShardGroup
from shards.worker.model_runner import ShardConfig
from tests.doubles import set_slow_steps, slow_model, slow_steps_runtime_env
from tests.reference import PARITY_LENGTHS, PARITY_NEW_TOKENS, hf_greedy, make_prompts
from tests.shards.test_parity import run_staggered

pytestmark = pytest.mark.integration  # Ray in the test process


# A step that outlasts the test's kill by far. (Steps longer than every deadline, completing
# with health checks answered during them, are test_faults.py's, through Serve.)
LONG_STEP_S = 75.0
# A model path per step delay (tests/doubles.py): GroupLLM(prefill_delay_s=...) serves it.
SLOW_PATHS: dict[float, str] = {}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(llama_dir, tmp_path_factory):
    for delay in (LONG_STEP_S,):
        SLOW_PATHS[delay] = slow_model(llama_dir, tmp_path_factory.mktemp(f"slow{delay:g}"))
    delays = tmp_path_factory.mktemp("slow-steps") / "delays.json"
    set_slow_steps(delays, {p: d for d, p in SLOW_PATHS.items()})
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False,
             runtime_env=slow_steps_runtime_env(delays))
    yield
    ray.shutdown()


class GroupLLM:
    """Just enough of deployments.offline.LLM for run_staggered, over a ShardGroup."""

    def __init__(self, model_dir: str, tp: int, tokenizer, num_blocks: int = 256,
                 prefill_delay_s: float = 0.0, compiled_graph: bool | None = None,
                 shard: dict | None = None, **knobs):
        if prefill_delay_s:
            model_dir = SLOW_PATHS[prefill_delay_s]
        config = ShardConfig(model=model_dir, num_blocks=num_blocks, **(shard or {}))
        self.group = ShardGroup(config, tp, num_cpus_per_shard=0.5, compiled_graph=compiled_graph)
        self.group.warmup(4096)
        mc = ModelConfig.from_pretrained(model_dir)
        self.engine = LLMEngine(SchedulerConfig(max_model_len=2048, **knobs),
                                CacheConfig(16, self.group.num_blocks), tokenizer,
                                mc.eos_token_ids, self.group,
                                frozenset(name for name, _ in config.lora_adapters))


def test_tp2_equals_tp1_and_transformers_with_staggered_arrivals(llama_dir, tokenizer):
    prompts = make_prompts(2048, PARITY_LENGTHS, seed=1)
    outs = {}
    for tp in (1, 2):
        llm = GroupLLM(llama_dir, tp, tokenizer, max_batch_prefill_tokens=64)
        outs[tp], max_running = run_staggered(llm, prompts, PARITY_NEW_TOKENS)
        assert max_running >= 4
        llm.group.shutdown()
    ref = {f"r{i}": hf_greedy(llama_dir, p, n)
           for i, (p, n) in enumerate(zip(prompts, PARITY_NEW_TOKENS, strict=True))}
    assert outs[2] == outs[1] == ref


def staged(group: ShardGroup) -> list[list[tuple[str, str]]]:
    """Each rank's adapters read ahead and not yet loaded."""
    return ray.get([a.__ray_call__.remote(lambda self: list(self.runner.adapters.staged))
                    for a in group.actors])


def test_lora_adapters_at_tp2_equal_peft_in_a_mixed_batch(llama_dir, tokenizer,
                                                          tmp_path_factory):
    """Each rank holds its slice of every adapter (B's rows of q/k/v and gate/up, A's
    columns of o and down, whose partial deltas the all-reduce sums): a batch of the base
    model and three adapters equals transformers + PEFT, request by request."""
    from tests.reference import peft_greedy, write_adapters

    adapters = write_adapters(llama_dir, tmp_path_factory)
    prompts = make_prompts(2048, [5, 17, 33, 9, 40, 3, 21, 12], seed=3)
    which = [None, "alpha", "beta", "gamma", "alpha", None, "gamma", "beta"]
    llm = GroupLLM(llama_dir, 2, tokenizer, shard={"lora_adapters": tuple(adapters.items())},
                   max_batch_prefill_tokens=64)
    try:
        for i, (prompt, adapter) in enumerate(zip(prompts, which, strict=True)):
            llm.engine.add_request(f"r{i}", prompt,
                                   SamplingParams(max_new_tokens=10, adapter=adapter))
            if i == 4:  # loaded at run time: every rank with the same step, having read it
                # beside its steps first (the batcher's order), which that step then takes
                asyncio.run(llm.group.stage_adapter("late@1", adapters["gamma"]))
                assert staged(llm.group) == [[("late@1", adapters["gamma"])]] * 2
                llm.engine.add_adapter("late@1", adapters["gamma"])
                llm.engine.add_request("late", prompt,
                                       SamplingParams(max_new_tokens=10, adapter="late@1"))
        got = {f"r{i}": [] for i in range(len(prompts))} | {"late": []}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                got[out.request_id].extend(out.token_ids)
        assert staged(llm.group) == [[]] * 2
    finally:
        llm.group.shutdown()
    assert got["late"] == peft_greedy(llama_dir, adapters["gamma"], prompts[4], 10)
    for i, (prompt, adapter) in enumerate(zip(prompts, which, strict=True)):
        expected = (hf_greedy(llama_dir, prompt, 10) if adapter is None
                    else peft_greedy(llama_dir, adapters[adapter], prompt, 10))
        assert got[f"r{i}"] == expected, adapter


@pytest.mark.parametrize("tp, speculate, multi_steps", [(1, 0, 1), (2, 4, 4)])
def test_async_scheduling_equals_transformers(llama_dir, tokenizer, tp, speculate, multi_steps):
    """Two steps in flight over actor calls: each rank feeds its own (rank 0's, broadcast)
    samples into the next step, scheduled before the batcher knew them. At TP=2 with
    drafts (prompt lookup): rank 0 broadcasts which drafts each request kept; prompts that
    repeat themselves give the random-weight model text to copy. And multi-steps, which
    arrivals cut short: rank 0 tells every rank where they end; inside them each rank
    drafts for itself, from the same tokens, the same drafts."""
    prompts, new_tokens = make_prompts(2048, PARITY_LENGTHS, seed=1), PARITY_NEW_TOKENS
    if speculate:
        repeated = [p * 3 for p in make_prompts(2048, [33, 5, 12, 20], seed=0)]
        prompts, new_tokens = repeated + prompts[:6], [40] * 4 + new_tokens[:6]
    llm = GroupLLM(llama_dir, tp, tokenizer, compiled_graph=False, max_batch_prefill_tokens=64,
                   speculate=speculate, num_scheduler_steps=multi_steps)
    submitted, most_in_flight, num_steps = [], [0], []

    def run_step(step_input):
        # Counted at submission over the futures not yet done: a done callback would run a
        # loop turn after the engine may already have seen the future done and started the
        # next step, and count one too many.
        num_steps.append((step_input.num_steps, step_input.drafting is not None))
        submitted.append(llm.group.step_async(step_input))
        most_in_flight[0] = max(most_in_flight[0], sum(not f.done() for f in submitted))
        return submitted[-1]

    async def main():
        engine = AsyncEngine(llm.engine, run_step, max_steps_in_flight=2,
                             interrupt=llm.group.cut_short)
        # The first request decodes a while alone (multi-steps with the shard's drafts),
        # then the others join: ten requests take single steps with the scheduler's drafts.
        first_alone = asyncio.Event()

        async def one(i, prompt, n):
            if i:
                await first_alone.wait()
                await asyncio.sleep(0.05 * i)  # staggered: admissions join a running batch
            params = SamplingParams(max_new_tokens=n)
            tokens = []
            async for out in engine.generate(f"r{i}", prompt, params):
                tokens += out.token_ids
                if len(tokens) >= n - 8:  # most of its output, the rest beside arrivals
                    first_alone.set()
            return tokens

        return await asyncio.gather(*(one(i, p, n) for i, (p, n) in
                                      enumerate(zip(prompts, new_tokens, strict=True))))

    try:
        outputs = asyncio.run(main())
        assert most_in_flight[0] == 2
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
        stats = llm.engine.scheduler.stats
        assert (stats.num_accepted_tokens > 0) == (speculate > 0)
        assert max(n for n, _ in num_steps) == multi_steps
        assert any(drafting for _, drafting in num_steps) == (speculate > 0)
    finally:
        llm.group.shutdown()
    assert outputs == [hf_greedy(llama_dir, p, n)
                       for p, n in zip(prompts, new_tokens, strict=True)]


def test_each_rank_holds_about_half_the_weights(llama_dir):
    one = ShardGroup(ShardConfig(model=llama_dir, num_blocks=8), 1, num_cpus_per_shard=0.5)
    two = ShardGroup(ShardConfig(model=llama_dir, num_blocks=8), 2, num_cpus_per_shard=0.5)
    try:
        full = one.weight_bytes[0]
        checkpoint = sum(f.stat().st_size for f in Path(llama_dir).glob("*.safetensors"))
        assert abs(full / checkpoint - 1) < 0.05, (full, checkpoint)  # packed ones counted
        for rank_bytes in two.weight_bytes:
            assert abs(rank_bytes / (full / 2) - 1) < 0.15, (rank_bytes, full)
    finally:
        one.shutdown()
        two.shutdown()


def test_ranks_land_in_bundles_after_the_replicas_and_fall_back_to_cpu(llama_dir):
    pg = placement_group([{"CPU": 1}, {"GPU": 1}, {"GPU": 1}])
    ray.get(pg.ready(), timeout=30)

    def held() -> tuple[str | None, dict]:
        """A rank's actor name and the resources it holds, bundle-scoped ones included
        (get_assigned_resources leaves those out)."""
        worker = ray._private.worker.global_worker
        return ray.get_runtime_context().get_actor_name(), dict(worker.core_worker.resource_ids())

    @ray.remote(num_cpus=1)
    class Replica:  # stands in for the Serve replica that owns bundle 0
        def build(self, model_dir):
            group = ShardGroup(ShardConfig(model=model_dir, num_blocks=8), 2)
            try:
                return group.placements(), ray.get(
                    [a.__ray_call__.remote(lambda self: held()) for a in group.actors])
            finally:
                group.shutdown()

    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0,
        placement_group_capture_child_tasks=True)).remote()
    try:
        placements, holdings = ray.get(replica.build.remote(llama_dir), timeout=120)
    finally:
        ray.kill(replica)
        remove_placement_group(pg)
    pg_hex = pg.id.hex()
    for rank, (info, (name, resources)) in enumerate(zip(placements, holdings, strict=True)):
        # Ray names bundle-scoped resources <resource>_group_<bundle index>_<pg id>: the
        # rank's GPU is its bundle's, in the replica's placement group.
        assert f"GPU_group_{rank + 1}_{pg_hex}" in resources, resources
        assert not name  # no name_prefix given
        assert info["gpu_ids"] and info["cuda_visible_devices"] == str(info["gpu_ids"][0])
        assert info["device"] == "cpu"  # logical GPU, no CUDA: tensors stay on CPU
    assert {p["cuda_visible_devices"] for p in placements} == {"0", "1"}


def test_killing_a_shard_fails_in_flight_requests_fast_and_a_fresh_group_works(
        llama_dir, tokenizer):
    llm = GroupLLM(llama_dir, 2, tokenizer)
    prompts = make_prompts(2048, [20, 35, 50, 9], seed=51)
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)

    async def main():
        engine = AsyncEngine(llm.engine, llm.group.step_async)
        started = asyncio.Event()

        async def consume(i, prompt):
            last = None
            async for out in engine.generate(f"q{i}", prompt, params):
                last = out
                if len(out.token_ids):
                    started.set()
            return last

        tasks = [asyncio.create_task(consume(i, p)) for i, p in enumerate(prompts)]
        await asyncio.wait_for(started.wait(), 60)
        ray.kill(llm.group.actors[1])
        killed_at = time.monotonic()
        finals = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return finals, time.monotonic() - killed_at

    finals, took = asyncio.run(main())
    assert took < 10
    for out in finals:
        assert out.finished and out.error and "shard rank" in out.error
    assert not llm.group.check_health()
    with pytest.raises(ShardError):
        llm.group.step(llm.engine.schedule().step_input)
    assert not llm.engine.has_unfinished_requests()

    fresh = GroupLLM(llama_dir, 2, tokenizer)
    try:
        assert fresh.group.check_health()
        got, _ = run_staggered(fresh, prompts[:2], [12, 12])
        assert got == {f"r{i}": hf_greedy(llama_dir, p, 12) for i, p in enumerate(prompts[:2])}
    finally:
        fresh.group.shutdown()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_parked(group: ShardGroup, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (group.parked and all(ray.get([a.parked.remote() for a in group.actors]))):
        assert time.monotonic() < deadline, "the idle group never parked its ranks"
        time.sleep(0.2)


def test_an_idle_compiled_group_parks_its_ranks_and_wakes_them_for_the_next_step(
        llama_dir, tokenizer):
    """Waiting in the graph's channel, a rank spins a core; parked, it blocks. Either way
    the next step must run, and give transformers' tokens."""
    llm = GroupLLM(llama_dir, 2, tokenizer)
    prompts = make_prompts(2048, [23, 41], seed=81)
    pool = ThreadPoolExecutor(1)  # ranks never woken fail the test rather than hang it
    try:
        assert llm.group.use_compiled_graph
        pids = [p["pid"] for p in llm.group.placements()]
        for _ in range(2):  # parked after start-up, then again after serving
            wait_until_parked(llm.group)
            before, t0 = [cpu_seconds(pid) for pid in pids], time.monotonic()
            time.sleep(2.0)
            used = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
            # a spinning rank uses most of a core (about 0.9 s a second on this machine)
            assert max(used) < 0.25 * (time.monotonic() - t0), used
            got, _ = pool.submit(run_staggered, llm, prompts, [10, 10]).result(timeout=120)
            assert not llm.group.parked
            assert got == {f"r{i}": hf_greedy(llama_dir, p, 10) for i, p in enumerate(prompts)}
        assert llm.group.check_health()
    finally:
        llm.group.shutdown()
        pool.shutdown(wait=False)


def test_a_rank_that_dies_while_parked_fails_the_next_step_by_name(llama_dir, tokenizer):
    llm = GroupLLM(llama_dir, 2, tokenizer)
    pool = ThreadPoolExecutor(1)  # a hang fails the test instead of holding up the suite
    try:
        wait_until_parked(llm.group)
        ray.kill(llm.group.actors[1])
        llm.engine.add_request("p", make_prompts(2048, [12], seed=83)[0],
                               SamplingParams(max_new_tokens=4))
        step = pool.submit(llm.group.step, llm.engine.schedule().step_input)
        with pytest.raises(ShardError, match=r"^shard rank 1 died"):
            step.result(timeout=60)
        assert not llm.group.healthy
    finally:
        llm.group.shutdown()  # its teardown ends a read that still waits
        pool.shutdown(wait=False)


def test_a_failure_that_is_no_death_names_what_failed(llama_dir, tokenizer):
    llm = GroupLLM(llama_dir, 2, tokenizer)
    try:
        # A step for a request no rank has seen: every rank raises, none dies.
        bad = StepInput([], [CachedRequestData("ghost", [], 0)], {"ghost": 1})
        with pytest.raises(ShardError) as info:
            llm.group.step(bad)
        assert "rank -1" not in str(info.value) and "KeyError" in str(info.value), info.value
        assert "no rank died" in str(info.value)
        assert not llm.group.healthy and not llm.group.check_health()
    finally:
        llm.group.shutdown()


@pytest.mark.parametrize("compiled_graph", [True, False], ids=["compiled", "actor-calls"])
def test_a_step_started_as_the_watchdog_fails_the_group_names_the_dead_rank(
        llama_dir, compiled_graph):
    """The watchdog may fail the group (and shut its executor) between step_async's health
    check and its hand-off to the executor: the caller must still learn which rank died,
    not that the executor is shut down."""
    group = ShardGroup(ShardConfig(model=llama_dir, num_blocks=8), 1, num_cpus_per_shard=0.5,
                       compiled_graph=compiled_graph)

    class FailedOnSubmit(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            group._fail(0, RayActorError(error_msg="rank 0 is dead"))  # the watchdog's move
            return super().submit(*args, **kwargs)

    group._executor = FailedOnSubmit(1)

    async def main():
        return group.step_async(StepInput([], [], {}))

    try:
        with pytest.raises(ShardError, match=r"^shard rank 0 died"):
            asyncio.run(main())
        assert not group.healthy
    finally:
        group.shutdown()


@pytest.mark.parametrize("compiled_graph", [True, False], ids=["compiled", "actor-calls"])
def test_a_rank_that_dies_during_a_long_step_is_named_within_seconds(
        llama_dir, tokenizer, compiled_graph):
    llm = GroupLLM(llama_dir, 2, tokenizer, prefill_delay_s=LONG_STEP_S,
                   compiled_graph=compiled_graph)

    async def main():
        engine = AsyncEngine(llm.engine, llm.group.step_async)
        outputs = engine.generate("long", make_prompts(2048, [30], seed=71)[0],
                                  SamplingParams(max_new_tokens=4))
        first = asyncio.create_task(anext(outputs))
        await asyncio.sleep(2)  # the step is under way: every rank sleeps in it
        assert not first.done()
        ray.kill(llm.group.actors[1])
        killed_at = time.monotonic()
        out = await asyncio.wait_for(first, 30)
        return out, time.monotonic() - killed_at

    try:
        out, took = asyncio.run(main())
        assert took < 10  # the watchdog, not the step, noticed
        assert out.finished
        assert out.error == "ShardError: shard rank 1 died (its actor process is gone)"
        assert not llm.group.check_health()
    finally:
        llm.group.shutdown()


def test_constrained_output_at_tp2_equals_one_shard(llama_dir, tokenizer):
    """Only rank 0 keeps matchers; the other ranks' steps must not care. A request whose
    rules leave a row nothing to draw fails there alone: every rank drops its rows."""
    import llguidance

    from deployments.offline import LLM
    from tests.shards.test_grammar import REGEXES, SCHEMAS, json_grammar

    grammars = [json_grammar(SCHEMAS[0]), llguidance.LLMatcher.grammar_from_regex(REGEXES[2]),
                None, json_grammar(SCHEMAS[1])]
    params = [SamplingParams(max_new_tokens=60, grammar=g) for g in grammars]
    prompts = make_prompts(2048, [5, 17, 9, 30], seed=61)
    expected = [o.token_ids for o in LLM(llama_dir, num_blocks=256).generate(prompts, params)]
    llm = GroupLLM(llama_dir, 2, tokenizer)
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            llm.engine.add_request(f"g{i}", prompt, p)
        llm.engine.add_request("cornered", prompts[0], SamplingParams(
            max_new_tokens=8, allowed_token_ids=(100, 200),
            bad_words=((100, 100), (100, 200), (200, 100), (200, 200))))
        got: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
        errors = {}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.error is not None:
                    errors[out.request_id] = out.error
                got.setdefault(out.request_id, []).extend(out.token_ids)
    finally:
        llm.group.shutdown()
    assert [got[f"g{i}"] for i in range(len(prompts))] == expected
    assert list(errors) == ["cornered"] and "output position 1" in errors["cornered"]
    assert len(got["cornered"]) <= 1


def kept_one_row_copy_where_it_paid(placement: dict) -> bool:
    """A rank timed its products both ways on its own threads, and kept the weight copy
    exactly for the steps where it was faster by the margin: one-row steps, and with
    panels those of 2 rows up to the most that the timings at PANEL_TIMINGS' row counts
    admit, each timed only where the one before it passed (shards/worker/weight_plan.py). A
    copy that serves no step is gone."""
    from shards.worker.weight_plan import PANEL_TIMINGS, one_row_copy_pays, panels_pay

    timings, panel_timings = placement["one_row_timings"], placement["panel_timings"]
    one_row = placement["one_row_weights"]
    lanes = placement["lane_rows"]
    if timings is None and placement["panel_rows"] is None:
        # Rows in lanes (AVX2 kernels), timed as a GGUF file's blocks are: named where
        # some kind of linear kept them, each for one-row steps at least.
        return (placement["weight_copy"], one_row) == (("rows in lanes", True) if lanes
                                                       else (None, False)) \
            and all(rows >= 1 for rows in lanes.values())
    if timings is None or one_row != one_row_copy_pays(*timings):
        return False
    if panel_timings is None:  # the K x N copy: one-row steps only
        return (placement["weight_copy"], placement["panel_rows"]) == \
            ("K x N" if one_row else None, None)
    up_to, should_time = 1, []
    for rows, most, _ in PANEL_TIMINGS:
        should_time.append(rows)
        if rows not in panel_timings or not panels_pay(rows, *panel_timings[rows]):
            break
        up_to = most
    if list(panel_timings) != should_time:
        return False
    kept = one_row or up_to > 1
    want = ("panels", (1 if one_row else 2, up_to)) if kept else (None, None)
    return (placement["weight_copy"], placement["panel_rows"]) == want


# Where a rank runs a thread per core of its slice, each thread is bound to one of them
# (shards/cpu/plan.py, read back from the kernel).
@pytest.mark.parametrize(("tp", "reserved", "threads", "affinities", "borrow"), [
    (1, 0, None, [[0, 1]], False),  # the whole node, two threads
    (1, 1, None, [[0]], False),  # one pinned thread, core 1 left to the serving plane
    (2, 0, None, [[0], [1]], False),  # each rank its own core
    (1, 0, 1, [[0, 1]], False),  # cpu_threads still wins over the slice's size
    (1, 1, None, [[0, 1]], True),  # borrowing: a thread on each core
    (2, 1, None, [[0], [0]], True),  # two ranks on the node: nothing to borrow
    (1, None, None, [[0, 1]], True),  # unset (the app's default): one core reserved
    (2, None, None, [[0], [1]], True),  # unset, two ranks: no core left to reserve
])
def test_core_plan_pins_each_rank_and_sizes_its_threads(llama_dir, tp, reserved, threads,
                                                        affinities, borrow):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.skip("written for this project's 2-core machines")
    affinities = [[cores[i] for i in a] for a in affinities]
    config = ShardConfig(model=llama_dir, num_blocks=64, reserved_cpus=reserved,
                         cpu_threads=threads, borrow_reserved_cpus=borrow)
    group = ShardGroup(config, tp, num_cpus_per_shard=0.5)
    try:
        placements = ray.get([a.placement.remote() for a in group.actors])
    finally:
        group.shutdown()
    assert [p["cpu_affinity"] for p in placements] == affinities
    assert [p["torch_threads"] for p in placements] == [threads or len(a) for a in affinities]
    assert all(kept_one_row_copy_where_it_paid(p) for p in placements)
    bound = [[[core] for core in a] if (threads or len(a)) == len(a) > 1 else []
             for a in affinities]
    assert [p["thread_cores"] for p in placements] == bound
    # The thread that runs the forward: on the rank's cores, or bound to the first of them.
    assert [p["torch_thread_cores"] for p in placements] == [
        b[0] if b else a for a, b in zip(affinities, bound, strict=True)]


def gone_from_claims(node_id: str, pids: list[int] | None = None, timeout_s: float = 30):
    """Wait until the processes (every one the node's claims file names, by default) have
    exited: ray.kill returns before an actor's process is gone."""
    from shards.cpu import plan as cpu_plan

    path = cpu_plan.claims_path(node_id)
    if pids is None:
        try:
            with open(path) as f:
                pids = [int(pid) for pid in json.load(f)]
        except FileNotFoundError:
            return
    deadline = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        assert time.monotonic() < deadline, f"shard processes {pids} outlived their groups"
        time.sleep(0.2)


def test_whole_cores_per_rank_are_claimed_node_wide_and_freed_when_a_rank_dies(llama_dir):
    """Two replicas' groups on one node, each rank owning one whole core (the app's
    shard_cpus=1): they get different cores, where groups that split the node among their
    own ranks would both take core 0. Once a group is gone its core is the next one's."""
    from shards.cpu import plan as cpu_plan

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.skip("written for this project's 2-core machines")
    gone_from_claims(ray.get_runtime_context().get_node_id())
    config = ShardConfig(model=llama_dir, num_blocks=8, reserved_cpus=0, cores_per_rank=1)

    def placed(group: ShardGroup) -> dict:
        return ray.get(group.actors[0].placement.remote())

    first, second = (ShardGroup(config, 1, num_cpus_per_shard=0.5) for _ in range(2))
    try:
        a, b = placed(first), placed(second)
        first.shutdown()
        gone_from_claims(a["node_id"], [a["pid"]])
        third = ShardGroup(config, 1, num_cpus_per_shard=0.5)
        try:
            c = placed(third)
        finally:
            third.shutdown()
    finally:
        first.shutdown()
        second.shutdown()
    assert [p["cpu_affinity"] for p in (a, b, c)] == [[cores[0]], [cores[1]], [cores[0]]]
    assert [p["torch_threads"] for p in (a, b, c)] == [1, 1, 1]
    assert [p["cores_shared"] for p in (a, b, c)] == [0, 0, 0]
    with open(cpu_plan.claims_path(c["node_id"])) as f:
        claims = json.load(f)
    assert {int(pid) for pid in claims} == {b["pid"], c["pid"]}  # the dead rank's claim dropped


def test_groups_that_split_the_node_alone_see_that_they_share_its_cores(llama_dir):
    """Without whole cores per rank each group splits the node among its own ranks, so a
    second replica's rank lands on the first's cores: it says so (placement's cores_shared,
    and a warning in its log). Ranks of one group on one core are not counted."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.skip("written for this project's 2-core machines")
    gone_from_claims(ray.get_runtime_context().get_node_id())
    split = ShardConfig(model=llama_dir, num_blocks=8, reserved_cpus=0)
    first = ShardGroup(split, 1, num_cpus_per_shard=0.5)
    try:
        second = ShardGroup(ShardConfig(model=llama_dir, num_blocks=8, reserved_cpus=1), 2,
                            num_cpus_per_shard=0.5)
        try:
            ours = [ray.get(a.placement.remote()) for a in (*first.actors, *second.actors)]
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    assert [p["cpu_affinity"] for p in ours] == [cores, [cores[0]], [cores[0]]]
    assert [p["cores_shared"] for p in ours] == [0, 1, 1]


def test_a_borrowing_rank_runs_every_step_on_a_thread_bound_to_each_core(llama_dir,
                                                                         tokenizer):
    """reserved_cpus=1 with borrow_reserved_cpus: the rank runs a thread on each core,
    bound to it (read back from the kernel after a step of several tokens and after
    one-token steps); output still transformers'."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        pytest.skip("written for this project's 2-core machines")
    llm = GroupLLM(llama_dir, 1, tokenizer,
                   shard={"reserved_cpus": 1, "borrow_reserved_cpus": True})
    actor = llm.group.actors[0]

    def after(prompt: list[int], n: int) -> tuple[list[int], dict]:
        llm.engine.add_request("q", prompt, SamplingParams(max_new_tokens=n))
        tokens = []
        while llm.engine.has_unfinished_requests():
            tokens += [t for out in llm.engine.step() for t in out.token_ids]
        return tokens, ray.get(actor.placement.remote())

    try:
        prompt = make_prompts(2048, [40], seed=3)[0]
        _, big = after(prompt, 1)  # one step: the prompt's 40 tokens
        tokens, one = after(prompt[:-1] + [prompt[-1] % 100 + 5], 6)  # ends decoding one row
        prompts = make_prompts(2048, PARITY_LENGTHS, seed=1)
        outs, _ = run_staggered(llm, prompts, PARITY_NEW_TOKENS)
    finally:
        llm.group.shutdown()
    for placement in (big, one):
        assert (placement["cpu_affinity"], placement["torch_threads"]) == (cores, 2)
        assert placement["thread_cores"] == [[cores[0]], [cores[1]]]
        assert kept_one_row_copy_where_it_paid(placement)
    assert tokens == hf_greedy(llama_dir, prompt[:-1] + [prompt[-1] % 100 + 5], 6)
    assert outs == {f"r{i}": hf_greedy(llama_dir, p, n)
                    for i, (p, n) in enumerate(zip(prompts, PARITY_NEW_TOKENS, strict=True))}


def test_a_gguf_file_at_tp3_equals_one_shard():
    """The real model's GGUF file over three ranks (its 9 heads and 3 key/value heads do not
    split in two): each rank reads and multiplies only its share of the file's Q4_1 blocks,
    and greedy output equals one shard's on the same file."""
    from deployments.offline import LLM
    from shards.checkpoints.resolve import load_tokenizer
    from tests.reference import smollm2_gguf

    model = str(smollm2_gguf())
    tokenizer = load_tokenizer(model)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                         add_generation_prompt=True)
    prompts = [chat, tokenizer("def fibonacci(n):").input_ids]
    one = LLM(model, num_blocks=64).generate(prompts, SamplingParams(max_new_tokens=24))
    llm = GroupLLM(model, 3, tokenizer, num_blocks=64)
    try:
        placement = ray.get(llm.group.actors[1].placement.remote())
        assert placement["quant_types"]["Q4_1"] > 0  # the rank multiplies by the blocks
        outs, _ = run_staggered(llm, prompts, [24, 24])
    finally:
        llm.group.shutdown()
    assert [outs["r0"], outs["r1"]] == [o.token_ids for o in one]
