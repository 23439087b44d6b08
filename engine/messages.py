"""What the scheduler sends the shards each step, and what comes back.

A step is a diff: requests the shards have not seen (or lost to preemption) come whole,
the others bring only the blocks added since their last step, and finished or preempted
ids are dropped. Sampled tokens never travel back: the shards append what they sample to
their own copy, so the next step's input does not wait for the batcher (and, with async
scheduling, is scheduled before the batcher knows it). A decode step costs a few ints per
request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class StepDrafting:
    """Prompt lookup inside a multi-step (engine/speculation.py): before each of its steps a
    rank drafts for its requests from their own text. Every rank holds the same tokens, so
    every rank drafts the same rows."""

    speculate: int  # draft tokens a request checks in one step, at most
    max_rows: int  # draft tokens in one step, its requests together
    min_n: int  # prompt_lookup_min
    max_n: int  # prompt_lookup_max


@dataclass(frozen=True, slots=True)
class StepInput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # Batch order: request id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    freed_request_ids: list[str] = field(default_factory=list)
    # Decoding request id -> draft tokens computed after its next token (its scheduled
    # tokens count them): the step keeps those that match what it draws, then one more.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # LoRA adapters to load ((name, path)) or drop ((name, None)), in order, before the
    # step's requests are read: every rank changes its adapters at the same point.
    adapter_changes: list[tuple[str, str | None]] = field(default_factory=list)
    # Above 1, a multi-step: every request decodes, in up to this many steps one after
    # another (its scheduled tokens: the most it may take, one a step), each step fed the tokens
    # the one before it drew. A rank stops a request's steps at its end-of-sequence or stop
    # token, and rank 0 may cut them all short (ModelRunner.cut_short). With `drafting`,
    # a request's scheduled tokens are the most it may take (drafts kept count), and each
    # step may check drafts beside its next token.
    num_steps: int = 1
    drafting: StepDrafting | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True, slots=True)
class PromptScores:
    """One request's prompt tokens scored in a step: the logprob of tokens start + 1 ...,
    each given the tokens before it, and (when asked) the best alternatives there."""

    start: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # one list a token; empty lists when not asked
    ranks: list[int] = field(default_factory=list)  # 1 + the tokens more likely; when asked


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Rank 0's result: one sampled token per request that reached its last token; a
    request that drafted has one row per token it keeps (its kept drafts, then the token
    drawn after them), in order; a multi-step's rows come step after step, each request's
    in order."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    # Per row: (token id, logprob) alternatives, best first; empty when not asked.
    top_logprobs: list[list[tuple[int, float]]]
    # Request id -> its prompt tokens scored this step (those asked for prompt_logprobs).
    prompt_logprobs: dict[str, PromptScores] = field(default_factory=dict)
    # Request id -> why it must end now (its grammar failed); its row is not a token.
    errors: dict[str, str] = field(default_factory=dict)
    # A multi-step with drafting: request id -> (draft tokens checked, of which kept).
    drafted: dict[str, tuple[int, int]] = field(default_factory=dict)
