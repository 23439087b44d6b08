"""What the ingress sends a batcher replica for one generation."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
