"""OpenAI's request schemas (completions, chat completions) and their checks, turned into
the engine's sampling parameters. Refusals are 400s in OpenAI's words."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field

from deployments import grammar
from deployments.admission import ApiError
from deployments.config import Limits
from engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@functools.lru_cache(maxsize=8)
def vocab_size(tok) -> int:
    """`len(tok)`, the vocabulary with its added tokens, asked once per tokenizer: a fast
    tokenizer copies its whole vocabulary to count it, 1 ms alone and 10-15 ms of an
    ingress's CPU under load (py-spy, benchmarks/NOTES.md 97)."""
    return len(tok)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `{"type": "json_schema", "json_schema": {...}}` and `{"type": "json_object"}`,
    or TGI's grammar shape, which huggingface_hub's `InferenceClient` sends:
    `{"type": "json" (alias "json_object") | "regex" | "json_schema", "value": ...}`."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: Any = None  # TGI's


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint of `json` (a
    schema), `regex`, `choice`, `grammar` (GBNF or Lark) or `json_object`. Its options:
    raygen's JSON is compact and lists only a schema's properties whichever way
    `disable_any_whitespace` and `disable_additional_properties` are set (the server's
    choice, as for `response_format`), and it has no fallback for `disable_fallback` to
    turn off; `whitespace_pattern` and `structural_tag` are refused."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None


# Fields of OpenAI's API or vLLM's extensions that would change the output and that this
# server does not implement: refused unless at their neutral value, never ignored.
# (Other unknown fields, e.g. `user`, `metadata`, `store`, change nothing and are ignored,
# as OpenAI-compatible servers do.)
_OFF = (None, False, "", {}, [])
UNSUPPORTED: dict[str, tuple[tuple, str]] = {  # name: (values that change nothing, refusal)
    "suffix": (_OFF, "suffix is not supported"),
    "echo": (_OFF, "echo is not supported on chat completions"),
    "best_of": ((None, 1), "best_of is not supported on /v1/completions; use n, or TGI's best_of"),
    "use_beam_search": (_OFF, "beam search is not supported"),
    "length_penalty": ((None, 1), "length_penalty is not supported (no beam search)"),
    "functions": (_OFF, "functions is not supported; use tools"),
    "function_call": (_OFF, "function_call is not supported; use tool_choice"),
    "prediction": (_OFF, "prediction is not supported"),
    "audio": (_OFF, "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported (modalities: [\"text\"])"),
    # vLLM's extensions beyond those _Common honours, and TGI's tool_prompt
    "logits_processors": (_OFF, "logits_processors is not supported"),
    "spaces_between_special_tokens": ((None, True),
                                      "spaces_between_special_tokens=false is not supported"),
    "chat_template": ((None,), "chat_template is not supported: the tokenizer's is used"),
    "documents": (_OFF, "documents is not supported"),
    "guided_whitespace_pattern": (_OFF, "guided_whitespace_pattern is not supported"),
    "guided_decoding_backend": (_OFF, "guided_decoding_backend is not supported: remove it "
                                      "(vLLM's own advice since 0.12)"),
    "tool_prompt": (_OFF, "tool_prompt is not supported: the tools go to the chat template"),
    # vLLM refuses it too unless started with priority scheduling
    "priority": ((None, 0), "priority is not supported: requests are served first come, "
                            "first served (priority must be 0)"),
    "logprob_token_ids": ((None,), "logprob_token_ids is not supported; use top_logprobs"),
    "watermarking": ((None, False), "watermarking is not supported on the OpenAI routes "
                                    "(TGI's watermark is, on /generate)"),
}


def _same(value: Any, neutral: Any) -> bool:
    """Equal, without True == 1 or 0 == False; 1 == 1.0."""
    if value is None or neutral is None or isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_unsupported(req: BaseModel) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED:
            neutral, message = UNSUPPORTED[name]
            if not any(_same(value, n) for n in neutral):
                raise bad(message)


