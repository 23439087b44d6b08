"""Drives an LLMEngine from asyncio: one background loop runs steps, each request reads
its outputs from its own queue. The step itself is awaited (a thread for an in-process
shard, object refs for Ray shard actors), so the event loop never blocks on a forward.

A consumer that stops reading (client gone: CancelledError or GeneratorExit) aborts its
request, which frees its blocks before the next step.

With `max_steps_in_flight=2` (async scheduling) the next step is scheduled and started
while the current one runs, so the shards go from one forward to the next without waiting
for the batcher to apply results. That needs a worker that runs steps in the order they
were started (a Ray actor does; a thread pool would not).

A multi-step (the scheduler's num_scheduler_steps) runs several decode steps in one call;
a request that arrives while one is in flight calls `interrupt`, which asks the worker to
cut it short after the step it is in, so that the newcomer waits at most one step more
for its prefill."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
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
    def __init__(self, engine: LLMEngine, run_step: StepFn, on_step: StepHook | None = None,
                 max_steps_in_flight: int = 1, interrupt: Callable[[], object] | None = None):
        if max_steps_in_flight not in (1, 2):
            raise ValueError("max_steps_in_flight must be 1 or 2")
        self.engine = engine
        self.run_step = run_step
        self.on_step = on_step
        self.max_steps_in_flight = max_steps_in_flight
        self.interrupt = interrupt
        self._steps: deque[_Step] = deque()  # in flight, oldest first
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
            if self.interrupt is not None and any(
                    step[0].step_input.num_steps > 1 for step in self._steps):
                self.interrupt()
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
        # A fresh context: the loop serves every request and must not inherit the one whose
        # call happened to start it. Under Ray that context names the caller's task, and
        # cancelling a task (Serve does when a client leaves) cancels the calls made in it:
        # the shard step in flight for every request, not only the one that left.
        self._loop_task = asyncio.create_task(self._run_loop(), name="engine-loop",
                                              context=contextvars.Context())
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

    def _fill(self, steps: deque[_Step]) -> None:
        """Start steps until the pipeline is full or there is nothing more to compute."""
        while len(steps) < self.max_steps_in_flight and self.engine.has_unfinished_requests():
            step = self._start_step()
            if step is None:
                return
            steps.append(step)

    async def _run_loop(self) -> None:
        # Pipelined: the next step is scheduled and started as soon as a step's results
        # are applied (with async scheduling, before), and only then are that step's
        # outputs handed to the consumers, so that streaming them out overlaps the next
        # forward instead of sitting between two forwards. Aborts and new requests land
        # between schedules; blocks freed while a step that wrote them is in flight are
        # reused only by later steps, which the shards run after it.
        steps = self._steps = deque()
        done = 0.0  # when the last step's result arrived
        while True:
            try:
                if not steps:
                    if not self.engine.has_unfinished_requests():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    self._fill(steps)
                    if not steps:
                        await asyncio.sleep(0.001)
                        continue
                scheduled, running, started = steps[0]
                output = await running
                steps.popleft()
                # A step started while another ran began when that one ended.
                began, done = max(started, done), time.perf_counter()
                if self.on_step is not None:
                    self.on_step(scheduled, done - began)
                outputs = self.engine.process(scheduled, output)
                try:
                    self._fill(steps)
                finally:  # even if scheduling failed, these results are owed
                    self._dispatch(outputs)
            except Exception as exc:  # a shard or the engine failed: fail all, never hang
                for _, running, _ in steps:
                    running.cancel()
                steps.clear()
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
