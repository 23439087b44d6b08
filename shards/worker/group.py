"""The batcher's handle on its shard actors: create them, size the KV cache, run steps.

Inside a placement group (a Serve replica's), rank i goes in bundle i + 1 (bundle 0 is the
replica's own); otherwise ranks are plain actors with a fraction of a CPU. A step puts its
input in the object store once and passes that one ref to every rank (or, for TP > 1, goes
through a compiled graph's shared-memory channels).

A step's duration is never a failure: steps are waited on without a deadline. Only a dead
rank or an error fails the group. Liveness comes from the GCS (is the actor process alive?),
never from a call to the actor, which would queue behind the step it is running. A watchdog
thread asks the GCS every second while a step is in flight, so a rank that dies mid-step
fails the step within a second or two even while the survivors are blocked in a collective
waiting for it.

A compiled graph's ranks wait for their next step in a shared-memory channel whose reader
spins (a core per rank). So once the group has run no step for PARK_AFTER_S it parks them:
it sends a Park step, in which each rank blocks on an event, and leaves its result unread.
The next step first wakes the ranks (`unpark`, an ordinary actor call), reads the Park's
result, then runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.messages import StepInput, StepOutput
from shards.shard_config import ShardConfig
from shards.worker.actor import CONCURRENCY_GROUPS, Park, ShardActor

logger = logging.getLogger(__name__)


# How often the watchdog asks the GCS whether a rank died while a step is in flight.
WATCHDOG_INTERVAL_S = 1.0
# A step that failed without a rank reported dead: how long to keep asking the GCS
# before blaming no rank (a process killed a moment ago may not be marked dead yet).
DEATH_REPORT_GRACE_S = 3.0
# A compiled graph's ranks are parked (blocked instead of spinning) after this long without
# a step; checked on the watchdog's tick, so they park 1-2 s into an idle spell.
PARK_AFTER_S = 1.0


class ShardError(RuntimeError):
    """A shard died or failed a step; the group is unusable and must be replaced."""


class ShardGroup:
    def __init__(self, config: ShardConfig, tensor_parallel_size: int = 1, *,
                 use_gpu: bool = False, num_cpus_per_shard: float = 0.0,
                 name_prefix: str | None = None, init_timeout_s: float = 600.0,
                 compiled_graph: bool | None = None):
        self.config = config
        # Measured on 2 CPU cores (benchmarks/NOTES.md 41): a compiled graph makes a TP=2
        # decode step 12% shorter and serves 6-17% more tok/s, but slows TP=1, whose
        # channel polling competes with torch for the cores. None picks what was faster:
        # compiled for tp > 1.
        self.use_compiled_graph = (tensor_parallel_size > 1 if compiled_graph is None
                                   else compiled_graph)
        self._graph = None  # compiled at warmup, so no serving step pays for it
        self._parked_refs: list | None = None  # the Park step's unread result, while parked
        # One graph execution at a time: steps come from the step thread, or from a caller's
        # own thread through step(), and parks from the step thread.
        self._graph_lock = threading.Lock()
        self._last_step = time.monotonic()  # when the last step ended
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shard-group")
        self._lock = threading.Lock()  # the step thread and the watchdog may both fail us
        self._steps_in_flight = 0
        self._calls = 0  # step calls sent, which number them (ShardActor.step_in_order)
        self._closed = threading.Event()
        self.tensor_parallel_size = tensor_parallel_size
        self.healthy = False
        self.error: str | None = None
        self.actors = [self._create_actor(rank, use_gpu, num_cpus_per_shard, name_prefix)
                       for rank in range(tensor_parallel_size)]
        try:
            self._bind_cpus(init_timeout_s)
            address, port = ray.get(self.actors[0].rendezvous_address.remote(),
                                    timeout=init_timeout_s)
            self.weight_bytes: list[int] = ray.get(
                [a.init_model.remote(address, port) for a in self.actors], timeout=init_timeout_s)
        except Exception:
            self.shutdown()
            raise
        self.num_blocks = 0
        self.healthy = True
        self._watchdog = threading.Thread(target=self._watch, name="shard-watchdog", daemon=True)
        self._watchdog.start()

    def _bind_cpus(self, timeout_s: float) -> None:
        """Give each rank its own slice of its node's cores (shards/cpu/plan.py)."""
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=timeout_s)
        group = uuid.uuid4().hex
        ray.get([a.bind_cpus.remote(nodes[:rank].count(node), nodes.count(node), group)
                 for rank, (a, node) in enumerate(zip(self.actors, nodes, strict=True))],
                timeout=timeout_s)

    def _create_actor(self, rank: int, use_gpu: bool, num_cpus: float, name_prefix: str | None):
        options: dict = {"max_restarts": 0, "max_task_retries": 0}
        pg = get_current_placement_group()
        if pg is not None:
            bundle = pg.bundle_specs[rank + 1]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank + 1)
            options["num_gpus"] = 1 if bundle.get("GPU") else 0
            options["num_cpus"] = bundle.get("CPU", 0)
        else:
            options["num_gpus"] = 1 if use_gpu else 0
            options["num_cpus"] = num_cpus
        if name_prefix:
            options["name"] = f"{name_prefix}shard-{rank}"
        actor_class = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ShardActor)
        return actor_class.options(**options).remote(self.config, rank, self.tensor_parallel_size)

    def warmup(self, max_batch_prefill_tokens: int, max_batch_total_tokens: int | None = None,
               timeout_s: float = 600.0) -> int:
        """Size the KV cache (the smallest any rank can hold), allocate it everywhere, and
        compile the step graph: start-up work, which Serve does not health-check."""
        counts = ray.get([a.profile_num_blocks.remote(max_batch_prefill_tokens)
                          for a in self.actors], timeout=timeout_s)
        num_blocks = min(counts)
        if max_batch_total_tokens is not None:
            num_blocks = min(num_blocks, -(-max_batch_total_tokens // self.config.block_size))
        ray.get([a.allocate_kv_cache.remote(num_blocks) for a in self.actors], timeout=timeout_s)
        self.num_blocks = num_blocks
        if self.use_compiled_graph:
            self._compiled()
        logger.info("KV cache: %d blocks x %d tokens = max_batch_total_tokens %d (tp=%d)",
                    num_blocks, self.config.block_size, num_blocks * self.config.block_size,
                    self.tensor_parallel_size)
        return num_blocks

    # -- steps ---------------------------------------------------------------------------
    def _compiled(self):
        """A Ray Compiled Graph over the ranks' step: shared-memory channels instead of an
        object-store put and one actor call per rank (see benchmarks/step_overhead.py)."""
        if self._graph is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([a.step.bind(inp) for a in self.actors])
            graph = dag.experimental_compile()
            # The driver reads each rank's output channel, and Ray registers it as that
            # channel's reader on its first read. A channel never read (a step whose rank 0
            # failed first ends before rank 1's output is read) is registered when the graph
            # closes it, after the ranks died: by then its buffer can be gone, and Ray's
            # check for it aborts this whole process (seen once in `make test`: "Experimental
            # mutable object must be in the local object store to register as reader").
            # So register every one now, while all ranks are alive.
            for channel in graph.dag_output_channels:
                channel.ensure_registered_as_reader()
            self._graph = graph
        return self._graph

    def step(self, step_input: StepInput) -> StepOutput | None:
        if not self.healthy:
            raise ShardError(self.error or "shard group is shut down")
        if self.use_compiled_graph:
            with self._in_flight():
                return self._step_compiled(step_input)
        return self._wait(self._submit(step_input))

    def _count_in_flight(self, delta: int) -> None:
        """Steps in flight (the watchdog looks for dead ranks while there are any)."""
        with self._lock:
            self._steps_in_flight += delta

    @contextlib.contextmanager
    def _in_flight(self):
        self._count_in_flight(1)
        try:
            yield
        finally:
            self._count_in_flight(-1)

    def _step_compiled(self, step_input: StepInput) -> StepOutput | None:
        with self._graph_lock:
            try:
                self._unpark()
                refs = self._compiled().execute(step_input)
                # timeout=-1: no deadline (Ray's default is RAY_CGRAPH_get_timeout, 10 s). A
                # compiled ref can be read only once, and a timed-out read of several
                # channels drops what it had read, so it cannot be polled; the watchdog
                # thread watches for dead ranks instead, and a death closes the channels
                # under this read.
                return [ref.get(timeout=-1) for ref in refs][0]
            except Exception as exc:  # any failure of the graph ends it: the group is done
                raise self._fail(self._wait_for_dead_rank(), exc) from exc
            finally:
                self._last_step = time.monotonic()

    @property
    def parked(self) -> bool:
        """Whether the ranks wait in a Park step (a compiled graph, idle)."""
        return self._parked_refs is not None

    def _park(self) -> None:
        """On the step thread: park the ranks if no step ran for PARK_AFTER_S."""
        if not self._graph_lock.acquire(blocking=False):  # a step is running
            return
        try:
            if (self._parked_refs is None and self.healthy and not self._steps_in_flight
                    and time.monotonic() - self._last_step >= PARK_AFTER_S):
                self._parked_refs = self._compiled().execute(Park())
        except Exception as exc:
            if self.healthy:  # not a graph that a shutdown tore down meanwhile
                self._fail(self._wait_for_dead_rank(), exc)
        finally:
            self._graph_lock.release()

    def _unpark(self) -> None:
        """Wake parked ranks and read their Park step's result, so a step can follow."""
        refs, self._parked_refs = self._parked_refs, None
        if refs is None:
            return
        for actor in self.actors:
            actor.unpark.remote()
        for ref in refs:  # a dead rank never answers: the watchdog fails the group
            ref.get(timeout=-1)

    def _submit(self, step_input: StepInput) -> list[ray.ObjectRef]:
        """Start a step on every rank. Each call carries its number, and a rank runs its
        steps in that order, so a second step may be submitted before the first returns
        (async scheduling). One rank gets the input inline; several share one object-store
        copy."""
        arg = step_input if len(self.actors) == 1 else ray.put(step_input)
        call, self._calls = self._calls, self._calls + 1
        refs = [a.step_in_order.remote(arg, call) for a in self.actors]
        self._count_in_flight(1)
        return refs

    def _wait(self, refs: list[ray.ObjectRef]) -> StepOutput | None:
        try:
            pending, result = list(refs), None
            while pending:  # a dead rank's ref resolves (to its error) without a deadline
                ready, pending = ray.wait(pending, num_returns=1)
                for done in ready:
                    rank = refs.index(done)
                    try:
                        value = ray.get(done)
                    except (RayActorError, RayTaskError) as exc:
                        raise self._fail(rank, exc) from exc
                    if rank == 0:
                        result = value
            return result
        finally:
            self._count_in_flight(-1)

    def step_async(self, step_input: StepInput) -> asyncio.Future:
        """Start a step now and return a future of its output, waited on this group's own
        thread so the event loop never blocks. Ray refs are waited on there, not awaited
        on the caller's loop: a ref's asyncio future can be cancelled under it (seen under
        Serve), which would look like the loop itself being cancelled. Actor calls are
        submitted here at once, so steps started back to back run back to back; a compiled
        graph's step runs whole on the thread that compiled it."""
        if not self.healthy:  # say why, rather than that the executor is shut down
            raise ShardError(self.error or "shard group is shut down")
        loop = asyncio.get_running_loop()
        try:
            if self.use_compiled_graph:
                return loop.run_in_executor(self._executor, self.step, step_input)
            return loop.run_in_executor(self._executor, self._wait, self._submit(step_input))
        except RuntimeError:  # the watchdog failed the group after the check above
            if self.healthy:
                raise
            raise ShardError(self.error or "shard group is shut down") from None

    # -- liveness --------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(WATCHDOG_INTERVAL_S):
            if not self._steps_in_flight:
                self._park_when_idle()
                continue
            try:
                rank = self._dead_rank()
            except Exception:  # the GCS did not answer this time: ask again next tick
                logger.warning("watchdog: could not read actor states", exc_info=True)
                continue
            if rank is not None:
                self._fail(rank, RayActorError(error_msg=f"rank {rank} is dead"))

    def _park_when_idle(self) -> None:
        """Queue a park behind any step already handed to the step thread, which then
        decides: a step that ran meanwhile makes it a no-op."""
        if (self._graph is None or self._parked_refs is not None
                or time.monotonic() - self._last_step < PARK_AFTER_S):
            return
        try:
            self._executor.submit(self._park)
        except RuntimeError:  # shut down meanwhile
            pass

    def _dead_rank(self) -> int | None:
        """The first rank the GCS reports dead, if any."""
        from ray._private import state

        for rank, actor in enumerate(self.actors):
            info = state.actors(actor._actor_id.hex())
            if info and info.get("State") == "DEAD":
                return rank
        return None

    def _wait_for_dead_rank(self) -> int | None:
        deadline = time.monotonic() + DEATH_REPORT_GRACE_S
        while (rank := self._dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return rank

    def _fail(self, rank: int | None, exc: Exception) -> ShardError:
        with self._lock:
            if not self.healthy and self.error:  # already failed (watchdog and step both saw it)
                return ShardError(self.error)
            if rank is not None and (isinstance(exc, RayActorError) or self._dead_rank() == rank):
                self.error = f"shard rank {rank} died (its actor process is gone)"
            elif rank is not None:
                self.error = f"shard rank {rank} failed: {type(exc).__name__}: {str(exc)[:300]}"
            else:
                self.error = (f"shard group step failed (no rank died): "
                              f"{type(exc).__name__}: {str(exc)[:300]}")
            logger.error(self.error)
            self.shutdown()
            return ShardError(self.error)

    def cut_short(self) -> None:
        """Ask the multi-step in flight to end after its current step: rank 0 decides for
        every rank. Not waited on: a late cut only shortens the next multi-step."""
        if self.healthy:
            self.actors[0].cut_short.remote()

    async def stage_adapter(self, name: str, path: str, timeout_s: float = 60.0) -> None:
        """Every rank reads the LoRA adapter at `path` beside its steps, so that the step
        that loads it (the engine's add_adapter) only copies it into place. TimeoutError
        past `timeout_s` (the step then reads it itself)."""
        await asyncio.wait_for(
            asyncio.gather(*(a.stage_adapter.remote(name, path) for a in self.actors)),
            timeout_s)

    def check_health(self) -> bool:
        """Whether every rank's process is alive, by the GCS: a busy rank is healthy."""
        if not self.healthy:
            return False
        rank = self._dead_rank()
        if rank is not None:
            self._fail(rank, RayActorError(error_msg=f"rank {rank} is dead"))
            return False
        return True

    def placements(self) -> Sequence[dict]:
        return ray.get([a.placement.remote() for a in self.actors], timeout=30)

    def shutdown(self) -> None:
        self.healthy = False
        self._closed.set()
        self._executor.shutdown(wait=False)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        graph, self._graph = self._graph, None
        if graph is not None:
            # Tearing down closes the channels, which ends a read blocked on them; it then
            # waits for the ranks' loops (up to RAY_CGRAPH_teardown_timeout), so it runs on
            # a thread of its own rather than the caller's (the watchdog or a step).
            threading.Thread(target=_teardown, args=(graph,), daemon=True,
                             name="shard-graph-teardown").start()


def _teardown(graph) -> None:
    try:
        graph.teardown(kill_actors=True)
    except Exception:  # Ray may have torn it down itself after an actor died
        logger.debug("compiled graph teardown", exc_info=True)
