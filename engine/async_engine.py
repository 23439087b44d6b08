"""Drives an LLMEngine from asyncio: one background loop runs steps, each request reads
its outputs from its own queue. The step itself is awaited (a thread for an in-process
shard, object refs for Ray shard actors), so the event loop never blocks on a forward.

A consumer that stops reading (client gone: CancelledError or GeneratorExit) aborts its
request, which frees its blocks before the next step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.llm_engine import LLMEngine
from engine.messages import StepInput, StepOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInput], Awaitable[StepOutput | None]]
# How often a waiting consumer checks that the step loop is still alive.
SUPERVISE_INTERVAL_S = 1.0
# Called after every step that ran: (what was scheduled, seconds the step took).
StepHook = Callable[[SchedulerOutput, float], None]
# A step in flight: what was scheduled, the running forward, when it started.
_Step = tuple[SchedulerOutput, asyncio.Future, float]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, run_step: StepFn, on_step: StepHook | None = None):
        self.engine = engine
        self.run_step = run_step
        self.on_step = on_step
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.last_error: str | None = None

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def loop_state(self) -> str:
        task = self._loop_task
        if task is None:
            return "not started"
        if not task.done():
            return "running"
        if task.cancelled():
            return "cancelled"
        return f"failed: {task.exception()!r}"

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self._ensure_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        get: asyncio.Task | None = None
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._wakeup.set()
            while not finished:
                if get is None:
                    get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get}, timeout=SUPERVISE_INTERVAL_S)
                if not done:  # nothing yet: make sure the loop is still there to serve us
                    self._ensure_loop()
                    continue
                output, get = get.result(), None
                finished = output.finished
                yield output
        finally:
            if get is not None:
                get.cancel()
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)

    def _ensure_loop(self) -> None:
        """Start the step loop, or restart it if it ended (it should not; if it does, the
        requests it was serving must not wait forever)."""
        if self._loop_task is not None and not self._loop_task.done():
            return
        if self._loop_task is not None:
            # It may have ended between scheduling a step and applying its result, so the
            # requests it was serving cannot be trusted to progress: end them with an
            # error (never a silent hang), then serve new ones.
            reason = f"engine loop was interrupted ({self.loop_state()})"
            logger.error("%s; failing %d requests and restarting it", reason, len(self._queues))
            self._dispatch(self.engine.fail_all(reason))
        self._wakeup = asyncio.Event()  # events bind to the loop that first waits
        self._wakeup.set()
        self._loop_task = asyncio.create_task(self._run_loop(), name="engine-loop")
        self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        logger.warning("engine loop ended: %s", self.loop_state())

    def _start_step(self) -> _Step | None:
        """Schedule the next step and start it on the shards (None: nothing to run now)."""
        scheduled = self.engine.schedule()
        if scheduled.is_empty:  # requests may still have finished without running
            self._dispatch(self.engine.process(scheduled, None))
            return None
        return scheduled, asyncio.ensure_future(self.run_step(scheduled.step_input)), \
            time.perf_counter()

    async def _run_loop(self) -> None:
        # Pipelined: step N+1 is scheduled and started as soon as step N's results are
        # applied, and only then are step N's outputs handed to the consumers, so that
        # streaming them out (one message per request) overlaps the next forward instead
        # of sitting between two forwards. Aborts and new requests still land between
        # steps: a step's blocks are never freed for reuse before its result is applied.
        step: _Step | None = None
        while True:
            try:
                if step is None:
                    if not self.engine.has_unfinished_requests():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    step = self._start_step()
                    if step is None:
                        await asyncio.sleep(0.001)
                        continue
                (scheduled, running, started), step = step, None
                output = await running
                if self.on_step is not None:
                    self.on_step(scheduled, time.perf_counter() - started)
                outputs = self.engine.process(scheduled, output)
                try:
                    if self.engine.has_unfinished_requests():
                        step = self._start_step()
                finally:  # even if scheduling failed, these results are owed
                    self._dispatch(outputs)
            except Exception as exc:  # a shard or the engine failed: fail all, never hang
                if step is not None:
                    step[1].cancel()
                    step = None
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("step failed, failing %d requests", len(self._queues))
                self._dispatch(self.engine.fail_all(self.last_error))
                continue
            await asyncio.sleep(0)  # let consumers and new requests in

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
