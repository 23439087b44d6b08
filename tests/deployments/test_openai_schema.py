"""The OpenAI adapter's prompt handling and streamed chunks, without a server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments import grammar
from deployments.admission import ApiError
from deployments.config import Limits
from deployments.generation import Generation
from deployments.openai_api import _View
from deployments.openai_schema import (
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    _same,
    check_token_ids,
    params,
    prompts,
    response_grammar,
    truncated,
    vocabulary_rules,
)
from engine.outputs import RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams


class CountingTokenizer:
    """The real tokenizer, counting how often its vocabulary is sized (about 1 ms a time)."""

    def __init__(self, tok):
        self.tok, self.sized = tok, 0

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def __len__(self):
        self.sized += 1
        return len(self.tok)


def test_token_id_prompts_are_checked_against_the_vocabulary(tokenizer):
    vocab = len(tokenizer)
    tok = CountingTokenizer(tokenizer)
    assert prompts(tok, CompletionRequest(model="m", prompt=[1, vocab - 1]), chat=False) == \
        [[1, vocab - 1]]
    assert prompts(tok, CompletionRequest(model="m", prompt=[[1], [2, 3]]), chat=False) == \
        [[1], [2, 3]]
    for bad_ids in ([1, vocab], [[1], [-1]]):
        with pytest.raises(ApiError) as err:
            prompts(tok, CompletionRequest(model="m", prompt=bad_ids), chat=False)
        assert err.value.status == 400
        assert err.value.message == f"prompt token ids must be in [0, {vocab})"
    assert tok.sized == 1  # once per tokenizer: a fast tokenizer copies its vocabulary to count


def test_text_prompts_do_not_size_the_vocabulary(tokenizer):
    tok = CountingTokenizer(tokenizer)
    for text in ("Tona sefi", ["Tona", "sefi mole"]):
        got = prompts(tok, CompletionRequest(model="m", prompt=text), chat=False)
        texts = [text] if isinstance(text, str) else text
        assert got == [tokenizer(t).input_ids for t in texts]
    assert tok.sized == 0


# The server's limits for the checks below: a 128-token context, TGI's defaults otherwise.
LIMITS = Limits(max_input_tokens=100, max_total_tokens=128, max_stop_sequences=4,
                max_best_of=2, max_top_n_tokens=5)


def chat_request(content, **fields) -> ChatRequest:
    return ChatRequest(model="m", messages=[{"role": "user", "content": content}], **fields)


def test_chat_template_options_reach_the_template(tokenizer):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs are
    the tokenizer's own apply_chat_template arguments; what the template cannot take is a
    400, not a server error."""
    import copy

    turns = [{"role": "user", "content": "Tona"}, {"role": "assistant", "content": "Sefi mo"}]

    def ids(**fields) -> list[int]:
        return prompts(tokenizer, ChatRequest(model="m", messages=turns, **fields), True)[0]

    def ref(**kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(turns, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids

    assert ids() == ref(add_generation_prompt=True)
    assert ids(add_generation_prompt=False) == ref(add_generation_prompt=False) != ids()
    continued = ids(add_generation_prompt=False, continue_final_message=True)
    assert continued == ref(continue_final_message=True) != ids(add_generation_prompt=False)
    assert tokenizer.decode(continued).endswith("Sefi mo")  # the turn is left open
    for fields, message in (({"continue_final_message": True}, "continue_final_message"),
                            ({"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
                            ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                             "chat_template")):
        with pytest.raises(ApiError, match=message):
            ids(**fields)
    custom = copy.copy(tokenizer)  # a template that reads an option of its own
    custom.chat_template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    request = ChatRequest(model="m", messages=turns, chat_template_kwargs={"greeting": "Hi "})
    assert custom.decode(prompts(custom, request, True)[0]) == "Hi TonaSefi mo"
    custom.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ApiError, match="roles must alternate"):
        prompts(custom, request, True)
    assert "raise_exception" not in tokenizer.chat_template  # the shared one untouched


def test_chat_content_parts_are_text_or_refused(tokenizer):
    """Text parts join into the message's text; an image (or any part that is not text) is
    refused by name, not dropped: the answer would be to a question no one asked."""
    parts = [{"type": "text", "text": "Tona "}, {"type": "text", "text": "sefi"}]
    assert prompts(tokenizer, chat_request(parts), chat=True) == \
        prompts(tokenizer, chat_request("Tona sefi"), chat=True)
    for part, word in (({"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        "'image_url'"),
                       ({"type": "input_audio", "input_audio": {"data": ""}}, "'input_audio'"),
                       ({"type": "text"}, "needs a string 'text'")):
        with pytest.raises(ApiError) as err:
            prompts(tokenizer, chat_request([parts[0], part]), chat=True)
        assert err.value.status == 400 and word in err.value.message


def test_max_tokens_below_one_is_named_as_such():
    for request, chat, field in (
            (CompletionRequest(model="m", prompt="hi", max_tokens=0), False, "max_tokens"),
            (chat_request("hi", max_tokens=0), True, "max_tokens"),
            (chat_request("hi", max_tokens=5, max_completion_tokens=0), True,
             "max_completion_tokens")):
        with pytest.raises(ApiError) as err:
            params(LIMITS, 4, request, chat, num_prompt_tokens=3)
        assert err.value.message == f"{field} must be at least 1, got 0"
    # Where both are given, the newer name wins (here the smaller).
    assert params(LIMITS, 4, chat_request("hi", max_tokens=9, max_completion_tokens=3),
                  True, num_prompt_tokens=3).max_new_tokens == 3
    with pytest.raises(ApiError, match="maximum context length is 128 tokens"):
        params(LIMITS, 4, chat_request("hi", max_tokens=126), True, num_prompt_tokens=3)


def test_schemas_are_closed_where_they_list_properties():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/point"},
                       "path": {"type": "array", "items": point},
                       "tags": {"type": "object", "additionalProperties": True,
                                "properties": {"a": {"type": "string"}}},
                       "any": {"type": "object"},
                       "either": {"anyOf": [point, {"type": "string"}]},
                       "both": {"allOf": [point, {"properties": {"y": {}}}]}},
        "$defs": {"point": point},
    }
    before = json.dumps(schema)
    out = grammar.closed(schema)
    assert json.dumps(schema) == before  # the request's schema is left as it came
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert out["$defs"]["point"]["additionalProperties"] is False
    assert props["path"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["tags"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in props["any"]  # lists nothing: any keys
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])
    assert "additionalProperties" not in props["both"]


def test_a_json_grammar_refuses_keys_the_schema_does_not_list(llama_dir, tokenizer):
    """What the model may write: the listed keys, not others (TGI's, vLLM's and llama.cpp's
    behaviour; JSON Schema's own default, which llguidance follows, allows any key)."""
    import llguidance

    from shards.model.grammar import load_tokenizer

    ll = load_tokenizer(llama_dir, len(tokenizer))
    tool = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = grammar.json_schema(tool)

    def accepted(document: str) -> bool:
        matcher = llguidance.LLMatcher(ll, text, log_level=0)
        tokens = ll.tokenize_str(document)
        return matcher.validate_tokens(tokens) == len(tokens) and \
            matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert accepted('{"city":"Paris"}')
    assert not accepted('{"city":"Paris","month":"May"}')
    assert not accepted('{"city":"Paris","":"x"}')


def test_response_format_takes_openai_s_and_tgi_s_shapes():
    """huggingface_hub's InferenceClient sends TGI's grammar shape to /v1/chat/completions
    (`{"type": "json" | "regex" | "json_schema", "value": ...}`); the openai client sends
    OpenAI's. The same schema is the same grammar either way."""
    schema = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 8}},
              "required": ["c"]}
    want = grammar.json_schema(schema)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                {"type": "json", "value": schema},
                {"type": "json", "value": json.dumps(schema)},
                {"type": "json_object", "value": schema},
                {"type": "json_schema", "value": {"name": "x", "schema": schema}}):
        assert response_grammar(chat_request("hi", response_format=fmt)) == want, fmt
    assert response_grammar(chat_request("hi", response_format={"type": "json_object"})) == \
        grammar.json_schema({"type": "object"})
    assert response_grammar(chat_request(
        "hi", response_format={"type": "regex", "value": "[0-9]{3}"})) == grammar.regex("[0-9]{3}")
    assert response_grammar(chat_request("hi", response_format={"type": "text"})) is None
    for fmt, message in (({"type": "json"}, "needs a value"),
                         ({"type": "regex", "value": 5}, "Invalid response_format regex"),
                         ({"type": "json_schema", "value": {"name": "x"}},
                          "needs json_schema.schema")):
        with pytest.raises(ApiError) as err:
            response_grammar(chat_request("hi", response_format=fmt))
        assert err.value.status == 400 and message in err.value.message, err.value.message


