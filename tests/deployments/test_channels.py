"""Output channels (deployments/channels.py) against a scripted batcher: every way a
channel or a generation's call can end must end the generation, with its outputs in
order or with an error, never a hang. Live paths (Serve, real batcher) are exercised in
test_faults.py and the e2e tests, where channels are on by default."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deployments import channels as channels_module
from deployments.channels import ChannelError, OutputChannels
from deployments.protocol import ChannelOpened, GenerateInput, OpenChannel, Routed
from deployments.router import PrefixCacheRouter
from engine.outputs import RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams


class Call:
    """A streamed call the test feeds: items, an exception, or the end (None)."""

    def __init__(self):
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True
        self.items.put_nowait(asyncio.CancelledError())


class Batcher:
    """Records each call; the test answers them."""

    def __init__(self):
        self.generations: list[tuple[GenerateInput, Call]] = []
        self.channels: list[tuple[OpenChannel, Call]] = []
        self.generate = SimpleNamespace(remote=self._generate)
        self.outputs = SimpleNamespace(remote=self._outputs)

    def _generate(self, request):
        call = Call()
        self.generations.append((request, call))
        return call

    def _outputs(self, request):
        call = Call()
        self.channels.append((request, call))
        return call


def out(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [token], [f"t{token}"], text=f"t{token}", finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


def request(i: int) -> GenerateInput:
    return GenerateInput(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4))


async def collect(channels: OutputChannels, i: int) -> list[int]:
    return [t for o in [o async for o in channels.generate(request(i))] for t in o.token_ids]


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def start(batcher: Batcher, channels: OutputChannels, i: int,
                routed: Routed) -> tuple[asyncio.Future, Call]:
    """Start generation r{i}; its call answers `routed` first."""
    task = asyncio.ensure_future(collect(channels, i))
    await settle()
    _, call = batcher.generations[-1]
    call.items.put_nowait(routed)
    return task, call


async def open_channel(batcher: Batcher, channels: OutputChannels) -> tuple[str, Call]:
    """Serve one generation in-band on replica A, which makes the ingress ask A for a
    channel; A accepts it."""
    task, call = await start(batcher, channels, 0, Routed("A", None))
    call.items.put_nowait(out("r0", 7, finished=True))
    assert await task == [7]
    await settle()
    opened, channel = batcher.channels[-1]
    assert opened.key == channels.key and opened.replica_id == "A"
    channel.items.put_nowait(ChannelOpened("A", accepted=True))
    await settle()
    assert channels.replicas == {"A": opened.channel_id}
    return opened.channel_id, channel


def test_outputs_of_several_generations_come_in_one_message_each_step():
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        channel_id, channel = await open_channel(batcher, channels)
        tasks = [asyncio.ensure_future(collect(channels, i)) for i in (1, 2)]
        await settle()
        calls = [call for _, call in batcher.generations[-2:]]
        assert all(r.channel == channels.key for r, _ in batcher.generations[-2:])
        # The step's message can overtake the calls' first items: nothing is lost.
        channel.items.put_nowait([out("r1", 10), out("r2", 20)])
        await settle()
        for call in calls:
            call.items.put_nowait(Routed("A", channel_id))
        channel.items.put_nowait([out("r1", 11, finished=True), out("r2", 21)])
        channel.items.put_nowait([out("r2", 22, finished=True)])
        for call in calls:
            call.items.put_nowait(None)
        assert await asyncio.gather(*tasks) == [[10, 11], [20, 21, 22]]
        assert len(batcher.channels) == 1  # asked once, not once per generation
        assert not channels.queues and channels.carried[channel_id] == set()

    asyncio.run(main())


def test_a_channel_that_fails_fails_the_generations_it_carried():
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        channel_id, channel = await open_channel(batcher, channels)
        task, call = await start(batcher, channels, 1, Routed("A", channel_id))
        channel.items.put_nowait([out("r1", 10)])
        await settle()
        channel.items.put_nowait(RuntimeError("replica A died"))
        with pytest.raises(ChannelError, match="replica A died"):
            await asyncio.wait_for(task, 5)
        assert call.cancelled  # the generation's call is cancelled: A aborts it
        assert channels.replicas == {}  # the next generation on A asks again
        task, _ = await start(batcher, channels, 2, Routed("A", channel_id))
        with pytest.raises(ChannelError, match="already ended"):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_a_call_that_ends_without_the_last_output_fails_after_the_grace(monkeypatch):
    monkeypatch.setattr(channels_module, "FINAL_OUTPUT_GRACE_S", 0.2)

    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        channel_id, channel = await open_channel(batcher, channels)
        task, call = await start(batcher, channels, 1, Routed("A", channel_id))
        call.items.put_nowait(None)  # ended, and the channel never brings the last output
        with pytest.raises(ChannelError, match="never came"):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_an_error_in_the_call_ends_the_generation_and_a_client_leaving_cancels_it():
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        channel_id, channel = await open_channel(batcher, channels)
        task, call = await start(batcher, channels, 1, Routed("A", channel_id))
        # The batcher found the channel closed under the generation: it says so in the call.
        call.items.put_nowait(RequestOutput("r1", finished=True, finish_reason=FinishReason.ERROR,
                                            error="the ingress's output channel closed"))
        outputs = await asyncio.wait_for(task, 5)
        assert outputs == []  # the error output itself (collect keeps tokens only)

        stream = channels.generate(request(2))
        first = asyncio.ensure_future(anext(stream))
        await settle()
        _, call = batcher.generations[-1]
        call.items.put_nowait(Routed("A", channel_id))
        channel.items.put_nowait([out("r2", 5)])
        assert (await asyncio.wait_for(first, 5)).token_ids == [5]
        await stream.aclose()  # the client left
        assert call.cancelled and "r2" not in channels.queues
        assert channels.carried[channel_id] == set()

    asyncio.run(main())


def test_an_idle_channel_ends_and_the_next_generation_asks_again():
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        _, channel = await open_channel(batcher, channels)
        channel.items.put_nowait(None)  # A ended it: idle
        await settle()
        assert channels.replicas == {}
        assert await asyncio.wait_for(collect_in_band(batcher, channels, 1), 5) == [3]
        assert len(batcher.channels) == 2 and batcher.channels[-1][0].replica_id == "A"

    async def collect_in_band(batcher, channels, i):
        task, call = await start(batcher, channels, i, Routed("A", None))
        call.items.put_nowait(out(f"r{i}", 3, finished=True))
        return await task

    asyncio.run(main())


def test_a_refused_channel_is_counted_and_asked_for_again_later():
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        task, call = await start(batcher, channels, 0, Routed("B", None))
        call.items.put_nowait(out("r0", 1, finished=True))
        await task
        await settle()
        opened, channel = batcher.channels[-1]
        channel.items.put_nowait(ChannelOpened("B", accepted=False))
        await settle()
        assert channels.refused == 1 and channels.replicas == {} and not channels.opening
        assert opened.channel_id not in channels.carried
        # B again, still in its call.
        task, call = await start(batcher, channels, 1, Routed("B", None))
        call.items.put_nowait(out("r1", 2, finished=True))
        assert await task == [2]
        await settle()
        assert len(batcher.channels) == 2 and batcher.channels[-1][0].replica_id == "B"

    asyncio.run(main())


class Replica(SimpleNamespace):
    pass


def test_the_router_sends_a_channel_to_the_replica_it_names():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = PrefixCacheRouter(deployment_id=DeploymentID("Batcher", "app"),
                               handle_source=DeploymentHandleSource.REPLICA)
    router.initialize_state()
    replicas = [Replica(replica_id=SimpleNamespace(unique_id=u)) for u in ("a1", "b2", "c3")]
    for target in ("a1", "b2", "c3"):
        pending = SimpleNamespace(args=[OpenChannel("ingress", "ch", target)], kwargs={})
        ranked = asyncio.run(router.choose_replicas(replicas, pending))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [[target]]


def test_closing_ends_every_channel_and_fails_what_it_still_carried():
    """An ingress replica that stops closes its channels: each is a call its batcher
    replica counts as ongoing, which would hold that replica's shutdown until it ended idle."""
    async def main():
        batcher = Batcher()
        channels = OutputChannels(batcher)
        channel_id, channel = await open_channel(batcher, channels)
        task, _ = await start(batcher, channels, 1, Routed("A", channel_id))
        channels.close()
        with pytest.raises(ChannelError, match="the ingress closed it"):
            await asyncio.wait_for(task, 5)
        assert channel.cancelled  # the batcher replica's side of the call ends too
        assert channels.replicas == {} and not channels.tasks

    asyncio.run(main())


