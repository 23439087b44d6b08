"""The batcher deployment: one Serve replica = one engine scheduler + its shard group.

The replica's placement group reserves bundle 0 for itself and one bundle per shard rank,
so a replica and its GPUs are placed (and scaled) together. `generate` streams one
RequestOutput per engine step per request (all the tokens that step made), in its own
call or, when the ingress replica holds an output channel here (`outputs`), batched with
its other requests' into one message per step; either way a cancelled call (client gone)
aborts the request, freeing its blocks before the next step. `check_health` fails when
the engine loop or any shard is dead, so Serve replaces the replica and with it the
shards."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments.config import DEMO_MODEL, AppArgs, token_limits
from deployments.metrics import BATCHER, Metrics
from deployments.metrics_hub import Pusher, collect, replica_source
from deployments.protocol import ChannelOpened, GenerateInput, OpenChannel, Routed
from deployments.routing import pack_hashes
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import FinishReason
from shards.checkpoints.resolve import load_tokenizer
from shards.demo_model import ensure_demo_model
from shards.model.config import ModelConfig
from shards.worker import logs
from shards.worker.group import ShardGroup

logger = logging.getLogger("ray.serve")

# An output channel with no request for this long ends (the ingress opens it again when
# it needs it), so that an idle replica holds no call open: Serve could not scale it down
# or stop it gracefully while one is.
CHANNEL_IDLE_S = 5.0


class Channel:
    """Outputs owed to one ingress replica, sent together once per engine step."""

    def __init__(self, channel_id: str):
        self.id = channel_id
        self.pending: list[RequestOutput] = []
        self.ready = asyncio.Event()
        self.idle_since = time.monotonic()
        self.closed = False

    def put(self, output: RequestOutput) -> None:
        self.pending.append(output)
        self.ready.set()

    def take(self) -> list[RequestOutput]:
        batch, self.pending = self.pending, []
        self.ready.clear()
        return batch


class Batcher:
    def __init__(self, args: AppArgs, metrics_hub=None):
        logs.to_serve()
        with logs.start_failure_to_console("Batcher"):
            self._start(args, metrics_hub)

    def _start(self, args: AppArgs, metrics_hub) -> None:
        self.args = args
        if args.model == DEMO_MODEL:
            ensure_demo_model(args.model)
        model_config = ModelConfig.from_pretrained(args.model)
        try:
            context = serve.get_replica_context()
            prefix = f"{context.app_name}-{context.replica_id.unique_id}-"
            self.replica_id = context.replica_id.unique_id
        except Exception:  # not inside Serve (tests that build it directly)
            prefix, self.replica_id = None, "local"
        self.channels: dict[str, Channel] = {}
        self.ingress_active: dict[str, int] = {}  # generations per ingress channel key
        self.channel_counts = {"opened": 0, "messages": 0, "outputs": 0, "tokens": 0}
        self.group = ShardGroup(args.shard_config(), args.tensor_parallel_size,
                                use_gpu=args.device == "cuda", num_cpus_per_shard=args.shard_cpus,
                                name_prefix=prefix, compiled_graph=args.uses_compiled_graph)
        num_blocks = self.group.warmup(args.max_batch_prefill_tokens, args.max_batch_total_tokens)
        _, max_total_tokens = token_limits(args, model_config.max_position_embeddings)
        self.engine = LLMEngine(args.scheduler_config(max_total_tokens),
                                args.cache_config(num_blocks),
                                load_tokenizer(args.model, without_torch=True),
                                model_config.eos_token_ids, self.group,
                                frozenset(name for name, _ in args.adapters))
        self.metrics = Metrics(BATCHER)
        self._counted = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0, "aborted": 0,
                         "draft_tokens": 0, "accepted_tokens": 0}
        self.engine_loop = AsyncEngine(self.engine, self.group.step_async, self._record_step,
                                       max_steps_in_flight=args.steps_in_flight,
                                       interrupt=self.group.cut_short)
        self._record_gauges()
        self._packed: tuple[int, bytes] = (-1, b"")
        self.pusher, self.hub = None, metrics_hub
        self.start_adapters = frozenset(name for name, _ in args.adapters)
        # LoRA adapters of this replica's generations, counted from their arrival: one not
        # yet in the scheduler (an await or two away) is never the one max_cpu_loras drops.
        self.adapters_in_use: collections.Counter[str] = collections.Counter()
        if metrics_hub is not None:
            self.pusher = Pusher(metrics_hub, replica_source("Batcher"), self._families)
        self.compute_path = self.group.placements()[0]["compute_path"]  # rank 0's, as all
        logger.info("batcher ready: tp=%d, %d KV blocks (max_batch_total_tokens=%d), "
                    "%d step(s) in flight", args.tensor_parallel_size, num_blocks,
                    self.engine.scheduler.max_batch_total_tokens, args.steps_in_flight)

    async def generate(self, request: GenerateInput) -> AsyncIterator[RequestOutput | Routed]:
        channel = self.channels.get(request.channel) if request.channel else None
        if request.channel is not None:
            # Any generation of this ingress keeps its channel from closing idle: one
            # that started before the channel opened (a long prefill) is still its load.
            # Counted before the ingress is told to read the channel: the yield can wait
            # (Serve sends the item on), and a channel whose idle time ran out meanwhile
            # ended under the generation it had just been given (entry 76).
            self.ingress_active[request.channel] = self.ingress_active.get(request.channel, 0) + 1
        outputs = self._outputs(request)
        try:
            if request.channel is not None:
                yield Routed(self.replica_id, channel.id if channel is not None else None)
            async for output in outputs:
                if channel is None:
                    yield output
                elif channel.closed:  # the ingress let go of it: what it held is lost
                    yield RequestOutput(request.request_id, finished=True,
                                        finish_reason=FinishReason.ERROR,
                                        error="the ingress's output channel closed")
                    return
                else:
                    channel.put(output)
        finally:
            await outputs.aclose()  # aborts the request unless it finished
            if request.channel is not None:
                self.ingress_active[request.channel] -= 1
                if not self.ingress_active[request.channel]:
                    del self.ingress_active[request.channel]
                if (current := self.channels.get(request.channel)) is not None:
                    current.idle_since = time.monotonic()

    async def _adapter_error(self, adapter: str) -> str | None:
        """Load a run-time LoRA adapter this replica does not hold yet (with the next step,
        on every rank), dropping those unloaded since; why not, if it cannot."""
        runtime = {} if self.hub is None else await self.hub.adapters.remote()
        paths = dict(runtime.values())  # id -> path
        for stale in self.engine.adapters - self.start_adapters - set(paths):
            self.engine.remove_adapter(stale)  # dropped once none of its requests is left
        if adapter in self.engine.adapters:  # another request loaded it meanwhile
            return None
        if adapter not in paths:
            return f"LoRA adapter {adapter.partition('@')[0]!r} is not loaded"
        # Read on every rank beside the steps, so that the step that loads it stalls no
        # stream for the reading (a bad one is refused by that step, as without this).
        try:
            await self.group.stage_adapter(adapter, paths[adapter])
        except Exception as e:  # a rank that died, or one too slow: the step reads it
            logger.warning("LoRA adapter %s not read ahead: %r", adapter, e)
        if adapter in self.engine.adapters:  # loaded by another request meanwhile
            return None
        evicted = self.engine.add_adapter(adapter, paths[adapter], +self.adapters_in_use)
        if evicted:
            logger.info("LoRA adapters %s dropped (max_cpu_loras=%s, least recently used)",
                        ", ".join(evicted), self.args.max_cpu_loras)
        return None

    async def _outputs(self, request: GenerateInput) -> AsyncIterator[RequestOutput]:
        adapter = request.params.adapter
        if adapter is not None:
            self.adapters_in_use[adapter] += 1
        outputs = self._engine_outputs(request)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # aborts the request unless it finished
            if adapter is not None:
                self.adapters_in_use[adapter] -= 1

    async def _engine_outputs(self, request: GenerateInput) -> AsyncIterator[RequestOutput]:
        adapter = request.params.adapter
        if adapter is not None and adapter not in self.engine.adapters:
            error = await self._adapter_error(adapter)
            if error is not None:
                yield RequestOutput(request.request_id, finished=True,
                                    finish_reason=FinishReason.ERROR, error=error)
                return
        stream = self.engine_loop.generate(request.request_id, request.prompt_token_ids,
                                           request.params)
        deadline = (time.monotonic() + self.args.request_timeout
                    if self.args.request_timeout else None)
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    output = await asyncio.wait_for(anext(stream), timeout)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    yield RequestOutput(request.request_id, finished=True,
                                        finish_reason=FinishReason.ERROR,
                                        error="request timed out after "
                                              f"{self.args.request_timeout:g} s")
                    return
                yield output
                if output.finished:
                    return
        finally:
            await stream.aclose()  # aborts the request unless it finished

    async def outputs(
            self, request: OpenChannel) -> AsyncIterator[ChannelOpened | list[RequestOutput]]:
        """An ingress replica's output channel: every output of its generations that
        chose it, one list per engine step. Ends after CHANNEL_IDLE_S without any."""
        if request.key in self.channels:
            yield ChannelOpened(self.replica_id, accepted=False)
            return
        channel = self.channels[request.key] = Channel(request.channel_id)
        self.channel_counts["opened"] += 1
        try:
            yield ChannelOpened(self.replica_id, accepted=True)
            while True:
                try:
                    await asyncio.wait_for(channel.ready.wait(), CHANNEL_IDLE_S)
                except asyncio.TimeoutError:
                    if (not self.ingress_active.get(request.key) and not channel.pending
                            and time.monotonic() - channel.idle_since >= CHANNEL_IDLE_S):
                        return
                    continue
                await asyncio.sleep(0)  # the rest of this step's outputs join the batch
                batch = channel.take()
                self.channel_counts["messages"] += 1
                self.channel_counts["outputs"] += len(batch)
                self.channel_counts["tokens"] += sum(len(o.token_ids) for o in batch)
                self.metrics.inc("raygen_output_channel_messages")
                self.metrics.inc("raygen_output_channel_outputs", len(batch))
                yield batch
        finally:  # no await before this: a generation never sends to a channel that left
            channel.closed = True
            if self.channels.get(request.key) is channel:
                del self.channels[request.key]

    def _record_step(self, scheduled, seconds: float) -> None:
        m = self.metrics
        method = {"method": "prefill" if scheduled.num_prefill_tokens else "decode"}
        # A multi-step counts as the forwards it ran, each the mean of their time.
        forwards = scheduled.step_input.num_steps
        m.inc("tgi_batch_inference_count", forwards, tags=method)
        for _ in range(forwards):
            m.observe("tgi_batch_forward_duration", seconds / forwards, tags=method)
        if scheduled.concat_reason is not None:
            m.inc("tgi_batch_concat", tags={"reason": scheduled.concat_reason})
        self._record_gauges()

    def _record_gauges(self) -> None:
        scheduler, m = self.engine.scheduler, self.metrics
        bm = scheduler.block_manager
        m.set("tgi_batch_current_size", len(scheduler.running))
        m.set("tgi_queue_size", len(scheduler.waiting))
        m.set("tgi_batch_current_max_tokens", scheduler.max_batch_total_tokens)
        m.set("raygen_kv_blocks_used", bm.num_used_blocks)
        m.set("raygen_kv_blocks_capacity", bm.num_blocks)
        load = self.load()
        m.set("raygen_queued_prompt_tokens", load["queued_tokens"])
        m.set("raygen_oldest_wait_seconds", load["queue_wait_s"])
        stats = scheduler.stats
        totals = {"raygen_prefix_cache_queries": ("prefix_queries", bm.prefix_queries),
                  "raygen_prefix_cache_hits": ("prefix_hits", bm.prefix_hits),
                  "raygen_preemptions": ("preemptions", stats.num_preemptions),
                  "raygen_aborted_requests": ("aborted", stats.num_aborted),
                  "raygen_speculation_draft_tokens": ("draft_tokens", stats.num_draft_tokens),
                  "raygen_speculation_accepted_tokens": ("accepted_tokens",
                                                         stats.num_accepted_tokens)}
        for name, (key, total) in totals.items():  # counters move by what changed since
            m.inc(name, total - self._counted[key])
            self._counted[key] = total

    async def metrics_text(self) -> str:
        self._record_gauges()  # an idle replica's gauges still tell the truth
        return self.metrics.text()

    def _families(self):
        self._record_gauges()
        return collect(self.metrics.registry)

    # -- what Serve's router and autoscaler read (deployments/router.py, autoscaling.py) --
    def load(self) -> dict:
        """This replica's load: requests, prompt tokens not yet prefilled, the oldest
        wait, KV blocks."""
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in scheduler.running)
        now = time.monotonic()
        oldest = min((r.arrival_time for r in scheduler.waiting), default=now)
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "queued_tokens": queued, "queue_wait_s": now - oldest,
                "free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks,
                "preempted_waiting": sum(r.num_preemptions > 0 for r in scheduler.waiting)}

    async def record_routing_stats(self) -> dict:
        """Serve's routing-stats hook, polled every request_routing_stats_period_s: the
        block names this replica's prefix cache holds (packed) and its load. Async so it
        runs on the engine loop's thread, between steps' bookkeeping."""
        bm = self.engine.scheduler.block_manager
        if self._packed[0] != bm.names_version:  # repack only what changed
            self._packed = (bm.names_version, pack_hashes(bm.cached_names))
        return {"v": 1, "time": time.time(), "block_size": bm.block_size,
                "blocks": self._packed[1], "adapters": sorted(self.engine.adapters),
                **self.load()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook, read by deployments/autoscaling.py."""
        load = self.load()
        return {"queued_tokens": float(load["queued_tokens"]),
                "queue_wait_s": float(load["queue_wait_s"]),
                "kv_usage": 1.0 - load["free_blocks"] / load["total_blocks"],
                "preempted_waiting": float(load["preempted_waiting"])}

    async def check_health(self) -> None:
        if self.pusher is not None:
            self.pusher.ensure_started()
        if not self.group.healthy:
            raise RuntimeError(f"shards unhealthy: {self.group.error}")
        if self.engine_loop.last_error and not self.group.healthy:
            raise RuntimeError(f"engine loop failed: {self.engine_loop.last_error}")
        if not await asyncio.to_thread(self.group.check_health):
            raise RuntimeError(f"shards unhealthy: {self.group.error}")

    async def info(self) -> dict:
        """What /info adds to TGI's fields: how the shards compute."""
        return {"compute_path": self.compute_path,
                "tensor_parallel_size": self.args.tensor_parallel_size,
                "num_scheduler_steps": self.args.num_scheduler_steps}

    async def stats(self) -> dict:
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        try:
            scheduler.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = str(exc)
        return {
            "engine_loop": self.engine_loop.loop_state(),
            "integrity": integrity,
            "healthy": self.group.healthy,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "max_batch_total_tokens": scheduler.max_batch_total_tokens,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "preemptions": scheduler.stats.num_preemptions,
            "aborted": scheduler.stats.num_aborted,
            "output_channels": {"open": len(self.channels), **self.channel_counts},
        }

    def __del__(self):
        pusher = getattr(self, "pusher", None)
        if pusher is not None:
            pusher.stop()
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()
