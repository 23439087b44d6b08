"""TGI's HTTP API: request schema, validation (TGI's rules, order and messages), and the
JSON shapes its clients parse (`text-generation`, huggingface_hub)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments import grammar
from deployments.config import Limits
from engine.sampling_params import SamplingParams

DEFAULT_GENERATION_LENGTH = 1024  # TGI's default max_new_tokens cap when unset


class ValidationError(ValueError):
    """A request TGI would refuse with 422 and this message."""


# Sampling fields of vLLM's and OpenAI's APIs that TGI's parameters lack and that would
# change the output: refused on TGI's routes unless at their neutral value (TGI itself drops
# unknown fields; a client sending one of these expects it honoured). Other unknown fields
# are dropped, as TGI drops them.
NOT_TGI: dict[str, tuple] = {  # name: the values (besides null) that change nothing
    "ignore_eos": (False,), "min_tokens": (0,), "min_p": (0, 0.0), "presence_penalty": (0, 0.0),
    "logit_bias": ({},), "n": (1,), "max_tokens": (), "stop_token_ids": ([],),
    "bad_words": ([],), "logprobs": (False,), "top_logprobs": (0,),
    "skip_special_tokens": (True,), "include_stop_str_in_output": (False,),
    "use_beam_search": (False,),
}
NOT_TGI_USE = {"max_tokens": "max_new_tokens", "n": "best_of", "logprobs": "details",
               "top_logprobs": "top_n_tokens"}


class TGIParameters(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields kept: _check_parameters reads them

    best_of: int | None = Field(None, ge=0)
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=0)
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = Field(None, ge=0)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(None, ge=0, lt=2**64)
    top_n_tokens: int | None = Field(None, ge=0)
    grammar: Any = None
    adapter_id: str | None = None


class TGIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class ValidRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    best_of: int
    sampling: bool


def validate(request: TGIRequest, tokenizer: Any, limits: Limits, stream: bool) -> ValidRequest:
    """TGI's validation, its rules in its order and its messages: the parameters, then the
    tokenized input against the token limits; a ValidationError names the first broken."""
    p = request.parameters
    best_of, grammar_text = _check_parameters(request, limits, stream)
    ids, max_new_tokens = _tokenize(request, tokenizer, limits)
    # As TGI's server: sample when asked to, or when any warper changes the distribution.
    temperature = 1.0 if p.temperature is None else p.temperature
    sampling = p.do_sample or temperature != 1.0 or bool(p.top_k) or (p.top_p or 1.0) < 1.0 \
        or (p.typical_p or 1.0) < 1.0
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature if sampling else 0.0,
        top_k=p.top_k or 0,
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=0.0 if p.frequency_penalty is None else p.frequency_penalty,
        seed=p.seed if p.seed is not None else random.getrandbits(63),
        stop=tuple(p.stop),
        include_stop_str_in_output=True,  # TGI's generated_text keeps the stop sequence
        top_n_tokens=p.top_n_tokens or 0,
        prompt_logprobs=p.decoder_input_details,
        grammar=grammar_text,
        adapter=limits.adapters[p.adapter_id][0] if p.adapter_id else None,  # its id
        watermark=p.watermark,
        # A token's logprob where the response shows it (every streamed token, `details`)
        # or best_of ranks by it; a plain /generate answer is its text alone.
        logprobs=stream or p.details or p.decoder_input_details or best_of > 1,
    )
    return ValidRequest(ids, params, best_of, sampling)


def _check_parameters(request: TGIRequest, limits: Limits, stream: bool
                      ) -> tuple[int, str | None]:
    """The rules that need no tokenizer; returns `best_of` and the grammar's text."""
    p = request.parameters
    for name, value in (p.model_extra or {}).items():
        if name in NOT_TGI and value is not None \
                and not any(type(value) is type(v) and value == v for v in NOT_TGI[name]):
            use = f"; TGI's is `{NOT_TGI_USE[name]}`" if name in NOT_TGI_USE else ""
            raise ValidationError(f"`{name}` is not a TGI parameter{use} (the OpenAI routes "
                                  "take vLLM's sampling fields)")
    best_of = 1 if p.best_of is None else p.best_of
    if best_of != 1:
        if limits.max_best_of == 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if best_of == 0 or best_of > limits.max_best_of:
            raise ValidationError(
                f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
        if stream:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise ValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens")
    has_warpers = any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if best_of > 1 and not (p.do_sample or has_warpers):
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    if p.max_new_tokens == 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(p.stop)}")
    if p.seed is not None and best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    top_n_tokens = p.top_n_tokens or 0
    if top_n_tokens > limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                              f"Given: {top_n_tokens}")
    if not request.inputs:
        raise ValidationError("`inputs` cannot be empty")
    if p.truncate is not None and (p.truncate == 0 or p.truncate > limits.max_input_tokens):
        raise ValidationError("`truncate` must be strictly positive and less than "
                              f"{limits.max_input_tokens}. Given: {p.truncate}")
    if p.adapter_id and p.adapter_id not in limits.adapters:
        served = f"the adapters {', '.join(limits.adapters)}" if limits.adapters \
            else "no LoRA adapters (lora_adapters, POST /v1/load_lora_adapter)"
        raise ValidationError(f"`adapter_id` {p.adapter_id} is not loaded: this server "
                              f"serves {served}")
    grammar_text = _grammar(p.grammar) if p.grammar is not None else None
    if any(not s for s in p.stop):
        raise ValidationError("`stop` sequences cannot be empty")
    return best_of, grammar_text


