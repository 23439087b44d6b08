"""Engine configuration: frozen, derived once from builder arguments, split per component."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16  # KV slots per block; the shards' cache uses the same


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    # None until the shards have measured memory at warmup (ShardGroup.warmup).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """TGI v3's batching knobs, same names and meaning."""

    max_batch_prefill_tokens: int = 4096
    # None: every KV slot the cache holds (num_blocks * block_size).
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    # With a running batch, admit waiting requests only when at least
    # floor(running * waiting_served_ratio) of them wait ...
    waiting_served_ratio: float | None = None
    # ... or when they have waited this many decode steps. None (both): TGI v3's policy,
    # which is to admit at every step with chunked prefill (TGI ignores both knobs then:
    # new prompts ride along in the running batch's step) and 0.3 / 20 without it. Set,
    # they hold in either mode.
    max_waiting_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_model_len: int = 4096
    # Prompt lookup (TGI's --speculate; vLLM's prompt_lookup_min / _max): up to `speculate`
    # draft tokens per decoding request, found by matching its last n tokens.
    speculate: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Drafts fill a step up to this many rows, the running requests' own rows included
    # (benchmarks/NOTES.md 60): none at all from this many running requests up.
    speculate_max_rows: int = 16
    # Multi-step decoding (vLLM's num_scheduler_steps): while every running request decodes
    # and none waits to join, one message to the shards runs up to this many decode steps,
    # each fed the tokens the one before it drew, and their tokens come back together. The
    # serving plane's cost per message (Ray's call, the batcher's bookkeeping, a stream
    # item to the ingress and the client) is paid once for them all. A request that
    # arrives meanwhile cuts the steps short (AsyncEngine's `interrupt`).
    num_scheduler_steps: int = 4
    # LoRA: the most adapters whose requests run in one step (vLLM's max_loras); a
    # request of another adapter waits until one of them has no request left running.
    max_loras: int = 4
    # LoRA: adapters added at run time that a replica keeps loaded (vLLM's max_cpu_loras;
    # None: all); past it the least recently used idle one is dropped, and loaded again
    # when a request names it.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_prefill_tokens <= 0:
            raise ValueError("max_batch_prefill_tokens must be positive")
        if self.max_batch_size is not None and self.max_batch_size <= 0:
            raise ValueError("max_batch_size must be positive")
        if (self.waiting_served_ratio or 0) < 0 or (self.max_waiting_tokens or 0) < 0:
            raise ValueError("waiting_served_ratio and max_waiting_tokens must be >= 0")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be >= 1")
        if self.speculate < 0:
            raise ValueError("speculate must be >= 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")

    @property
    def admission(self) -> tuple[float, int]:
        """The (waiting_served_ratio, max_waiting_tokens) in effect; (0, 0) admits at
        every step."""
        chunked_default = self.enable_chunked_prefill and self.waiting_served_ratio is None \
            and self.max_waiting_tokens is None
        if chunked_default:
            return 0.0, 0
        ratio = 0.3 if self.waiting_served_ratio is None else self.waiting_served_ratio
        return ratio, 20 if self.max_waiting_tokens is None else self.max_waiting_tokens
