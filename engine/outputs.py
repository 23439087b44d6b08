"""What the engine hands back for each request after each step: a delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import FinishReason


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # new since the last output
    token_texts: list[str] = field(default_factory=list)  # incremental text per token
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # new text, stop strings trimmed and held back while streaming
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Set once, on the output that completes the prompt: logprob of each prompt token
    # given the ones before it (None for the first).
    prompt_logprobs: list[float | None] | None = None
    # With it, when asked (prompt_top_n_tokens): the best alternatives at each prompt
    # token, best first (None for the first token).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # and the tokens' ranks (prompt_ranks)
    # Set once, on the first output: seconds from arrival to first scheduled.
    queue_time: float | None = None
    # Of token_ids, how many were speculation's drafts, checked and kept (the rest are the
    # request's own: one a step).
    accepted_drafts: int = 0
    # On the last output, as vLLM's stop_reason: the stop string or stop token id that
    # ended the output (None for EOS, length, abort).
    stop_reason: str | int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """A whole generation, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None
    prompt_ranks: list[int | None] | None
    num_cached_tokens: int
    stop_reason: str | int | None = None  # as RequestOutput's

    @classmethod
    def collect(cls, prompt_token_ids: list[int], outputs: list[RequestOutput]) -> CompletionOutput:
        first, last = outputs[0], outputs[-1]
        if last.error is not None:
            raise RuntimeError(f"request {first.request_id} failed: {last.error}")
        return cls(
            request_id=first.request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=[t for o in outputs for t in o.token_ids],
            text="".join(o.text for o in outputs),
            finish_reason=last.finish_reason,
            logprobs=[lp for o in outputs for lp in o.logprobs],
            top_logprobs=[tl for o in outputs for tl in o.top_logprobs],
            prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None),
            prompt_top_logprobs=next((o.prompt_top_logprobs for o in outputs
                                      if o.prompt_top_logprobs), None),
            prompt_ranks=next((o.prompt_ranks for o in outputs if o.prompt_ranks), None),
            num_cached_tokens=first.num_cached_tokens,
            stop_reason=last.stop_reason,
        )
