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

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.messages import StepInput, StepOutput
from shards.actor import ShardActor
from shards.model_runner import ShardConfig

logger = logging.getLogger(__name__)


class ShardError(RuntimeError):
    """A shard died or failed a step; the group is unusable and must be replaced."""


class ShardGroup:
    def __init__(self, config: ShardConfig, tensor_parallel_size: int = 1, *,
                 use_gpu: bool = False, num_cpus_per_shard: float = 0.0,
                 name_prefix: str | None = None, init_timeout_s: float = 600.0):
        self.config = config
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

    def step(self, step_input: StepInput) -> StepOutput | None:
        pending = self._submit(step_input)
        results: dict[ray.ObjectRef, object] = {}
        refs = list(pending)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                results[ref] = self._get(ref, refs.index(ref))
        return results[refs[0]]

    async def step_async(self, step_input: StepInput) -> StepOutput | None:
        refs = self._submit(step_input)
        futures = [asyncio.ensure_future(self._await(ref, rank)) for rank, ref in enumerate(refs)]
        done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                for other in pending:
                    other.cancel()
                raise future.exception()
        return futures[0].result()

    async def _await(self, ref: ray.ObjectRef, rank: int):
        try:
            return await ref
        except (RayActorError, RayTaskError) as exc:
            raise self._fail(rank, exc) from exc

    def _get(self, ref: ray.ObjectRef, rank: int):
        try:
            return ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            raise self._fail(rank, exc) from exc

    def _fail(self, rank: int, exc: Exception) -> ShardError:
        reason = "died" if isinstance(exc, RayActorError) else "failed"
        self.error = f"shard rank {rank} {reason}: {type(exc).__name__}: {str(exc)[:300]}"
        logger.error(self.error)
        # The survivors may be stuck in a collective with the dead rank: end them too.
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
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
