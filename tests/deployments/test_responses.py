"""The Responses API's request, as the chat request it runs as, without a server."""

from __future__ import annotations

import pytest

from deployments.admission import ApiError
from deployments.openai_schema import ChatRequest, response_grammar
from deployments.responses_api import ResponsesRequest, chat_request


def convert(**fields):
    return chat_request(ResponsesRequest(model="m", **fields))


def test_input_and_instructions_become_the_chat_s_messages():
    chat = convert(input="Hello", instructions="Be brief.", max_output_tokens=7,
                   temperature=0.5, top_p=0.9)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                             ("user", "Hello")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    # items as the openai client writes them: easy messages, typed ones, an earlier answer
    chat = convert(input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Capital of "},
            {"type": "input_text", "text": "Italy?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Rome.", "annotations": []}]},
        {"role": "user", "content": "And Spain?"}])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("developer", "Answer in French."), ("user", "Capital of Italy?"),
        ("assistant", "Rome."), ("user", "And Spain?")]


def test_text_format_is_the_chat_s_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with_schema = convert(input="x", text={"format": {"type": "json_schema", "name": "a",
                                                      "schema": schema, "strict": True}})
    assert response_grammar(with_schema) == response_grammar(ChatRequest(
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert with_schema.response_format.json_schema.json_schema == schema
    assert convert(input="x", text={"format": {"type": "json_object"}}
                   ).response_format.type == "json_object"
    assert convert(input="x", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"store": True}, "store is not supported on /v1/responses (responses are not stored)"),
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools is not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning is not supported"),
    ({"top_logprobs": 2}, "top_logprobs is not supported"),
    ({"background": True}, "background is not supported"),
    ({"truncation": "auto"}, "truncation is not supported"),
    ({"something_new": 3}, "something_new is not supported"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format of type 'grammar'"),
    ({"text": {"verbosity": "low"}}, "text supports only format"),
    ({"text": {"format": "text"}}, "text.format of type 'text' is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input items of type 'function_call_output' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "content parts of type 'input_image' are not supported"),
    ({"input": [{"role": "narrator", "content": "x"}]}, "messages.0.role: Input should be"),
    ({"input": [{"content": "no role"}]}, "messages.0.role"),
])
def test_what_is_not_implemented_is_refused_by_name(fields, message):
    with pytest.raises(ApiError) as err:
        convert(**{"input": "x", **fields})
    assert err.value.status in (400, 422) and message in err.value.message, err.value.message


def test_neutral_values_and_inert_fields_pass():
    chat = convert(input="x", store=False, tools=[], tool_choice="auto", include=[],
                   truncation="disabled", parallel_tool_calls=True, user="u",
                   service_tier="auto", prompt_cache_key="k", metadata={"k": "v"},
                   text={"format": {"type": "text"}, "verbosity": "medium"})
    assert [m.content for m in chat.messages] == ["x"]