def test_the_ingress_closes_its_channels_when_serve_stops_it(llama_dir):
    """Serve calls an ingress's __del__ on its loop once the replica's requests drained
    (serve.ingress wraps it); that is where the channels close."""
    from deployments.config import AppArgs
    from deployments.ingress import Ingress

    user_class = next(c for c in Ingress.func_or_class.__mro__ if c.__dict__.get("generate"))
    batcher = Batcher()
    batcher.options = lambda **kw: batcher

    async def main():
        ingress = user_class(batcher, AppArgs(model=llama_dir))
        assert isinstance(ingress.channels, OutputChannels)
        _, channel = await open_channel(batcher, ingress.channels)
        ingress.__del__()
        await settle()
        assert channel.cancelled and ingress.channels.replicas == {}

    asyncio.run(main())


def test_a_generation_keeps_its_channel_open_from_the_moment_it_is_routed(monkeypatch):
    """The batcher replica's side (deployments/batcher.py): a generation counts against its
    ingress's channel before its `Routed` goes out. Serve may hold the generator at that
    yield; a channel whose idle time ran out meanwhile ended under the generation it had
    just been given, which its ingress then failed (a 503 in test_faults, entry 76)."""
    from deployments import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "CHANNEL_IDLE_S", 0.05)
    finish: dict[str, asyncio.Event] = {}

    async def outputs_of(request):
        await finish[request.request_id].wait()
        yield out(request.request_id, 7, finished=True)

    replica = SimpleNamespace(replica_id="A", channels={}, ingress_active={},
                              channel_counts=dict.fromkeys(("opened", "messages", "outputs",
                                                            "tokens"), 0),
                              metrics=SimpleNamespace(inc=lambda *args: None),
                              _outputs=outputs_of)

    def generation(i: int):
        finish[f"r{i}"] = asyncio.Event()
        return batcher_module.Batcher.generate(
            replica, GenerateInput(f"r{i}", [1, 2, 3], SamplingParams(), channel="key"))

    async def main():
        channel_call = batcher_module.Batcher.outputs(replica, OpenChannel("key", "c1", "A"))
        assert (await anext(channel_call)).accepted
        batches = asyncio.ensure_future(anext(channel_call))
        first = generation(0)
        assert await anext(first) == Routed("A", "c1")
        finish["r0"].set()
        assert [o async for o in first] == []  # its output went into the channel
        assert [o.request_id for o in await batches] == ["r0"]
        # The next generation is routed to the channel just before its idle time runs out,
        # and held there for longer than that time.
        batches = asyncio.ensure_future(anext(channel_call))
        second = generation(1)
        assert await anext(second) == Routed("A", "c1")
        await asyncio.sleep(4 * batcher_module.CHANNEL_IDLE_S)
        assert not batches.done() and "key" in replica.channels
        finish["r1"].set()
        assert [o async for o in second] == []
        assert [o.request_id for o in await asyncio.wait_for(batches, 5)] == ["r1"]
        # With nothing left, it ends idle.
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(channel_call), 5)
        assert replica.channels == {} and replica.ingress_active == {}

    asyncio.run(main())
