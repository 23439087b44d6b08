"""What the ingress and a batcher replica send each other.

A generation is one streamed call, `Batcher.generate(GenerateInput)`: Serve routes it,
counts it as the replica's load, and cancels it when the client leaves. Its outputs come
back either in that call (one message per request per step) or, when the ingress holds an
output channel to the replica (`Batcher.outputs(OpenChannel)`), in the channel: one
message per step for every request of that ingress replica (deployments/channels.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The ingress's channel key: outputs go to its channel if this replica holds one.
    channel: str | None = None


@dataclass(frozen=True, slots=True)
class Routed:
    """First item of a generation sent with a channel key: which replica took it and
    where its outputs go: the channel with this id, or this call (None)."""

    replica_id: str
    channel_id: str | None


@dataclass(frozen=True, slots=True)
class OpenChannel:
    """Asks for an output channel for the ingress replica `key`; `channel_id` names this
    channel. The router sends it to `replica_id` when it can."""

    key: str
    channel_id: str
    replica_id: str | None


@dataclass(frozen=True, slots=True)
class ChannelOpened:
    """First item of a channel: the replica it reached, and whether that replica took it
    (it refuses a second channel with the same key)."""

    replica_id: str
    accepted: bool
