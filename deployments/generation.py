"""Calling the batcher from the ingress: one streamed generation, collected or relayed.

The ingress cancels the handle's generator whenever it stops reading before the end
(error, client gone, a sibling `best_of` sequence failed): otherwise the batcher would go
on generating for nobody."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deployments.channels import OutputChannels
from deployments.protocol import GenerateInput
from engine.outputs import RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams


class GenerationError(RuntimeError):
    """The model failed this request (TGI answers 424 `generation`)."""


class ReplicaUnavailable(GenerationError):
    """The batcher replica serving this request went away (answered 503)."""


@dataclass(slots=True)
class Generation:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    queue_time: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    start: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    # Per output that brought tokens: how many of them were drafts kept (speculation).
    skipped_tokens: list[int] = field(default_factory=list)
    end: float | None = None

    def add(self, output: RequestOutput) -> None:
        if output.error is not None:
            raise GenerationError(output.error)
        if output.token_ids:
            now = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = now
                gaps = len(output.token_ids) - 1  # tokens that came with the first
            else:
                gaps = len(output.token_ids)
            if gaps and self.last_token_time is not None:
                # Tokens arrive grouped per step: spread the wait over them.
                self.inter_token_latencies += [(now - self.last_token_time) / gaps] * gaps
            self.last_token_time = now
            self.skipped_tokens.append(output.accepted_drafts)
        self.token_ids += output.token_ids
        self.token_texts += output.token_texts
        self.logprobs += output.logprobs
        self.top_logprobs += output.top_logprobs
        self.text += output.text
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
            self.prompt_top_logprobs = output.prompt_top_logprobs
            self.prompt_ranks = output.prompt_ranks
        if output.queue_time is not None:
            self.queue_time = output.queue_time
            self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.end = time.monotonic()
            if output.finish_reason is FinishReason.ABORTED:
                raise GenerationError("request aborted")
            if not self.token_ids:
                raise GenerationError("generation ended without producing a token")

    @property
    def sum_logprob(self) -> float:
        return sum(self.logprobs)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def inference_time(self) -> float:
        return max(0.0, (self.end or time.monotonic()) - self.start - self.queue_time)


def new_request_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


def reseeded(params: SamplingParams) -> SamplingParams:
    """The same request with a fresh seed: one more independent sample (best_of)."""
    return dataclasses.replace(params, seed=random.getrandbits(63))


async def stream(batcher, generation: Generation) -> AsyncIterator[RequestOutput]:
    """Relay the batcher's outputs, adding each to `generation` (which raises on error).
    `batcher` is a streaming handle or this ingress's OutputChannels."""
    request = GenerateInput(generation.request_id, generation.prompt_token_ids, generation.params)
    via_channels = isinstance(batcher, OutputChannels)
    responses = batcher.generate(request) if via_channels else batcher.generate.remote(request)
    finished = False
    try:
        try:
            async for output in responses:
                generation.add(output)
                finished = output.finished
                yield output
                if finished:
                    return
        except (GenerationError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # the replica died or Serve refused the call
            raise ReplicaUnavailable(f"batcher unavailable: {type(exc).__name__}: "
                                     f"{str(exc)[:300]}") from exc
        raise GenerationError("the batcher closed the stream early")
    finally:
        if via_channels:
            await responses.aclose()  # cancels the call unless it ended
        elif not finished:
            responses.cancel()


async def collect(batcher, generation: Generation) -> Generation:
    async for _ in stream(batcher, generation):
        pass
    return generation


async def collect_all(batcher, generations: list[Generation]) -> None:
    """Run several generations (best_of, n) at once; one failing cancels the others."""
    tasks = [asyncio.ensure_future(collect(batcher, g)) for g in generations]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