class _Common(BaseModel):
    # Extra fields are kept (model_extra) so that `refuse_unsupported` can see them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # vLLM's extension: exact output lengths for benchmarks
    min_tokens: int = 0  # vLLM's: nothing ends the output before it has this many tokens
    # vLLM's: each prompt token's logprob and rank, with this many alternatives
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last this many tokens (-1: as many as the server takes),
    # or its first with truncation_side "right"
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: cached prompt blocks are shared only among requests with the same salt
    cache_salt: str | None = None
    # vLLM's: the response's id after its prefix (else the X-Request-Id header's)
    request_id: str | None = None
    # vLLM's: logprobs name each token "token_id:ID" instead of by its text
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's and the output's token ids beside the text (RL trainers read them)
    return_token_ids: bool = False
    # vLLM's: only these tokens may be drawn; these words may not be written
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0: off
    min_p: float = 0.0  # vLLM's extension; 0: off
    repetition_penalty: float | None = None  # vLLM's extension (HF's); 1: off
    logit_bias: dict[str, float] | None = None  # token id (as text) -> added to its logit
    stop_token_ids: list[int] | None = None  # vLLM's: these tokens end the output too
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string in the text
    skip_special_tokens: bool = True  # vLLM's: False writes special tokens into the text
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's names for the same before 0.12 (clients written for them still send them)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    # The prompt before each completion; with logprobs, the prompt tokens' logprobs too
    # (each given the tokens before it), as lm-evaluation-harness scores choices.
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"  # huggingface_hub's InferenceClient leaves it out
    function: FunctionName


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none", "auto", "required", a function by object, or (TGI's) by its bare name
    tool_choice: NamedToolChoice | str | None = None
    parallel_tool_calls: bool | None = None  # each choice makes at most one call
    # vLLM's, passed to the chat template: an assistant's turn opened after the messages
    # (or not), the last (assistant) message continued instead, the template's own options
    # (Qwen3's enable_thinking, say)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text; its parts joined. A part that is not text (an image, audio, a file)
    is refused: the models served here read text only, and dropping the part would answer
    a question the client did not ask."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise bad(f"content parts of type {kind!r} are not supported: this model takes "
                      "text only (parts of type 'text')")
        if not isinstance(part.get("text"), str):
            raise bad("a content part of type 'text' needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


class CompletionTokenize(BaseModel):
    """vLLM's `POST /tokenize` body for a prompt."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenize(ChatRequest):
    """vLLM's `POST /tokenize` body for a chat: the chat request's template fields."""
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    return_token_strs: bool = False


class Detokenize(BaseModel):
    """vLLM's `POST /detokenize` body."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def chat_text(tok: Any, req: ChatRequest) -> str:
    """The chat's messages (and tools) through the model's chat template."""
    messages = [{"role": m.role, "content": _content_text(m.content),
                 **m.model_dump(include={"name", "tool_calls", "tool_call_id"},
                                exclude_none=True)} for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if req.continue_final_message and (req.add_generation_prompt
                                       or req.messages[-1].role != "assistant"):
        raise bad("continue_final_message needs add_generation_prompt=false and an "
                  "assistant's message last")
    options = dict(req.chat_template_kwargs or {})
    # the template's own variables only: not apply_chat_template's arguments (a
    # template of the request's own, tokenizing, ...)
    taken = options.keys() & (set(inspect.signature(tok.apply_chat_template).parameters)
                              | {"messages"})
    if taken:
        raise bad(f"chat_template_kwargs must not set {', '.join(sorted(taken))}")
    try:
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **options)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:  # the template's own
        raise bad(f"the chat template failed: {exc}") from exc  # refusal, say
    return text


def prompts(tok: Any, req: CompletionRequest | ChatRequest, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids (chat: one, through the model's chat template)."""
    if chat:
        return [tok(chat_text(tok, req), add_special_tokens=False).input_ids]
    prompt = req.prompt
    if prompt == "" or (isinstance(prompt, list) and any(p == "" for p in prompt)):
        raise bad("prompt must not be empty")
    if isinstance(prompt, str):
        prompts = [tok(prompt).input_ids]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(p) for p in prompt]
    else:
        prompts = [tok(p).input_ids for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise bad("prompt must not be empty")
    if not isinstance(prompt, str) and isinstance(prompt[0], (int, list)):
        # Only ids the client sent can fall outside the vocabulary; text tokenizes into it.
        vocab = vocab_size(tok)
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise bad(f"prompt token ids must be in [0, {vocab})")
    return prompts


def params(limits: Limits, max_n: int, req: CompletionRequest | ChatRequest, chat: bool,
           num_prompt_tokens: int) -> SamplingParams:
    """OpenAI's sampling fields, checked against the server's limits."""
    refuse_unsupported(req)
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    repetition_penalty = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    top_p = 1.0 if req.top_p is None else req.top_p
    checks = [
        (0 <= temperature <= 2, "temperature must be between 0 and 2"),
        (0 < top_p <= 1, "top_p must be in (0, 1]"),
        (1 <= req.n <= max_n, f"n must be between 1 and {max_n}"),
        (-2 <= req.presence_penalty <= 2, "presence_penalty must be between -2 and 2"),
        (-2 <= req.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2"),
        (top_k >= 0, "top_k must be -1 (off) or positive"),
        (0 <= req.min_p <= 1, "min_p must be in [0, 1]"),
        (repetition_penalty > 0, "repetition_penalty must be > 0 (1: off)"),
    ]
    for ok, message in checks:
        if not ok:
            raise bad(message)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_sequences or any(not s for s in stop):
        raise bad(f"stop must be up to {limits.max_stop_sequences} non-empty strings")
    stop_token_ids = tuple(req.stop_token_ids or ())
    if any(t < 0 for t in stop_token_ids):
        raise bad("stop_token_ids must be token ids (>= 0)")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise bad(f"logit_bias keys must be token ids; got {key!r}")
        if not -100 <= value <= 100:
            raise bad(f"logit_bias values must be between -100 and 100; got {value}")
        bias[int(key)] = value
    if chat:
        if (req.top_logprobs or 0) > 0 and not req.logprobs:
            raise bad("top_logprobs needs logprobs set to true")
        top_n, field = (req.top_logprobs or 0) if req.logprobs else 0, "top_logprobs"
    else:
        top_n, field = req.logprobs or 0, "logprobs"
    if not 0 <= top_n <= limits.max_top_n_tokens:
        raise bad(f"{field} must be between 0 and {limits.max_top_n_tokens}")
    score_prompt = not chat and req.echo and req.logprobs is not None
    ranked = req.prompt_logprobs is not None
    if ranked and not 0 <= req.prompt_logprobs <= limits.max_top_n_tokens:
        raise bad(f"prompt_logprobs must be between 0 and {limits.max_top_n_tokens}")
    if ranked and req.stream:
        raise bad("prompt_logprobs is not available when streaming")
    if num_prompt_tokens > limits.max_input_tokens:
        raise bad(f"This model's maximum input length is {limits.max_input_tokens} tokens; "
                         f"the prompt has {num_prompt_tokens}")
    room = limits.max_total_tokens - num_prompt_tokens
    field, max_tokens = "max_tokens", req.max_tokens
    if chat and req.max_completion_tokens is not None:  # OpenAI's newer name wins
        field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        max_tokens = min(room, 1024) if chat else min(room, DEFAULT_MAX_TOKENS)
    if prompt_only(req, chat):  # one token is drawn (the prompt's last step) and not returned
        max_tokens = 1
    if max_tokens < 1:
        raise bad(f"{field} must be at least 1, got {max_tokens}")
    if not 0 <= req.min_tokens <= max_tokens:
        raise bad(f"min_tokens must be between 0 and {field} ({max_tokens}), "
                  f"got {req.min_tokens}")
    if max_tokens > room:
        raise bad(f"This model's maximum context length is {limits.max_total_tokens} tokens. "
                         f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                         f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion).")
    if req.cache_salt == "":
        raise bad("cache_salt must be a non-empty string")
    return SamplingParams(
        max_new_tokens=max_tokens, min_tokens=req.min_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=req.min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, stop=tuple(stop), top_n_tokens=top_n, ignore_eos=req.ignore_eos,
        stop_token_ids=stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logit_bias=tuple(sorted(bias.items())),
        prompt_logprobs=score_prompt or ranked, prompt_ranks=ranked,
        prompt_top_n_tokens=max(top_n if score_prompt else 0, req.prompt_logprobs or 0),
        cache_salt=req.cache_salt,
        # A token's logprob only where the response shows it.
        logprobs=bool(req.logprobs) if chat else req.logprobs is not None)


def prompt_only(req: CompletionRequest | ChatRequest, chat: bool) -> bool:
    """`echo` with `max_tokens: 0`: the prompt (and its logprobs) with no completion, the
    request OpenAI's older scoring clients send."""
    return not chat and req.echo and req.max_tokens == 0


def truncated(limits: Limits, req: CompletionRequest | ChatRequest,
              prompt_ids: list[int]) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens, as TGI's `truncate`
    keeps them (its first with `truncation_side: "right"`); -1 keeps as many as the server
    takes (`max_input_tokens`)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if k == -1:
        k = limits.max_input_tokens
    if not 1 <= k <= limits.max_input_tokens:
        raise bad(f"truncate_prompt_tokens must be -1 or between 1 and "
                  f"{limits.max_input_tokens} (max_input_tokens)")
    return prompt_ids[:k] if req.truncation_side == "right" else prompt_ids[-k:]


def prompt_texts(req: CompletionRequest) -> list[str | None]:
    """Per prompt of `prompts`, the text the client sent (None where it sent token ids)."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    return [p if isinstance(p, str) else None
            for p in (req.prompt if req.prompt and not isinstance(req.prompt[0], int)
                      else [req.prompt])]


def check_token_ids(tok: Any, params: SamplingParams,
                    eos_token_ids: frozenset[int] = frozenset()) -> None:
    """Token ids a client named (logit_bias, stop_token_ids, allowed_token_ids) must be in
    the vocabulary: an id past the logits' width would fail the step of every request in
    it. allowed_token_ids with min_tokens must leave a token that does not end the output,
    or the first token would have nothing left to be drawn from."""
    named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids) + \
        list(params.allowed_token_ids)
    if named:
        vocab = vocab_size(tok)
        if any(t >= vocab for t in named):
            raise bad("logit_bias, stop_token_ids and allowed_token_ids must name token ids "
                      f"in [0, {vocab})")
    if params.allowed_token_ids and params.min_tokens:
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        if ends.issuperset(params.allowed_token_ids):
            raise bad(f"min_tokens ({params.min_tokens}) needs a token in allowed_token_ids "
                      "that does not end the output; every one is a stop or end-of-sequence "
                      "token")


def vocabulary_rules(tok: Any, req: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """vLLM's allowed_token_ids and bad_words, as sampling parameters. A bad word is banned
    as its tokens at the start of a text and, where a space before it makes it a word token
    of its own (the same count, another first token), after a space: vLLM's rule."""
    rules: dict[str, Any] = {}
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids or min(req.allowed_token_ids) < 0:
            raise bad("allowed_token_ids must be a non-empty list of token ids")
        rules["allowed_token_ids"] = tuple(sorted(set(req.allowed_token_ids)))
    words: list[tuple[int, ...]] = []
    for word in req.bad_words or ():
        if not word.strip():
            raise bad("bad_words must be non-empty strings")
        plain = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
        words.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            words.append(spaced)
    if words:
        rules["bad_words"] = tuple(dict.fromkeys(words))
        banned = {w[0] for w in words if len(w) == 1}  # never drawn, wherever they fall
        if rules.get("allowed_token_ids") and banned.issuperset(rules["allowed_token_ids"]):
            raise bad("bad_words bans every token of allowed_token_ids")
    return rules


# vLLM's constraint kinds, each made a grammar from its value
_STRUCTURED = {"json": grammar.json_schema, "regex": grammar.regex, "choice": grammar.choice,
               "grammar": grammar.context_free,
               "json_object": lambda _: grammar.json_schema({"type": "object"})}


def output_constraints(req: CompletionRequest | ChatRequest) -> dict[str, tuple[str, Any]]:
    """Each field of the request that constrains the output: its name -> (its kind in
    vLLM's words, its value). `response_format` counts as one unless of type text."""
    found: dict[str, tuple[str, Any]] = {}
    if req.response_format is not None and req.response_format.type != "text":
        found["response_format"] = ("response_format", req.response_format)
    so = req.structured_outputs
    if so is not None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(so, name) is not None:
                raise bad(f"structured_outputs.{name} is not supported")
        for kind in _STRUCTURED:
            value = so.json_ if kind == "json" else getattr(so, kind)
            if value is not None and value is not False:
                found[f"structured_outputs.{kind}"] = (kind, value)
        if not any(name.startswith("structured_outputs.") for name in found):
            raise bad("structured_outputs needs one of json, regex, choice, grammar or "
                      "json_object")
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found[f"guided_{kind}"] = (kind, value)
    return found


def response_grammar(req: CompletionRequest | ChatRequest) -> str | None:
    """The grammar that `response_format`, vLLM's `structured_outputs` or its older
    `guided_*` fields ask for (None: free text); more than one of them is refused."""
    constraints = output_constraints(req)
    if len(constraints) > 1:
        raise bad("only one constraint on the output may be given, not "
                  + " and ".join(constraints))
    if not constraints:
        return None
    (name, (kind, value)), = constraints.items()
    if kind != "response_format":
        try:
            return _STRUCTURED[kind](value)
        except grammar.InvalidGrammar as exc:
            raise bad(f"Invalid {name}: {exc}") from exc
    fmt = value
    if fmt.type == "regex":
        try:
            return grammar.regex(fmt.value)
        except grammar.InvalidGrammar as exc:
            raise bad(f"Invalid response_format regex: {exc}") from exc
    if fmt.type == "json" or (fmt.type == "json_object" and fmt.value is not None):
        if fmt.value is None:
            raise bad("response_format of type json needs a value: a JSON schema")
        schema: Any = fmt.value
    elif fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt.json_schema is not None and fmt.json_schema.json_schema is not None:
        schema = fmt.json_schema.json_schema
    elif isinstance(fmt.value, dict) and "schema" in fmt.value:  # TGI's json_schema
        schema = fmt.value["schema"]
    else:
        raise bad("response_format of type json_schema needs json_schema.schema")
    try:
        return grammar.json_schema(schema)
    except grammar.InvalidGrammar as exc:
        raise bad(f"Invalid response_format schema: {exc}") from exc


def bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request")


class LoadLoRAAdapter(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")  # vLLM's also carries an unused lora_int_id
    lora_name: str