def _tokenize(request: TGIRequest, tokenizer: Any, limits: Limits) -> tuple[list[int], int]:
    """The prompt's ids (truncated as asked) and `max_new_tokens` (TGI's default where
    unset), checked against the token limits."""
    p = request.parameters
    ids = tokenizer(request.inputs, add_special_tokens=request.add_special_tokens).input_ids
    if p.truncate is not None:
        ids = ids[-p.truncate :]
    input_length = len(ids)
    max_new_tokens = p.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = min(max(limits.max_total_tokens - input_length, 1),
                             DEFAULT_GENERATION_LENGTH)
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= "
                              f"{limits.max_total_tokens}. "
                              f"Given: {input_length} `inputs` tokens and {max_new_tokens} "
                              "`max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} tokens. "
                              f"Given: {input_length}")
    return ids, max_new_tokens


def _grammar(value: Any) -> str:
    """TGI's `parameters.grammar`: {"type": "json" (alias "json_object"), "value": a JSON
    schema, as an object or its text}, {"type": "json_schema", "value": {"name": ...,
    "schema": a JSON schema}} or {"type": "regex", "value": a pattern}."""
    if not isinstance(value, dict) or "type" not in value or "value" not in value:
        raise ValidationError("`grammar` must be an object with `type` and `value`")
    try:
        if value["type"] in ("json", "json_object"):
            return grammar.json_schema(value["value"])
        if value["type"] == "json_schema":
            config = value["value"]
            if not isinstance(config, dict) or "schema" not in config:
                raise grammar.InvalidGrammar("a json_schema grammar's value needs `schema`")
            return grammar.json_schema(config["schema"])
        if value["type"] == "regex":
            return grammar.regex(value["value"])
    except grammar.InvalidGrammar as exc:
        raise ValidationError(f"Invalid grammar: {exc}") from exc
    raise ValidationError(f"unknown grammar type {value['type']!r}: use \"json\", "
                          "\"json_schema\" or \"regex\"")


def finite(logprob: float | None) -> float | None:
    """A logprob as TGI's JSON writes it: a token a grammar or a rule masks has -inf, which
    JSON cannot carry, and TGI's serializer writes null."""
    return logprob if logprob is not None and math.isfinite(logprob) else None


def token_json(token_id: int, text: str, logprob: float | None, special: bool) -> dict:
    return {"id": token_id, "text": text, "logprob": finite(logprob), "special": special}


def error_json(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}
