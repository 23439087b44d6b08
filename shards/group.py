"""The batcher's handle on its shard actors: create them, size the KV cache, run steps.

Inside a placement group (a Serve replica's), rank i goes in bundle i + 1 (bundle 0 is the
replica's own); otherwise ranks are plain actors with a fraction of a CPU. A step puts its
input in the object store once and passes that one ref to every rank. Results are watched
as they arrive, so a dead rank fails the step as soon as Ray reports it, even while the
survivors are blocked in a collective waiting for it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.messages import StepInput, StepOutput
from shards.actor import ShardActor
from shards.model_runner import ShardConfig

logger = logging.getLogger(__name__)


# How often a step waiting on a compiled graph asks the GCS whether a rank died.
WATCHDOG_INTERVAL_S = 1.0


class ShardError(RuntimeError):
    """A shard died or failed a step; the group is unusable and must be replaced."""


class ShardGroup:
    def __init__(self, config: ShardConfig, tensor_parallel_size: int = 1, *,
                 use_gpu: bool = False, num_cpus_per_shard: float = 0.0,
                 name_prefix: str | None = None, init_timeout_s: float = 600.0,
                 compiled_graph: bool | None = None):
        self.config = config
        # Measured (benchmarks/step_overhead.py, 2 CPU cores): a compiled graph halves a
        # TP=2 decode step but slows TP=1, whose channel polling competes with torch for
        # the cores. None picks what was faster: compiled for tp > 1.
        self.use_compiled_graph = (tensor_parallel_size > 1 if compiled_graph is None
                                   else compiled_graph)
        self._graph = None  # compiled on first step
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shard-group")
        self.tensor_parallel_size = tensor_parallel_size
        self.healthy = False
        self.error: str | None = None
        pg = get_current_placement_group()
        self.actors = []
        for rank in range(tensor_parallel_size):
            options: dict = {"max_restarts": 0, "max_task_retries": 0}
            if pg is not None:
                bundle = pg.bundle_specs[rank + 1]
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank + 1)
                options["num_gpus"] = 1 if bundle.get("GPU") else 0
                options["num_cpus"] = bundle.get("CPU", 0)
            else:
                options["num_gpus"] = 1 if use_gpu else 0
                options["num_cpus"] = num_cpus_per_shard
            if name_prefix:
                options["name"] = f"{name_prefix}shard-{rank}"
            actor_cls = ray.remote(ShardActor).options(**options)
            self.actors.append(actor_cls.remote(config, rank, tensor_parallel_size))
        try:
            address, port = ray.get(self.actors[0].rendezvous_address.remote(),
                                    timeout=init_timeout_s)
            self.weight_bytes: list[int] = ray.get(
                [a.init_model.remote(address, port) for a in self.actors], timeout=init_timeout_s)
        except Exception:
            self.shutdown()
            raise
        self.num_blocks = 0
        self.healthy = True

    def warmup(self, max_batch_prefill_tokens: int, max_batch_total_tokens: int | None = None,
               timeout_s: float = 600.0) -> int:
        """Size the KV cache (the smallest any rank can hold) and allocate it everywhere."""
        counts = ray.get([a.profile_num_blocks.remote(max_batch_prefill_tokens)
                          for a in self.actors], timeout=timeout_s)
        num_blocks = min(counts)
        if max_batch_total_tokens is not None:
            num_blocks = min(num_blocks, -(-max_batch_total_tokens // self.config.block_size))
        ray.get([a.allocate_kv_cache.remote(num_blocks) for a in self.actors], timeout=timeout_s)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens = max_batch_total_tokens %d (tp=%d)",
                    num_blocks, self.config.block_size, num_blocks * self.config.block_size,
                    self.tensor_parallel_size)
        return num_blocks

    # -- steps ---------------------------------------------------------------------------
    def _submit(self, step_input: StepInput) -> list[ray.ObjectRef]:
        if not self.healthy:
            raise ShardError(self.error or "shard group is shut down")
        ref = ray.put(step_input)
        return [a.step.remote(ref) for a in self.actors]

    def _compiled(self):
        """A Ray Compiled Graph over the ranks' step: shared-memory channels instead of an
        object-store put and one actor call per rank (see benchmarks/step_overhead.py)."""
        if self._graph is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([a.step.bind(inp) for a in self.actors])
            self._graph = dag.experimental_compile()
        return self._graph

    def step(self, step_input: StepInput) -> StepOutput | None:
        if self.use_compiled_graph:
            if not self.healthy:
                raise ShardError(self.error or "shard group is shut down")
            try:
                refs = self._compiled().execute(step_input)
                while True:
                    try:
                        return ray.get(refs, timeout=WATCHDOG_INTERVAL_S)[0]
                    except GetTimeoutError:
                        self._raise_if_rank_dead()
            except ShardError:
                raise
            except Exception as exc:  # any failure of the graph ends it: the group is done
                raise self._fail(self._dead_rank(), exc) from exc
        pending = self._submit(step_input)
        results: dict[ray.ObjectRef, object] = {}
        refs = list(pending)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                results[ref] = self._get(ref, refs.index(ref))
        return results[refs[0]]

    async def step_async(self, step_input: StepInput) -> StepOutput | None:
        """`step` on this group's own thread, so the event loop never blocks. Ray refs are
        waited on there, not awaited on the caller's loop: a ref's asyncio future can be
        cancelled under it (seen under Serve), which would look like the loop itself being
        cancelled. One thread also keeps a compiled graph on the thread that compiled it."""
        if not self.healthy:  # say why, rather than that the executor is shut down
            raise ShardError(self.error or "shard group is shut down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.step, step_input)

    def _get(self, ref: ray.ObjectRef, rank: int):
        try:
            return ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            raise self._fail(rank, exc) from exc

    def _raise_if_rank_dead(self) -> None:
        rank = self._dead_rank()
        if rank >= 0:
            raise self._fail(rank, RayActorError(error_msg=f"rank {rank} is dead"))

    def _dead_rank(self) -> int:
        """The first rank the GCS reports dead (-1 if none is, yet)."""
        from ray._private import state

        for rank, actor in enumerate(self.actors):
            info = state.actors(actor._actor_id.hex())
            if info and info.get("State") == "DEAD":
                return rank
        return -1

    def _fail(self, rank: int, exc: Exception) -> ShardError:
        if not self.healthy and self.error:  # already failed (watchdog and step both saw it)
            return ShardError(self.error)
        if isinstance(exc, RayActorError) or (rank >= 0 and self._dead_rank() == rank):
            self.error = f"shard rank {rank} died (its actor process is gone)"
        else:
            self.error = f"shard rank {rank} failed: {type(exc).__name__}: {str(exc)[:300]}"
        logger.error(self.error)
        # Ray tears a compiled graph down itself after a system error; waiting on that here
        # could block on a survivor stuck in a collective with the dead rank, so just kill.
        self._graph = None
        self.shutdown()
        return ShardError(self.error)

    # -- health ----------------------------------------------------------------------
    def check_health(self, timeout_s: float = 10.0) -> bool:
        if not self.healthy:
            return False
        try:
            ok = ray.get([a.check_health.remote() for a in self.actors], timeout=timeout_s)
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            self.error = f"health check failed: {type(exc).__name__}"
            self.shutdown()
            return False
        return all(ok)

    def placements(self) -> Sequence[dict]:
        return ray.get([a.placement.remote() for a in self.actors], timeout=30)

    def shutdown(self) -> None:
        self.healthy = False
        self._executor.shutdown(wait=False)
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown(kill_actors=True)
            except Exception:  # already torn down after an actor death
                pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