def test_vllm_structured_outputs_and_guided_fields_are_the_same_grammars():
    """vLLM's `structured_outputs` (0.12 on) and its older `guided_*` fields: each kind is
    the grammar the same constraint makes through `response_format` or directly."""
    schema = {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}
    gbnf = 'root ::= "yes" | "no"'
    for kind, value, want in (
            ("json", schema, grammar.json_schema(schema)),
            ("json", json.dumps(schema), grammar.json_schema(schema)),
            ("regex", "[0-9]{3}", grammar.regex("[0-9]{3}")),
            ("choice", ["positive", "negative"], grammar.choice(["positive", "negative"])),
            ("grammar", gbnf, grammar.context_free(gbnf))):
        assert response_grammar(chat_request("hi", structured_outputs={kind: value})) == want
        assert response_grammar(chat_request("hi", **{f"guided_{kind}": value})) == want
        assert response_grammar(CompletionRequest(
            model="m", prompt="hi", structured_outputs={kind: value})) == want
    assert response_grammar(chat_request("hi", structured_outputs={"json_object": True})) == \
        response_grammar(chat_request("hi", response_format={"type": "json_object"}))
    # what raygen always does anyway: compact JSON, only the listed properties
    assert response_grammar(chat_request("hi", structured_outputs={
        "json": schema, "disable_any_whitespace": True, "disable_additional_properties": True,
        "disable_fallback": True})) == grammar.json_schema(schema)
    for fields, message in (
            ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"},
             "only one constraint on the output may be given, not structured_outputs.choice "
             "and guided_regex"),
            ({"structured_outputs": {"regex": "a", "json_object": True}},
             "not structured_outputs.regex and structured_outputs.json_object"),
            ({"guided_json": schema, "response_format": {"type": "json_object"}},
             "not response_format and guided_json"),
            ({"structured_outputs": {}}, "structured_outputs needs one of json, regex"),
            ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
             "structured_outputs.whitespace_pattern is not supported"),
            ({"structured_outputs": {"structural_tag": "{}"}},
             "structured_outputs.structural_tag is not supported"),
            ({"guided_choice": []}, "Invalid guided_choice: a choice must be a list"),
            ({"structured_outputs": {"choice": ["a", ""]}}, "Invalid structured_outputs.choice"),
            ({"guided_grammar": "root ::= ("}, "Invalid guided_grammar: neither Lark nor GBNF"),
            ({"structured_outputs": {"json": "{nope"}},
             "Invalid structured_outputs.json: the JSON schema is not valid JSON")):
        with pytest.raises(ApiError) as err:
            response_grammar(chat_request("hi", **fields))
        assert err.value.status == 400 and message in err.value.message, err.value.message
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):  # a 422 served
        chat_request("hi", structured_outputs={"choices": ["a"]})


