"""Continuous batching: each step decides which tokens of which requests to compute.

Running requests go first (a decode token each, or the next chunk of their prompt),
preempting from the tail when the cache is full; then waiting requests are admitted in
arrival order while the prefill budget and free blocks allow. As in TGI v3, with chunked
prefill (the default) new prompts join at every step, the step's tokens in all within
`max_batch_prefill_tokens`; without it (or when set), TGI's `waiting_served_ratio` /
`max_waiting_tokens` decide when a running batch is worth interrupting for new prefills.

Async scheduling (vLLM v1's): the next step may be scheduled while the current one runs.
A request whose sample is still in flight counts it as a placeholder token; the next step
computes that position anyway, because the shards feed their own samples in, and the
token becomes known here when the step that sampled it returns. A request is never given
a placeholder past its length limits, so only an EOS or a stop sequence wastes a row.

Drafts (`speculate`) and multi-steps (`num_scheduler_steps`), which take a step past
each request's next token, are engine/lookahead.py's decisions.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.lookahead import Lookahead, speculates
from engine.messages import CachedRequestData, NewRequestData, StepDrafting, StepInput, StepOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.speculation import SpeculationState


@dataclass(slots=True)
class SchedulerOutput:
    step_input: StepInput
    num_prefill_tokens: int
    num_decode_tokens: int
    num_admitted: int
    preempted_ids: list[str] = field(default_factory=list)
    # Requests this step samples a token for (each holds a placeholder until it returns).
    sampling_ids: list[str] = field(default_factory=list)
    # Why new requests joined a running batch (TGI's tgi_batch_concat reasons): chunked
    # prefill ("chunking"), enough of them waited ("backpressure") or they waited long
    # enough ("wait_exceeded").
    concat_reason: str | None = None

    @property
    def is_empty(self) -> bool:
        return not self.step_input.num_scheduled_tokens


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0  # drafts computed
    num_accepted_tokens: int = 0  # of which kept


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 eos_token_ids: frozenset[int] = frozenset()):
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be known before scheduling")
        self.config = config
        self.eos_token_ids = eos_token_ids
        num_blocks = cache_config.num_blocks
        if config.max_batch_total_tokens is not None:
            needed = -(-config.max_batch_total_tokens // cache_config.block_size)
            num_blocks = min(num_blocks, needed)
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.freed_ids: list[str] = []  # to tell the shards at the next step
        self.adapter_changes: list[tuple[str, str | None]] = []  # LoRA loads and drops
        # Finished without a step (too long for the whole cache): the engine reports them.
        self.finished_unscheduled: list[Request] = []
        self.steps_since_admission = 0
        self.stats = SchedulerStats()
        self.lookahead = Lookahead(config, self.block_manager, self.stats)

    @property
    def max_batch_total_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if self.config.speculate:
            request.speculation = SpeculationState(self.config.prompt_lookup_min,
                                                   self.config.prompt_lookup_max)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the policy ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_batch_prefill_tokens
        scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        preempted: list[str] = []
        had_running = bool(self.running)

        # TGI v3 with chunked prefill: new prompts join the running batch's step, whose
        # tokens in all (decodes included) stay within max_batch_prefill_tokens.
        reserved = 0
        if self.config.enable_chunked_prefill:
            reserved = min(budget, sum(self._num_wanted(r) == 1 for r in self.running))
            budget -= reserved

        budget, num_decode = self._schedule_running(budget, scheduled, drafts, preempted)

        num_admitted = 0
        concat_reason = self._may_admit(had_running)
        if concat_reason is not None:
            num_admitted, budget = self._admit(scheduled, budget)
        self.steps_since_admission = 0 if num_admitted or not had_running else (
            self.steps_since_admission + 1)
        num_drafted = sum(map(len, drafts.values()))  # decode rows, not prompt tokens
        num_prefill = self.config.max_batch_prefill_tokens - budget - reserved - num_drafted
        num_steps, drafting = 1, None
        if not (num_prefill or num_admitted or drafts or preempted or self.waiting):
            num_steps, drafting = self.lookahead.multi_step(scheduled, self.requests)
        step_input, sampling_ids = self._make_step_input(scheduled, drafts, num_steps, drafting)
        return SchedulerOutput(
            step_input, num_prefill, num_decode, num_admitted, preempted,
            concat_reason=concat_reason if had_running and num_admitted else None,
            sampling_ids=sampling_ids)

    def _schedule_running(self, budget: int, scheduled: dict[str, int],
                          drafts: dict[str, list[int]], preempted: list[str]
                          ) -> tuple[int, int]:
        """The running requests' tokens, oldest first: a decode token each (with its
        drafts), or the next chunk of a prompt within `budget`; where blocks run out the
        newest are preempted. Fills `scheduled`, `drafts` and `preempted`; returns the
        budget left and the number of decoding requests."""
        num_decode = 0
        draft_rows = self.lookahead.draft_rows(self.running)
        i = 0
        while i < len(self.running):
            request = self.running[i]
            num_new = self._num_wanted(request)
            if num_new == 0:
                i += 1  # its last token is in flight: nothing more to compute
                continue
            if num_new > 1:  # a prompt (or recompute) still catching up
                num_new = min(num_new, budget)
                if num_new == 0:
                    i += 1
                    continue
            elif request.speculation is not None:
                draft = self.lookahead.draft(request, min(draft_rows, budget))
                if draft:
                    drafts[request.request_id] = draft
                    draft_rows -= len(draft)
                    budget -= len(draft)
                    num_new += len(draft)
            total = request.num_computed_tokens + num_new
            while not self.block_manager.can_allocate(request.request_id, total):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                drafts.pop(victim.request_id, None)
                if victim is request:
                    break
            else:
                self.block_manager.allocate(request.request_id, total)
                scheduled[request.request_id] = num_new
                if request.request_id in drafts or num_new == 1:
                    num_decode += 1
                else:
                    budget -= num_new
                i += 1
        return budget, num_decode

    def _num_wanted(self, request: Request) -> int:
        """Tokens a running request would compute next: 1 to decode, more for a prompt
        catching up, 0 when its last sample is in flight and it may not grow, or when it
        speculates (its next positions are known once that step returns)."""
        if request.num_placeholders and (not self._may_grow(request)
                                         or speculates(request)
                                         or request.num_step_tokens):
            return 0
        return request.num_tokens + request.num_placeholders - request.num_computed_tokens

    def _may_grow(self, request: Request) -> bool:
        """Whether a request may sample past the tokens it has and those in flight."""
        pending = request.num_tokens + request.num_placeholders
        return (pending - request.num_prompt_tokens < request.params.max_new_tokens
                and pending < self.config.max_model_len)

    def _may_admit(self, had_running: bool) -> str | None:
        """Whether to try admitting now, and why (None: not now)."""
        if not self.waiting:
            return None
        if not had_running:
            return "empty"
        ratio, max_waiting_tokens = self.config.admission
        if self.config.enable_chunked_prefill and (ratio, max_waiting_tokens) == (0.0, 0):
            return "chunking"  # TGI v3's default with chunked prefill: every step
        if self.steps_since_admission >= max_waiting_tokens:
            return "wait_exceeded"
        min_size = math.floor(len(self.running) * ratio)
        return "backpressure" if len(self.waiting) >= min_size else None

    def _admit(self, scheduled: dict[str, int], budget: int) -> tuple[int, int]:
        max_size = self.config.max_batch_size
        num_admitted = 0
        # LoRA adapters with requests running: a request of another one waits while
        # max_loras do, and those behind it go first (as vLLM's scheduler skips it).
        adapters = {r.params.adapter for r in self.running if r.params.adapter is not None}
        at = 0
        while at < len(self.waiting) and budget > 0 and (
                max_size is None or len(self.running) < max_size):
            request = self.waiting[at]
            adapter = request.params.adapter
            if (adapter is not None and adapter not in adapters
                    and len(adapters) >= self.config.max_loras):
                at += 1
                continue
            if request.num_placeholders:
                break  # preempted with a sample in flight: back once that sample is known
            computed, num_cached = [], 0
            if not request.params.prompt_logprobs:  # cached tokens would have no logprobs
                computed, num_cached = self.block_manager.get_computed_blocks(
                    request.token_ids, request.params.prefix_namespace)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                # Without chunking a prompt goes whole. One that can never fit is
                # refused at validation; if it got here anyway, run it alone.
                if scheduled or num_new <= self.config.max_batch_prefill_tokens:
                    break
            else:
                num_new = min(num_new, budget)
            total = num_cached + num_new
            if not self.block_manager.can_allocate(request.request_id, total, computed):
                if not self.running and not scheduled:
                    # Alone with every block free and still no room: it never will fit.
                    self.finished_unscheduled.append(
                        self.finish(request.request_id, FinishReason.LENGTH))
                    continue
                break
            self.block_manager.allocate(request.request_id, total, computed)
            del self.waiting[at]
            if adapter is not None:
                adapters.add(adapter)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            num_admitted += 1
        return num_admitted, budget

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop its blocks (named ones stay cached, so the recompute is
        mostly prefix hits) and put it first in line."""
        self.block_manager.free(request.request_id)
        self.freed_ids.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.on_shards, request.num_sent_blocks = False, 0
        request.num_draft_tokens = request.num_step_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def change_adapter(self, name: str, path: str | None) -> None:
        """Load (`path`) or drop (None) a LoRA adapter on the workers, in order, with the
        next step; a drop waits until no request of that adapter runs or waits."""
        self.adapter_changes.append((name, path))

    def _adapter_changes(self) -> list[tuple[str, str | None]]:
        """The changes the next step may carry: in order, up to a drop still in use."""
        ready = 0
        for name, path in self.adapter_changes:
            if path is None and any(r.params.adapter == name for r in self.requests.values()):
                break
            ready += 1
        changes, self.adapter_changes = (self.adapter_changes[:ready],
                                         self.adapter_changes[ready:])
        return changes

    def _make_step_input(self, scheduled: dict[str, int], drafts: dict[str, list[int]],
                         num_steps: int = 1, drafting: StepDrafting | None = None
                         ) -> tuple[StepInput, list[str]]:
        new, cached, sampling = [], [], []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens + num_new
            # The tokens computed after its next one: drafts, or a multi-step's later steps.
            num_drafts = len(drafts.get(request_id, ())) if num_steps == 1 else num_new - 1
            # Name only blocks whose tokens are known (a placeholder's are not yet).
            self.block_manager.cache_full_blocks(request_id, request.token_ids,
                                                 min(end, request.num_tokens),
                                                 request.params.prefix_namespace)
            block_ids = self.block_manager.get_block_ids(request_id)
            if not request.on_shards:
                new.append(NewRequestData(request_id, list(request.token_ids),
                                          request.num_prompt_tokens, list(block_ids),
                                          request.num_computed_tokens, request.params,
                                          request.seed))
            else:
                cached.append(CachedRequestData(request_id, block_ids[request.num_sent_blocks :],
                                                request.num_computed_tokens))
            request.on_shards = True
            request.num_sent_blocks = len(block_ids)
            # Reaches its end: samples (drafts are checked, and the token after them drawn).
            if end - num_drafts == request.num_tokens + request.num_placeholders:
                request.num_placeholders += 1
                if num_steps == 1:
                    request.num_draft_tokens = num_drafts
                else:
                    request.num_step_tokens = num_new
                sampling.append(request_id)
            request.num_computed_tokens = end
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
        freed, self.freed_ids = self.freed_ids, []
        self.stats.num_steps += 1
        return StepInput(new, cached, dict(scheduled), freed, drafts,
                         self._adapter_changes(), num_steps, drafting), sampling

    # -- results -------------------------------------------------------------------
    def update(self, scheduled: SchedulerOutput, output: StepOutput | None
               ) -> list[tuple[Request, list[int]]]:
        """Append a step's sampled tokens (its placeholders become tokens; a request that
        drafted gets the drafts it kept and one more); finish requests on eos, stop tokens
        or length. Returns each request that got tokens (finished ones included) with the
        output rows it took, in order."""
        for request_id in scheduled.sampling_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.num_placeholders -= 1
        updated: dict[str, tuple[Request, list[int]]] = {}
        for row, request_id in enumerate(output.request_ids if output else ()):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran, or ended at an earlier row
            token_id = output.token_ids[row]
            request.token_ids.append(token_id)
            updated.setdefault(request_id, (request, []))[1].append(row)
            reason = self._check_stop(request, token_id)
            if reason is not None:
                self.finish(request_id, reason)
            elif request.speculation is not None and request.num_placeholders:
                self.lookahead.hold(request, self.running)
        drafts = scheduled.step_input.draft_token_ids
        if drafts and output is not None:
            self.lookahead.settle_drafts(drafts, output, self.requests)
        if scheduled.step_input.num_steps > 1:
            self.lookahead.settle_steps(scheduled.step_input.num_scheduled_tokens, output,
                                        self.requests)
        return list(updated.values())

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if token_id in params.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        if request.num_output_tokens >= params.max_new_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stop, abort or error) and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.on_shards:
            self.freed_ids.append(request_id)
        self.block_manager.free(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if reason is FinishReason.ABORTED:
            self.stats.num_aborted += 1
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORTED)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        holders = set(self.block_manager.block_tables)
        running = {r.request_id for r in self.running}
        if not holders <= running:
            raise AssertionError(f"blocks held by requests not running: {holders - running}")

