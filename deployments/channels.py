"""Output channels: one message per engine step from a batcher replica to an ingress
replica, instead of one per request per step.

Every generation is still its own streamed call to the batcher (Serve routes it, counts
it, and cancels it when the client leaves, which aborts it). The call carries this
ingress replica's channel key; the replica answers first with `Routed`, saying where the
outputs go: into this call as before, or, if it holds this ingress's channel, into the
channel, which delivers every output of that replica's step for this ingress in one list.
The first generation a replica serves without a channel asks for one
(`Batcher.outputs`, routed to that replica by deployments/router.py); the replica ends it
after a few idle seconds, and the next generation opens it again.

Nothing waits forever: a channel that ends or fails fails the generations it carried
(ReplicaUnavailable); a generation whose call ended without its last output arriving
fails after FINAL_OUTPUT_GRACE_S."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator

from deployments.protocol import ChannelOpened, GenerateInput, OpenChannel, Routed
from engine.outputs import RequestOutput

logger = logging.getLogger("ray.serve")

# Between the end of a generation's call and its last output coming through the channel
# (two streams from one replica: usually the same moment).
FINAL_OUTPUT_GRACE_S = 10.0


class ChannelError(RuntimeError):
    """The channel a generation's outputs were coming through ended or failed."""


class OutputChannels:
    """This ingress replica's channels, at most one per batcher replica."""

    def __init__(self, batcher, key: str | None = None):
        self.batcher = batcher  # a streaming handle
        self.key = key or uuid.uuid4().hex
        self.queues: dict[str, asyncio.Queue] = {}
        # Channel id -> the generations it carries, from before it is asked for until it
        # ends: a generation told to read a channel that is not here fails at once.
        self.carried: dict[str, set[str]] = {}
        self.replicas: dict[str, str] = {}  # batcher replica id -> channel id (open ones)
        self.opening: set[str] = set()  # replica ids asked for and not yet answered
        self.tasks: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self.refused = 0  # channels a replica refused (it had one with this key)

    # -- generations -----------------------------------------------------------------
    async def generate(self, request: GenerateInput) -> AsyncIterator[RequestOutput]:
        """The outputs of one generation, whichever way they come. Closing this generator
        before the end cancels the call, which aborts the request."""
        request = GenerateInput(request.request_id, request.prompt_token_ids, request.params,
                                channel=self.key)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue  # before the call: outputs may come first
        call = self.batcher.generate.remote(request)
        drain: asyncio.Task | None = None
        carried: set[str] | None = None
        try:
            routed = await anext(call)
            if not isinstance(routed, Routed):
                raise RuntimeError(f"expected Routed first, got {type(routed).__name__}")
            if routed.channel_id is None:
                self._want(routed.replica_id)
                async for output in call:
                    yield output
                    if output.finished:
                        return
                return
            carried = self.carried.get(routed.channel_id)
            if carried is None:
                raise ChannelError(f"the output channel from batcher replica "
                                   f"{routed.replica_id} had already ended")
            carried.add(request.request_id)
            # The call yields nothing more (but an error if the channel closed under it);
            # it ends when the generation does, or raises if the replica failed.
            drain = asyncio.ensure_future(self._drain(call, queue))
            grace = None
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), grace)
                except asyncio.TimeoutError:
                    raise ChannelError("the generation ended but its last output never "
                                       "came") from None
                if isinstance(item, BaseException):
                    raise item
                if item is None:  # the call ended: the last output is on its way
                    grace = FINAL_OUTPUT_GRACE_S
                    continue
                yield item
                if item.finished:
                    return
        finally:
            self.queues.pop(request.request_id, None)
            if carried is not None:
                carried.discard(request.request_id)
            if drain is not None:
                drain.cancel()
            call.cancel()  # a no-op once the call ended

    @staticmethod
    async def _drain(call, queue: asyncio.Queue) -> None:
        try:
            async for output in call:
                queue.put_nowait(output)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)

    # -- channels --------------------------------------------------------------------
    def close(self) -> None:
        """End every channel: this ingress replica is going away. A channel is a call
        that a batcher replica counts as ongoing, so an open one would hold that replica's
        shutdown until it ended idle. Call on the loop the channels run on."""
        for task in list(self.tasks):
            if not task.get_loop().is_closed():  # the GC may call it after the loop ended
                task.cancel()

    def _want(self, replica_id: str) -> None:
        if replica_id in self.replicas or replica_id in self.opening:
            return
        self.opening.add(replica_id)
        channel_id = uuid.uuid4().hex
        self.carried[channel_id] = set()
        # A fresh context: the channel serves every request, not the one that opened it
        # (cancelling that request's call must not cancel this one).
        task = asyncio.get_running_loop().create_task(
            self._run(channel_id, replica_id), name=f"output-channel-{replica_id}",
            context=contextvars.Context())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, channel_id: str, target: str) -> None:
        call = self.batcher.outputs.remote(OpenChannel(self.key, channel_id, target))
        reached = None
        error: BaseException | None = None
        try:
            opened = await anext(call)
            if not isinstance(opened, ChannelOpened):
                raise RuntimeError(f"expected ChannelOpened first, got {type(opened).__name__}")
            if not opened.accepted or opened.replica_id in self.replicas:
                self.refused += 1
                return
            reached = opened.replica_id
            self.replicas[reached] = channel_id
            self.opening.discard(target)
            async for batch in call:
                for output in batch:
                    queue = self.queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            error = ChannelError("the ingress closed it")
            raise
        except Exception as exc:
            error = exc
            logger.warning("output channel to batcher replica %s failed: %s: %s",
                           reached or target, type(exc).__name__, str(exc)[:300])
        finally:
            self.opening.discard(target)
            if reached is not None and self.replicas.get(reached) == channel_id:
                del self.replicas[reached]
            why = f"{type(error).__name__}: {str(error)[:300]}" if error else "it ended"
            for request_id in self.carried.pop(channel_id, ()):  # none when it ended idle
                queue = self.queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(ChannelError(
                        f"the output channel from batcher replica {reached} ended ({why})"))
            call.cancel()
