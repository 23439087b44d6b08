"""The engine: scheduler + a worker that runs steps + per-request output processing.

The worker is anything with `step(StepInput) -> StepOutput | None` (an in-process shard,
or a group of Ray shard actors), injected so tests can run the engine with either.
`schedule` and `process` are separate so an async caller can await the worker between
them without blocking its event loop.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import CacheConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer, StopChecker
from engine.messages import StepInput, StepOutput
from engine.outputs import RequestOutput
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


class Worker(Protocol):
    def step(self, step_input: StepInput) -> StepOutput | None: ...


@dataclass(slots=True)
class _OutputState:
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    # Per prompt token (None for the first, and until its step scores it), when asked.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_logprobs_sent: bool = False
    first_sent: bool = False


class LLMEngine:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 tokenizer: Any, eos_token_ids: frozenset[int], worker: Worker | None = None,
                 adapters: Collection[str] = ()):
        self.scheduler = Scheduler(scheduler_config, cache_config, eos_token_ids)
        self.tokenizer = tokenizer
        self.worker = worker
        # The LoRA adapters a request may name: those the worker loaded at start, and
        # those added since (loaded by the worker with the next step), the latter by when
        # a request last named them (least recent first: max_cpu_loras evicts from there).
        self.adapters: set[str] = set(adapters)
        self.added_adapters: dict[str, None] = {}
        self._states: dict[str, _OutputState] = {}

    # -- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        if params.adapter is not None and params.adapter not in self.adapters:
            raise ValueError(f"LoRA adapter {params.adapter!r} is not loaded")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, list(prompt_token_ids), params, seed)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        if params.adapter in self.added_adapters:  # the most recently used now
            self.added_adapters[params.adapter] = self.added_adapters.pop(params.adapter)
        self._states[request_id] = _OutputState(
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
            StopChecker(params.stop, params.include_stop_str_in_output),
            [None] * len(prompt_token_ids) if params.prompt_logprobs else None,
            [None] * len(prompt_token_ids) if params.prompt_top_n_tokens else None,
            [None] * len(prompt_token_ids) if params.prompt_ranks else None,
        )

    def add_adapter(self, name: str, path: str, in_use: Iterable[str] = ()) -> list[str]:
        """Serve the LoRA adapter at `path` as `name` from the next step on. Past
        max_cpu_loras added adapters, the least recently used without a request running
        or waiting, and not `in_use` (requests on their way in), is removed first;
        returns those removed."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        evicted = []
        limit = self.scheduler.config.max_cpu_loras
        if limit is not None:
            busy = {r.params.adapter for r in self.scheduler.requests.values()} | set(in_use)
            for old in list(self.added_adapters):
                if len(self.added_adapters) < limit:
                    break
                if old not in busy:
                    self.remove_adapter(old)
                    evicted.append(old)
        self.adapters.add(name)
        self.added_adapters[name] = None
        self.scheduler.change_adapter(name, path)
        return evicted

    def remove_adapter(self, name: str) -> None:
        """Refuse new requests for `name`; the worker drops it once none runs or waits."""
        self.adapters.remove(name)
        self.added_adapters.pop(name, None)
        self.scheduler.change_adapter(name, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        state = self._states.pop(request_id, None)
        if request is None or state is None:
            return None
        return RequestOutput(request_id, finished=True, finish_reason=FinishReason.ABORTED,
                             num_prompt_tokens=request.num_prompt_tokens)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (the shards died): nothing is left hanging."""
        outputs = []
        for request_id in list(self.scheduler.requests):
            self.scheduler.finish(request_id, FinishReason.ERROR)
            self._states.pop(request_id, None)
            outputs.append(RequestOutput(request_id, finished=True,
                                         finish_reason=FinishReason.ERROR, error=error))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.worker is None:
            raise RuntimeError("no worker: use schedule() and process() instead")
        scheduled = self.schedule()
        if scheduled.is_empty:
            return self.process(scheduled, None)
        return self.process(scheduled, self.worker.step(scheduled.step_input))

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def process(self, scheduled: SchedulerOutput, output: StepOutput | None) -> list[RequestOutput]:
        results = [self._finished_early(r) for r in self.scheduler.finished_unscheduled]
        self.scheduler.finished_unscheduled.clear()
        if output is None:
            self.scheduler.update(scheduled, None)
            return results
        for request_id, scores in output.prompt_logprobs.items():
            state = self._states.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                # By position: a request computed again after preemption scores again.
                at = slice(scores.start + 1, scores.start + 1 + len(scores.logprobs))
                state.prompt_logprobs[at] = scores.logprobs
                if state.prompt_top_logprobs is not None:
                    state.prompt_top_logprobs[at] = scores.top_logprobs
                if state.prompt_ranks is not None:
                    state.prompt_ranks[at] = scores.ranks
        for request_id, error in output.errors.items():
            request = self.scheduler.finish(request_id, FinishReason.ERROR)
            if request is not None and self._states.pop(request_id, None) is not None:
                results.append(RequestOutput(request_id, finished=True,
                                             finish_reason=FinishReason.ERROR, error=error,
                                             num_prompt_tokens=request.num_prompt_tokens))
        drafts = scheduled.step_input.draft_token_ids
        for request, rows in self.scheduler.update(scheduled, output):
            request_id = request.request_id
            if request_id in drafts:
                accepted = len(rows) - 1
            else:  # a multi-step's drafts (the shard's), or none
                accepted = output.drafted.get(request_id, (0, 0))[1]
            results.append(self._make_output(request, output, rows, accepted))
        return results

    def _make_output(self, request: Request, output: StepOutput, rows: list[int],
                     accepted: int = 0) -> RequestOutput:
        """The step's tokens for one request (several where its drafts were kept, or in a
        multi-step); a stop string found in one drops the tokens after it."""
        state = self._states[request.request_id]
        token_ids, pieces = [], []
        finished = request.is_finished  # at its last row (eos, stop token, length)
        before = request.num_output_tokens - len(rows)  # the request's tokens before these
        for i, row in enumerate(rows):
            token_ids.append(output.token_ids[row])
            piece = state.detokenizer.step(token_ids[-1])
            last = i == len(rows) - 1
            if last and finished:
                piece += state.detokenizer.flush()
            pieces.append(piece)
            held = before + i + 1 < request.params.min_tokens  # no stop string ends it yet
            if state.stop.append(piece, check=not held):
                if not finished:
                    self.scheduler.finish(request.request_id, FinishReason.STOP_SEQUENCE)
                    finished = True
                elif not last or request.finish_reason is FinishReason.LENGTH:
                    # It ends at a later row of these (EOS, a stop token, its length): the
                    # string came first. At the same row the string wins over the length,
                    # as vLLM's (the text was cut there); an EOS or a stop token stands.
                    # TGI's routes report TGI's order themselves (tgi_api.finish_reason).
                    request.finish_reason = FinishReason.STOP_SEQUENCE
                if not last:  # a stop string within this step's tokens: the rest go
                    pieces[-1] += state.detokenizer.flush()
                    break
        kept = rows[:len(token_ids)]
        result = RequestOutput(
            request.request_id,
            token_ids=token_ids,
            token_texts=pieces,
            logprobs=[output.logprobs[row] for row in kept],
            top_logprobs=([output.top_logprobs[row] for row in kept] if output.top_logprobs
                          else [[] for _ in kept]),
            text=state.stop.take(finished),
            finished=finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            accepted_drafts=min(accepted, len(token_ids) - 1),
        )
        if finished and request.finish_reason is FinishReason.STOP_SEQUENCE:
            result.stop_reason = (state.stop.matched if state.stop.matched is not None
                                  else token_ids[-1])  # a stop token
        if not state.first_sent:
            state.first_sent = True
            if request.first_scheduled_time is not None:
                result.queue_time = request.first_scheduled_time - request.arrival_time
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            result.prompt_logprobs = list(state.prompt_logprobs)
            result.prompt_top_logprobs = (None if state.prompt_top_logprobs is None
                                          else list(state.prompt_top_logprobs))
            result.prompt_ranks = (None if state.prompt_ranks is None
                                   else list(state.prompt_ranks))
            state.prompt_logprobs_sent = True
        if finished:
            del self._states[request.request_id]
        return result

    def _finished_early(self, request: Request) -> RequestOutput:
        self._states.pop(request.request_id, None)
        return RequestOutput(request.request_id, finished=True,
                             finish_reason=request.finish_reason,
                             num_prompt_tokens=request.num_prompt_tokens)