def test_choices_and_context_free_grammars_accept_exactly_their_language(llama_dir, tokenizer):
    """A choice is one of its strings, whole (quotes and non-ASCII text included); a GBNF
    grammar (llama.cpp's, the EBNF vLLM's xgrammar reads) and its Lark form (llguidance's)
    accept the same texts."""
    import llguidance

    from shards.model.grammar import load_tokenizer

    ll = load_tokenizer(llama_dir, len(tokenizer))

    def accepted(text: str, document: str) -> bool:
        matcher = llguidance.LLMatcher(ll, text, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        tokens = ll.tokenize_str(document)
        return matcher.validate_tokens(tokens) == len(tokens) and \
            matcher.consume_tokens(tokens) and matcher.is_accepting()

    options = ["positive", "negative", 'a "quoted" café']
    choice = grammar.choice(options)
    for option in options:
        assert accepted(choice, option)
    for other in ("posit", "positive!", "neutral", "a quoted café"):
        assert not accepted(choice, other)
    gbnf = 'root ::= "id-" [0-9]+ ("," " "? "id-" [0-9]+)*'
    lark = 'start: "id-" /[0-9]+/ ("," " "? "id-" /[0-9]+/)*'
    for document, ok in (("id-1", True), ("id-12, id-3,id-4", True), ("id-", False),
                         ("id-1;id-2", False), ("ID-1", False)):
        assert accepted(grammar.context_free(gbnf), document) is ok, document
        assert accepted(grammar.context_free(lark), document) is ok, document


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens():
    """vLLM's `truncate_prompt_tokens`, as TGI's `truncate`: the last k tokens; -1 as many
    as the server takes. A prompt longer than max_input_tokens then passes."""
    ids = list(range(10, 150))  # 140 tokens, past LIMITS.max_input_tokens (100)
    assert truncated(LIMITS, chat_request("hi"), ids) == ids
    assert truncated(LIMITS, chat_request("hi", truncate_prompt_tokens=3), ids) == [147, 148, 149]
    # vLLM's truncation_side: "right" keeps the first k, "left" (the default) the last
    for side, kept in (("right", [10, 11, 12]), ("left", [147, 148, 149])):
        assert truncated(LIMITS, chat_request("hi", truncate_prompt_tokens=3,
                                              truncation_side=side), ids) == kept
    assert truncated(LIMITS, CompletionRequest(model="m", prompt="hi", truncate_prompt_tokens=-1),
                     ids) == ids[-100:]
    assert truncated(LIMITS, chat_request("hi", truncate_prompt_tokens=50), ids[:5]) == ids[:5]
    for k in (0, -2, 101):
        with pytest.raises(ApiError, match="truncate_prompt_tokens must be -1 or between 1 and "
                                           "100 \\(max_input_tokens\\)"):
            truncated(LIMITS, chat_request("hi", truncate_prompt_tokens=k), ids)


def test_allowed_token_ids_and_bad_words_become_token_rules(tokenizer):
    """vLLM's allowed_token_ids (checked against the vocabulary) and bad_words (a word's
    tokens at a text's start, and after a space where that makes another first token of the
    same count: vLLM's rule)."""
    plain = tuple(tokenizer.encode("kari", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" kari", add_special_tokens=False))
    assert len(plain) == len(spaced) and plain[0] != spaced[0]  # the case the rule is for
    rules = vocabulary_rules(tokenizer, chat_request("hi", allowed_token_ids=[9, 5, 9],
                                                     bad_words=["  kari", "kari"]))
    assert rules == {"allowed_token_ids": (5, 9), "bad_words": (plain, spaced)}
    assert vocabulary_rules(tokenizer, chat_request("hi")) == {}
    for fields, message in (({"allowed_token_ids": []}, "non-empty list of token ids"),
                            ({"allowed_token_ids": [-3]}, "non-empty list of token ids"),
                            ({"bad_words": [" "]}, "bad_words must be non-empty strings")):
        with pytest.raises(ApiError, match=message):
            vocabulary_rules(tokenizer, chat_request("hi", **fields))
    with pytest.raises(ApiError, match="allowed_token_ids must name token ids in"):
        check_token_ids(tokenizer, SamplingParams(allowed_token_ids=(len(tokenizer),)))
    word = tokenizer.decode([plain[0]])  # a one-token word: banned everywhere
    with pytest.raises(ApiError, match="bad_words bans every token of allowed_token_ids"):
        vocabulary_rules(tokenizer, chat_request("hi", allowed_token_ids=[plain[0]],
                                                 bad_words=[word]))
    assert vocabulary_rules(tokenizer, chat_request(
        "hi", allowed_token_ids=[plain[0], 9], bad_words=[word]))["allowed_token_ids"] == \
        tuple(sorted({plain[0], 9}))


def test_min_tokens_needs_an_allowed_token_that_does_not_end_the_output(tokenizer):
    """With only end tokens allowed, min_tokens would mask every token of the first row:
    refused, not drawn from nothing."""
    eos = frozenset({2})
    for only_ends in (SamplingParams(allowed_token_ids=(2,), min_tokens=3),
                      SamplingParams(allowed_token_ids=(2, 7), stop_token_ids=(7,),
                                     min_tokens=1)):
        with pytest.raises(ApiError, match="min_tokens \\(\\d\\) needs a token in allowed"):
            check_token_ids(tokenizer, only_ends, eos)
    for fine in (SamplingParams(allowed_token_ids=(2,)),  # may end at once
                 SamplingParams(allowed_token_ids=(2, 7), min_tokens=3),
                 SamplingParams(allowed_token_ids=(2,), min_tokens=3, ignore_eos=True)):
        check_token_ids(tokenizer, fine, eos)


def test_tgi_grammar_takes_a_json_schema_config():
    from deployments.tgi import ValidationError, _grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _grammar({"type": "json_schema", "value": {"name": "p", "schema": schema}}) == \
        _grammar({"type": "json", "value": schema}) == grammar.json_schema(schema)
    with pytest.raises(ValidationError, match="needs `schema`"):
        _grammar({"type": "json_schema", "value": schema})


def test_tgi_refuses_other_apis_sampling_fields_unless_neutral_and_drops_the_rest():
    """TGI drops unknown parameters; vLLM's and OpenAI's sampling fields would change the
    output a client expects, so they are refused unless at their neutral value."""
    from deployments.config import Limits
    from deployments.tgi import TGIRequest, ValidationError, _check_parameters

    limits = Limits(max_input_tokens=64, max_total_tokens=128, max_stop_sequences=4,
                    max_best_of=2, max_top_n_tokens=5)

    def check(**parameters):
        return _check_parameters(TGIRequest(inputs="hi", parameters=parameters), limits, False)

    assert check(ignore_eos=False, min_p=0, n=1, max_tokens=None, logit_bias={},
                 skip_special_tokens=True, unknown_field=7) == (1, None)
    for name, value, use in (("ignore_eos", True, ""), ("min_p", 0.1, ""),
                             ("max_tokens", 8, "; TGI's is `max_new_tokens`"),
                             ("n", 2, "; TGI's is `best_of`"), ("ignore_eos", 0, "")):
        with pytest.raises(ValidationError) as refused:
            check(**{name: value})
        assert str(refused.value) == (f"`{name}` is not a TGI parameter{use} (the OpenAI "
                                      "routes take vLLM's sampling fields)")


def test_log_probability_fields_are_honoured_or_refused_by_name():
    """`echo` with `logprobs` scores the prompt too (its tokens' logprobs and as many
    alternatives as the output's), without them not; on chat it is refused. `top_logprobs`
    without `logprobs` would return none of what it asks for, so it is refused; each
    limit names its field."""
    for request, chat, message in (
            (chat_request("hi", echo=True), True, "echo is not supported on chat completions"),
            (CompletionRequest(model="m", prompt="hi", logprobs=6), False,
             "logprobs must be between 0 and 5"),
            (chat_request("hi", logprobs=True, top_logprobs=6), True,
             "top_logprobs must be between 0 and 5"),
            (chat_request("hi", top_logprobs=2), True, "top_logprobs needs logprobs set to true")):
        with pytest.raises(ApiError) as err:
            params(LIMITS, 4, request, chat, num_prompt_tokens=3)
        assert err.value.message == message
    assert params(LIMITS, 4, CompletionRequest(model="m", prompt="hi", echo=False), False,
                  num_prompt_tokens=3).top_n_tokens == 0
    for echo, logprobs, scored, top_n in ((True, 2, True, 2), (True, 0, True, 0),
                                          (True, None, False, 0), (False, 2, False, 0)):
        p = params(LIMITS, 4, CompletionRequest(model="m", prompt="hi", echo=echo,
                                                logprobs=logprobs), False, num_prompt_tokens=3)
        assert (p.prompt_logprobs, p.prompt_top_n_tokens) == (scored, top_n)
    # echo with max_tokens 0 scores the prompt: one token is drawn (and not returned)
    assert params(LIMITS, 4, CompletionRequest(model="m", prompt="hi", echo=True, max_tokens=0,
                                               logprobs=0), False,
                  num_prompt_tokens=3).max_new_tokens == 1
    assert params(LIMITS, 4, chat_request("hi", logprobs=True, top_logprobs=5), True,
                  num_prompt_tokens=3).top_n_tokens == 5


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unimplemented_field_is_refused_unless_neutral(name):
    """Every field that would change the output and is not implemented (OpenAI's, vLLM's
    and TGI's extensions) is refused by name, and passes at its neutral values."""
    neutral, message = UNSUPPORTED[name]
    value = next(v for v in (True, False, 2, ["x"], "x")
                 if not any(_same(v, n) for n in neutral))
    # a field that a route's own schema declares is honoured there (echo on completions)
    for chat in [c for c in (False, True)
                 if name not in (ChatRequest if c else CompletionRequest).model_fields]:
        make = (lambda **f: chat_request("hi", **f)) if chat else \
            (lambda **f: CompletionRequest(model="m", prompt="hi", **f))
        with pytest.raises(ApiError) as err:
            params(LIMITS, 4, make(**{name: value}), chat, num_prompt_tokens=3)
        assert err.value.message == message and err.value.status == 400
        for ok in neutral:
            params(LIMITS, 4, make(**{name: ok}), chat, num_prompt_tokens=3)


def test_tool_choice_names_a_function_in_each_client_s_shape():
    """OpenAI's `{"type": "function", "function": {...}}`, huggingface_hub's object without
    `type`, and TGI's bare name all pick that one function; an unknown name is refused."""
    from deployments.openai_tools import tool_grammar

    def tool(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}

    def grammar_for(choice) -> str:
        return tool_grammar(ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                        tools=[tool("f"), tool("g")], tool_choice=choice))

    want = grammar_for({"type": "function", "function": {"name": "g"}})
    assert grammar_for({"function": {"name": "g"}}) == grammar_for("g") == want
    assert want not in (grammar_for("required"), grammar_for("auto"), grammar_for("f"))
    assert grammar_for("none") is None
    with pytest.raises(ApiError, match="names function 'h'"):
        grammar_for("h")


