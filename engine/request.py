"""Request state and the parameters a client controls."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.speculation import SpeculationState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    # TGI's names.
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORTED = "aborted"
    ERROR = "error"


@dataclass(slots=True)
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens`; there is no
    prefill or decode phase: a request with many uncomputed tokens is prefilling."""

    request_id: str
    token_ids: list[int]  # prompt then output, one list so appends are cheap
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Whether the shards hold this request (they keep the tokens they sample, so only
    # new blocks go to them after the first step), and how many of its blocks; reset
    # when preempted.
    on_shards: bool = False
    num_sent_blocks: int = 0
    # Tokens being sampled by steps in flight, not yet known here. With async scheduling
    # the next step computes them anyway: the shards feed their own samples in.
    num_placeholders: int = 0
    # Drafts computed by the step in flight (speculation: its n-gram index and record).
    num_draft_tokens: int = 0
    speculation: SpeculationState | None = None
    # Tokens the multi-step in flight computes (num_scheduler_steps; 0: none): until it
    # returns the request is not scheduled again, since a request that arrives may cut it
    # short, which leaves its next position unknown until then.
    num_step_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
