"""What a client may ask of one generation, checked once at the edge of the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    # vLLM's: no end-of-sequence token, stop token or stop string ends the output before
    # it has this many tokens.
    min_tokens: int = 0
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0  # drop tokens under min_p x the top token's probability; 0: off
    repetition_penalty: float = 1.0  # HF/TGI: divides positive logits of seen tokens
    frequency_penalty: float = 0.0  # OpenAI: per occurrence in the output
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    top_n_tokens: int = 0  # alternatives returned with each token's logprob
    # Whether each drawn token's logprob is wanted (TGI's streams and `details` show one
    # with every token, OpenAI only with `logprobs`). Without, a plain greedy row may skip
    # the full vocabulary's logits (shards/cpu/greedy_screen.py) and its logprobs are NaN.
    logprobs: bool = True
    prompt_logprobs: bool = False
    prompt_top_n_tokens: int = 0  # alternatives returned with each prompt token's logprob
    prompt_ranks: bool = False  # and each prompt token's rank in the vocabulary (1: the best)
    skip_special_tokens: bool = True
    # An llguidance grammar (JSON or Lark text, as `LLMatcher.grammar_from_*` make them):
    # each token is drawn from what it allows, and EOS only where it accepts.
    grammar: str | None = None
    # The LoRA adapter to generate with (a name the server loaded), None for the base model.
    adapter: str | None = None
    # OpenAI's logit_bias: (token id, value in [-100, 100]) pairs added to the logits first.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's allowed_token_ids: only these tokens may be drawn (empty: any).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words, as token id sequences: a sequence's last token is never drawn where
    # the output so far ends with the tokens before it (a one-token sequence: never).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # TGI's watermark (Kirchenbauer et al. 2023, arXiv 2301.10226): before each token, a
    # green half of the vocabulary, drawn from the previous token, gets +2 on its logits.
    watermark: bool = False
    # vLLM's cache_salt: a prompt's cached KV blocks are shared only with requests that
    # carry the same salt (tenants that must not time each other's prompts).
    cache_salt: str | None = None

    @property
    def prefix_namespace(self) -> str | None:
        """Whose cached prefix blocks a request may share: those of its LoRA adapter (the KV
        differs per adapter) and, with a cache_salt, of that salt only."""
        if self.cache_salt is None:
            return self.adapter
        return f"{self.adapter or ''}\0{self.cache_salt}"

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (0 <= self.min_tokens <= self.max_new_tokens,
             "min_tokens must be between 0 and max_new_tokens"),
            (not (self.grammar and self.min_tokens),
             "min_tokens cannot be used with a grammar (it decides where the output ends)"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 < self.typical_p <= 1, "typical_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.top_n_tokens >= 0, "top_n_tokens must be >= 0"),
            (self.prompt_top_n_tokens >= 0, "prompt_top_n_tokens must be >= 0"),
            (self.prompt_logprobs or not (self.prompt_top_n_tokens or self.prompt_ranks),
             "prompt_top_n_tokens and prompt_ranks need prompt_logprobs"),
            (all(self.stop), "stop sequences must not be empty"),
            (not (self.grammar and self.ignore_eos), "ignore_eos cannot be used with a grammar"),
            (all(t >= 0 and math.isfinite(v) and -100 <= v <= 100 for t, v in self.logit_bias),
             "logit_bias maps token ids to values in [-100, 100]"),
            (all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids must be token ids"),
            (all(w and min(w) >= 0 for w in self.bad_words),
             "bad_words must be non-empty sequences of token ids"),
            (self.cache_salt is None or self.cache_salt != "", "cache_salt must not be empty"),
            (not (self.grammar and (self.allowed_token_ids or self.bad_words)),
             "allowed_token_ids and bad_words cannot be used with a grammar (it decides what "
             "may be drawn)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy, with nothing that reads or changes the logits but the argmax: no
        logprobs or alternatives asked for, no bias, masks, penalties, watermark or grammar
        (min_tokens' hold on the end tokens is the caller's to check: it depends on the
        position)."""
        return (self.temperature == 0.0 and not self.logprobs and not self.top_n_tokens
                and not self.logit_bias and not self.allowed_token_ids and not self.bad_words
                and not self.watermark and self.grammar is None and not self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