def test_vllm_stop_extensions_reach_the_engine():
    got = params(LIMITS, 4, chat_request("hi", stop_token_ids=[5, 7], stop=["x"],
                                         include_stop_str_in_output=True,
                                         skip_special_tokens=False), True, num_prompt_tokens=3)
    assert (got.stop_token_ids, got.stop, got.include_stop_str_in_output,
            got.skip_special_tokens) == ((5, 7), ("x",), True, False)
    plain = params(LIMITS, 4, CompletionRequest(model="m", prompt="hi"), False,
                   num_prompt_tokens=3)
    assert (plain.stop_token_ids, plain.include_stop_str_in_output,
            plain.skip_special_tokens) == ((), False, True)


def test_logit_bias_is_parsed_checked_and_sized_against_the_vocabulary(tokenizer):
    got = params(LIMITS, 4, CompletionRequest(model="m", prompt="hi",
                                              logit_bias={"7": 5, "3": -100.0}), False, 3)
    assert got.logit_bias == ((3, -100.0), (7, 5.0))
    for bias, message in (({"x": 1}, "keys must be token ids"),
                          ({"-1": 1}, "keys must be token ids"),
                          ({"5": 101}, "between -100 and 100")):
        with pytest.raises(ApiError, match=message):
            params(LIMITS, 4, CompletionRequest(model="m", prompt="hi", logit_bias=bias),
                   False, 3)
    vocab = len(tokenizer)
    check_token_ids(tokenizer, got)
    for far in (SamplingParams(logit_bias=((vocab, 1.0),)),
                SamplingParams(stop_token_ids=(vocab,))):
        with pytest.raises(ApiError, match=rf"in \[0, {vocab}\)"):
            check_token_ids(tokenizer, far)


