"""Drives an LLMEngine from asyncio: one background loop runs steps, each request reads
its outputs from its own queue. The step itself is awaited (a thread for an in-process
shard, object refs for Ray shard actors), so the event loop never blocks on a forward.

A consumer that stops reading (client gone: CancelledError or GeneratorExit) aborts its
request, which frees its blocks before the next step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.llm_engine import LLMEngine
from engine.messages import StepInput, StepOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInput], Awaitable[StepOutput | None]]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, run_step: StepFn):
        self.engine = engine
        self.run_step = run_step
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.last_error: str | None = None

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()  # events bind to the loop that first waits
            self._loop_task = asyncio.create_task(self._run_loop(), name="engine-loop")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._wakeup.set()
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        queue = self._queues.get(request_id)
        if output is not None and queue is not None:
            queue.put_nowait(output)

    async def _run_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            scheduled = self.engine.schedule()
            output = None
            try:
                if not scheduled.is_empty:
                    output = await self.run_step(scheduled.step_input)
            except Exception as exc:  # a shard failed: fail every request, never hang
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.error("step failed, failing %d requests: %s",
                             len(self._queues), self.last_error)
                self._dispatch(self.engine.fail_all(self.last_error))
                continue
            self._dispatch(self.engine.process(scheduled, output))
            # Let consumers and new requests in between steps.
            await asyncio.sleep(0 if not scheduled.is_empty else 0.001)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