class _BurstBatcher:
    """A batcher double whose outputs for a run arrive all at once, before the stream has
    sent any of them (what a busy event loop sees): each output one token, whose logprob
    says its position."""

    def __init__(self, tokenizer, lengths):
        self.tokenizer, self.lengths = tokenizer, iter(lengths)
        self.generate = self

    def remote(self, request):
        return self._outputs(request.request_id, next(self.lengths))

    async def _outputs(self, rid, length):
        for i in range(length):
            token = 100 + i
            yield RequestOutput(rid, [token], [self.tokenizer.decode([token])], [-float(i + 1)],
                                [[]], self.tokenizer.decode([token]), finished=i == length - 1,
                                finish_reason=FinishReason.LENGTH if i == length - 1 else None)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_chunks_carry_their_own_tokens_when_outputs_come_in_bursts(tokenizer, chat):
    """Each chunk's logprobs, text offsets and usage count are its own output's: an n>1
    stream takes outputs from a queue that its runs fill ahead of it (before: a chunk took
    the tokens at the end of its run as filled so far, so the first chunk named the second
    token, with the second token's logprob, beside the first token's text)."""
    lengths = [3, 2]
    api = SimpleNamespace(tokenizer=tokenizer, batcher=_BurstBatcher(tokenizer, lengths),
                          admission=SimpleNamespace(failed=lambda kind: None,
                                                    succeeded=lambda g, route: None,
                                                    release=lambda: None))
    runs = [Generation(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=n))
            for i, n in enumerate(lengths)]
    view = _View(api, "cmpl-x", "m", chat, True, False, [None] * len(runs), None)

    async def events():
        return [chunk async for chunk in view.events(runs, include_usage=True, continuous=True)]

    chunks = [json.loads(line[6:]) for raw in asyncio.run(events())
              for line in raw.decode().split("\n") if line.startswith("data: {")]
    seen: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if not choice["logprobs"]:
                continue
            text = choice["delta"]["content"] if chat else choice["text"]
            if chat:
                entries = [(e["token"], e["logprob"]) for e in choice["logprobs"]["content"]]
            else:
                lp = choice["logprobs"]
                entries = list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
                assert lp["text_offset"] == [len("".join(t for t, _ in seen[choice["index"]]))]
            assert "".join(t for t, _ in entries) == text
            seen[choice["index"]] += entries
            assert chunk["usage"]["completion_tokens"] == len(seen[choice["index"]])
    for index, n in enumerate(lengths):
        assert seen[index] == [(tokenizer.decode([100 + i]), -float(i + 1)) for i in range(n)]


@pytest.mark.parametrize("text", [
    '{"name":"get_weather","arguments":{"city":"Paris \\"15e\\"","days":3}}',
    '{"name":"no_tool","arguments":{"content":"It is sunny."}}',
])
def test_a_tool_call_cut_anywhere_reads_the_same_streamed_and_whole(text):
    """max_tokens may end a tool call at any character: the stream's deltas, joined, say what
    the whole answer says (content, the call's name and arguments, finish reason)."""
    from deployments.openai_tools import CallStream, message, parse

    for cut in range(1, len(text) + 1):
        out, stream = text[:cut], CallStream()
        pieces = [out[i : i + 3] for i in range(0, len(out), 3)]
        deltas = [d for i, piece in enumerate(pieces)
                  for d in stream.feed(piece, finished=i == len(pieces) - 1)]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        streamed_content = "".join(d["content"] for d in deltas if "content" in d) or None
        content, whole_calls = message(out)
        assert streamed_content == content, cut
        assert len(calls[:1]) == len(whole_calls), cut
        if whole_calls:
            function = whole_calls[0]["function"]
            assert calls[0]["function"]["name"] == function["name"] == "get_weather"
            assert "".join(c["function"]["arguments"] for c in calls) == function["arguments"]
            assert content is None
        complete = parse(out) is not None
        assert (stream.called and complete) == (bool(whole_calls) and complete)
    assert message(text) != (text, [])  # the whole text is a call or no_tool's content


def test_a_token_s_logprob_is_asked_of_the_engine_only_where_the_response_shows_it():
    """Without `logprobs` a greedy row may skip the full vocabulary's logits
    (shards/cpu/greedy_screen.py); with it (0 included, for completions) it may not."""
    cases = ((CompletionRequest(model="m", prompt="hi"), False, False),
             (CompletionRequest(model="m", prompt="hi", logprobs=0), False, True),
             (CompletionRequest(model="m", prompt="hi", logprobs=2), False, True),
             (chat_request("hi"), True, False),
             (chat_request("hi", logprobs=False), True, False),
             (chat_request("hi", logprobs=True), True, True))
    for request, chat, wanted in cases:
        assert params(LIMITS, 4, request, chat, num_prompt_tokens=3).logprobs is wanted


def test_tgi_asks_for_a_token_s_logprob_only_where_its_response_shows_it(tokenizer):
    """A plain /generate answer is its text: its tokens' logprobs are not asked of the engine
    (a greedy row may skip the full vocabulary's logits); a stream, `details`,
    `decoder_input_details` and best_of (ranked by them) ask for them."""
    from deployments.tgi import TGIRequest, validate

    limits = Limits(max_input_tokens=64, max_total_tokens=128, max_stop_sequences=4,
                    max_best_of=2, max_top_n_tokens=5)
    for parameters, stream, wanted in (({}, False, False), ({}, True, True),
                                       ({"details": True}, False, True),
                                       ({"decoder_input_details": True}, False, True),
                                       ({"best_of": 2, "do_sample": True}, False, True)):
        request = TGIRequest(inputs="hi", parameters={"max_new_tokens": 4, **parameters})
        assert validate(request, tokenizer, limits, stream).params.logprobs is wanted
