"""`serve run deployments.app:build_app model=...`, driven by the official `text-generation`
and `openai` clients; outputs must equal the offline engine's, token for token. The builder
starts Ray in Serve's throughput mode itself (`serve_throughput_mode`), so this way in
serves as the shipped config does (test_real_model.py runs that config); here also
disconnects, a short soak, the load generator, LoRA adapters, and constrained output: TGI's
grammar, OpenAI's response_format and tools, refusals of bad grammars before queueing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import huggingface_hub.constants
import jsonschema
import pytest
import yaml
from huggingface_hub import InferenceClient
from openai import BadRequestError, NotFoundError, OpenAI
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError
from text_generation.types import Grammar, GrammarType

from benchmarks.disconnects import run_round
from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.e2e.serving import BASE, ROOT, listener, replica_environ, serve_run
from tests.reference import peft_greedy, write_adapters
from tests.shards.test_grammar import REGEXES, SCHEMAS


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    return write_adapters(llama_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def server(llama_dir, adapters, tmp_path_factory):
    assert not [k for k in os.environ if k.startswith("RAY_SERVE_")], "unset RAY_SERVE_*"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    loras = ",".join(f"{name}={path}" for name, path in adapters.items())
    with serve_run([f"model={llama_dir}", "num_blocks=1024", "served_model_name=m",
                    f"lora_adapters={loras}"], log, ctrl_c=True) as proc:
        yield proc


def test_builder_starts_ray_in_throughput_mode(server):
    """HAProxy answers on port 8000, and every replica has both the mode (from the Ray
    instance that `serve run` started) and its in-process settings."""
    from deployments.app import REPLICA_ENV, THROUGHPUT_MODE_ENV

    assert listener(8000) == "haproxy"
    assert httpx.get(BASE + "/health", timeout=10).status_code == 200
    for deployment in ("Ingress", "Batcher", "Metrics"):
        environ = replica_environ(deployment, server.pid)
        assert {k: environ.get(k) for k in REPLICA_ENV} == REPLICA_ENV, deployment
        assert {k: environ.get(k) for k in THROUGHPUT_MODE_ENV} == THROUGHPUT_MODE_ENV


# -- the official clients ------------------------------------------------------------
@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, num_blocks=512)


PROMPTS = ["Hello kari", "Tona sefi mole dasu", "東京 😀 café", "ka", "Zuti guyoyi fiul eesordi"]


def greedy(offline: LLM, prompt: str, n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=False)
    return offline.generate([prompt], params)[0].token_ids


def test_text_generation_client(server, offline):
    client = Client(BASE, timeout=60)
    for prompt in PROMPTS[:3]:
        response = client.generate(prompt, max_new_tokens=12)
        ids = [t.id for t in response.details.tokens]
        assert ids == greedy(offline, prompt, 12)
        assert response.details.generated_tokens == len(ids)
        streamed = list(client.generate_stream(prompt, max_new_tokens=12))
        assert [s.token.id for s in streamed] == ids
        assert streamed[-1].generated_text == response.generated_text
        assert streamed[-1].details.finish_reason == response.details.finish_reason


def test_openai_client(server, offline, tokenizer):
    client = OpenAI(base_url=BASE + "/v1", api_key="unused")
    card = client.models.list().data[0]  # with vLLM's max_model_len, which clients size by
    assert card.id and card.max_model_len == httpx.get(BASE + "/info").json()["max_total_tokens"]
    prompt = PROMPTS[1]
    expected = offline.tokenizer.decode(greedy(offline, prompt, 10), skip_special_tokens=True)
    completion = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 10 or completion.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected
    # lm-evaluation-harness's scoring request: the prompt's logprobs before the answer's
    scored = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=1, echo=True)
    ids = tokenizer(prompt).input_ids
    ref = offline.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=True,
                                                 prompt_top_n_tokens=1))[0]
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    # offsets index the text returned, past the BOS the tokenizer added and the text lacks
    assert lp.tokens[0] == tokenizer.bos_token and lp.text_offset[:2] == [0, 0]
    assert all(scored.choices[0].text[o:o + len(t)] == t
               for o, t in zip(lp.text_offset[1:], lp.tokens[1:], strict=True))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert [list(top) for top in lp.top_logprobs[1:-1]] == \
        [[tokenizer.decode([t]) for t, _ in top] for top in ref.prompt_top_logprobs[1:]]
    # vLLM's return_tokens_as_token_ids: logprobs name tokens by id, the text stays text
    named = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                      logprobs=2, echo=True,
                                      extra_body={"return_tokens_as_token_ids": True})
    lp, want = named.choices[0].logprobs, ids + greedy(offline, prompt, 4)
    assert lp.tokens == [f"token_id:{t}" for t in want]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    assert named.choices[0].text == scored.choices[0].text[:len(prompt)] + \
        offline.tokenizer.decode(want[len(ids):], skip_special_tokens=True)
    assert lp.text_offset[-1] == len(named.choices[0].text) - len(
        offline.tokenizer.decode(want[-1:], skip_special_tokens=True))
    # vLLM's truncate_prompt_tokens: the prompt's last 3 tokens, echoed as such
    cut = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                    echo=True, extra_body={"truncate_prompt_tokens": 3})
    kept = tokenizer.decode(ids[-3:])
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text.startswith(kept)
    assert cut.choices[0].text[len(kept):] == \
        offline.tokenizer.decode(greedy(offline, ids[-3:], 6), skip_special_tokens=True)

    messages = [{"role": "user", "content": "Tona sefi?"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chat_expected = offline.generate([chat_ids], SamplingParams(max_new_tokens=10))[0].text
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.content == chat_expected
    assert chat.usage.prompt_tokens == len(chat_ids)
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_expected
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    named = client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    drawn = offline.generate([chat_ids], SamplingParams(max_new_tokens=10))[0].token_ids
    content = named.choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{t}" for t in drawn]
    assert content[0].top_logprobs[0].token == f"token_id:{drawn[0]}"  # greedy: the best
    assert named.choices[0].message.content == chat_expected


def test_64_concurrent_greedy_requests_equal_offline(server, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    lengths = [4 + (i * 7) % 20 for i in range(64)]

    async def main():
        client = AsyncClient(BASE, timeout=120)
        return await asyncio.gather(*(client.generate(p, max_new_tokens=n)
                                      for p, n in zip(prompts, lengths, strict=True)))

    responses = asyncio.run(main())
    expected = offline.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for response, ref in zip(responses, expected, strict=True):
        assert [t.id for t in response.details.tokens] == ref.token_ids


def test_disconnected_streams_free_their_blocks(server, offline):
    """16 streams whose clients leave after three events are all aborted (counted on
    /metrics) and free their blocks, while a bystander's output stays exact. The streams
    ignore EOS (benchmarks/disconnects.py says why): none can end before its client goes."""

    async def bystander():
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(BASE + "/generate", json={
                "inputs": PROMPTS[2], "parameters": {"max_new_tokens": 40, "details": True}})

    async def main():
        task = asyncio.ensure_future(bystander())
        result = await asyncio.to_thread(run_round, BASE, 16)
        return result, await task

    result, response = asyncio.run(main())
    bystander_ids = [t["id"] for t in response.json()["details"]["tokens"]]
    assert bystander_ids == greedy(offline, PROMPTS[2], 40)
    assert result.blocks_used == 0 and result.running == 0
    # Freed because they were aborted, not because 1000 tokens each had time to finish.
    assert result.aborted == 16


def test_short_soak_loses_nothing(server):
    from benchmarks.soak import soak

    result = asyncio.run(soak(BASE, duration=8, concurrency=8, seed=3))
    assert result["lost"] == 0, result["lost_examples"]
    assert result["succeeded"] > 0 and result["rejected_as_expected"] > 0
    assert result["cancelled"] > 0
    assert result["rss_end_mib"] > 0
    # Every request ended in an accounted state (sent counts all of them).
    accounted = sum(result.get(k, 0) for k in ("succeeded", "rejected_as_expected",
                                               "failed_with_error", "cancelled"))
    assert accounted == result["sent"]


def test_load_generator_reports_vllm_labels_and_exact_lengths(server, tmp_path, capsys):
    from benchmarks.serve import main

    result_file = tmp_path / "result.json"
    summary = main(["--url", BASE, "--model", "m", "--num-prompts", "12", "--concurrency", "4",
                    "--input-len", "20", "--output-len", "9", "--vocab-size", "2000",
                    "--result-file", str(result_file)])
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):",
                  "Median ITL (ms):", "P99 E2EL (ms):"):
        assert label in printed
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12 * 9  # ignore_eos: exact lengths
    assert summary["total_input_tokens"] == 12 * 20
    assert json.loads(result_file.read_text())["completed"] == 12
    tgi = main(["--url", BASE, "--backend", "tgi", "--num-prompts", "4", "--concurrency", "2",
                "--request-rate", "20", "--output-len", "5"])
    assert tgi["completed"] == 4 and tgi["median_ttft_ms"] > 0


# -- LoRA adapters -----------------------------------------------------------------------
def test_lora_adapters_by_tgi_adapter_id_and_openai_model(server, llama_dir, adapters,
                                                          openai_client, tokenizer):
    """TGI's `adapter_id` and OpenAI's `model` (the adapter's name, or `base:name`) pick an
    adapter: its tokens equal transformers + PEFT; unknown names get TGI's 422 and vLLM's
    404; /v1/models lists the adapters under the base model."""
    prompt = "Tona sefi mole dasu"
    ids = tokenizer(prompt).input_ids
    for name in ("alpha", "gamma"):
        r = httpx.post(BASE + "/generate", timeout=60, json={"inputs": prompt, "parameters": {
            "max_new_tokens": 10, "adapter_id": name, "details": True}})
        assert r.status_code == 200, r.text
        tokens = [t["id"] for t in r.json()["details"]["tokens"]]
        assert tokens == peft_greedy(llama_dir, adapters[name], ids, 10), name
        for model in (name, f"m:{name}"):
            completion = openai_client.completions.create(model=model, prompt=prompt,
                                                          max_tokens=10, temperature=0)
            assert completion.choices[0].text == r.json()["generated_text"], model
    r = httpx.post(BASE + "/generate", timeout=60, json={"inputs": prompt, "parameters": {
        "adapter_id": "zeta"}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "`adapter_id` zeta is not loaded" in r.json()["error"], r.text
    for model in ("m:zeta", "zeta"):
        with pytest.raises(NotFoundError, match="The model `.*zeta` does not exist"):
            openai_client.completions.create(model=model, prompt=prompt, max_tokens=2)
    listed = {m.id: getattr(m, "parent", None) for m in openai_client.models.list().data}
    assert listed == {"m": None, "alpha": "m", "beta": "m", "gamma": "m"}
    assert [(m.id, getattr(m, "parent", None)) for m in map(
        openai_client.models.retrieve, ("m", "beta"))] == [("m", None), ("beta", "m")]
    with pytest.raises(NotFoundError, match="The model `zeta` does not exist"):
        openai_client.models.retrieve("zeta")
    # Per adapter in /metrics: one TGI and two OpenAI requests each, 10 tokens apiece.
    want = [f'raygen_lora_requests_total{{adapter="{a}"}} 3.0' for a in ("alpha", "gamma")] \
        + [f'raygen_lora_generated_tokens_total{{adapter="{a}"}} 30.0' for a in ("alpha", "gamma")]
    deadline = time.monotonic() + 30  # replicas push their metrics every 2 s
    text = httpx.get(BASE + "/metrics", timeout=10).text
    while not all(w in text for w in want) and time.monotonic() < deadline:
        time.sleep(1)
        text = httpx.get(BASE + "/metrics", timeout=10).text
    assert all(w in text for w in want), [line for line in text.splitlines() if "lora" in line]


def test_lora_adapters_loaded_and_unloaded_at_run_time(server, llama_dir, adapters, tokenizer):
    """vLLM's two routes: an adapter loaded while streams run (none fails, each equals the
    offline output) serves at once, equal to transformers + PEFT; an unloaded one is
    refused; the errors are vLLM's."""
    prompt = "Tona sefi mole dasu"
    ids = tokenizer(prompt).input_ids
    expected = LLM(llama_dir, num_blocks=64).generate(
        [prompt], SamplingParams(max_new_tokens=40))[0].token_ids

    async def streamed(client: httpx.AsyncClient) -> list[int]:
        tokens = []
        async with client.stream("POST", "/generate_stream", json={
                "inputs": prompt, "parameters": {"max_new_tokens": 40}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    tokens.append(json.loads(line[5:])["token"]["id"])
        return tokens

    async def main():
        async with httpx.AsyncClient(base_url=BASE, timeout=120) as client:
            streams = [asyncio.create_task(streamed(client)) for _ in range(4)]
            await asyncio.sleep(0.5)
            load = await client.post("/v1/load_lora_adapter", json={
                "lora_name": "delta", "lora_path": adapters["beta"]})
            adapted = await client.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 10, "adapter_id": "delta", "details": True}})
            return load, adapted, await asyncio.gather(*streams)

    load, adapted, streams = asyncio.run(main())
    assert load.status_code == 200 and "'delta' added successfully" in load.text
    assert streams == [expected] * 4
    assert adapted.status_code == 200, adapted.text
    assert [t["id"] for t in adapted.json()["details"]["tokens"]] == \
        peft_greedy(llama_dir, adapters["beta"], ids, 10)
    models = httpx.get(BASE + "/v1/models", timeout=10).json()["data"]
    assert {"id": "delta", "parent": "m"}.items() <= \
        next(m for m in models if m["id"] == "delta").items()

    def post(path, body):
        return httpx.post(BASE + path, json=body, timeout=30)

    again = post("/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": adapters["beta"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = post("/v1/load_lora_adapter", {"lora_name": "eps", "lora_path": "/no/such"})
    assert missing.status_code == 400
    assert "'eps' (/no/such): no such directory" in missing.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "delta"}).status_code == 200
    refused = post("/generate", {"inputs": prompt, "parameters": {"adapter_id": "delta"}})
    assert refused.status_code == 422 and "`adapter_id` delta is not loaded" in refused.text
    gone = post("/v1/unload_lora_adapter", {"lora_name": "delta"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'delta' cannot be found."
    fixed = post("/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert fixed.status_code == 400 and "named at start" in fixed.text


# -- constrained output ------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Tona sefi mole?"}]


@pytest.fixture(scope="module")
def openai_client(server):
    return OpenAI(base_url=BASE + "/v1", api_key="unused", timeout=120)


def test_tgi_json_grammar_validates_and_ends_by_eos(server):
    client = Client(BASE, timeout=120)
    for i, schema in enumerate(SCHEMAS):
        value = schema if i % 2 == 0 else json.dumps(schema)  # TGI takes either
        grammar = Grammar(type=GrammarType.Json, value=value)
        response = client.generate(f"Kari {i}", max_new_tokens=200, grammar=grammar,
                                   do_sample=True, seed=i)
        jsonschema.validate(json.loads(response.generated_text), schema)
        assert response.details.finish_reason.value == "eos_token"
        streamed = list(client.generate_stream(f"Kari {i}", max_new_tokens=200, grammar=grammar,
                                               do_sample=True, seed=i))
        assert streamed[-1].generated_text == response.generated_text
        assert "".join(s.token.text for s in streamed if not s.token.special) \
            == response.generated_text


def test_tgi_grammar_composes_with_best_of_and_stop(server):
    schema = SCHEMAS[0]
    body = {"inputs": "Kari", "parameters": {
        "max_new_tokens": 100, "best_of": 2, "do_sample": True, "details": True,
        "grammar": {"type": "json", "value": schema}}}
    answer = httpx.post(BASE + "/generate", json=body, timeout=120).json()
    texts = [answer["generated_text"]] + [s["generated_text"] for s in
                                          answer["details"]["best_of_sequences"]]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    # A stop sequence still ends it early (TGI keeps the stop sequence in the text).
    client = Client(BASE, timeout=120)
    grammar = Grammar(type=GrammarType.Json, value=schema)
    stopped = client.generate("Kari", max_new_tokens=100, grammar=grammar, stop_sequences=[","])
    assert stopped.details.finish_reason.value == "stop_sequence"
    assert stopped.generated_text.startswith("{") and stopped.generated_text.endswith(",")


def test_tgi_regex_grammar_fullmatches(server):
    client = Client(BASE, timeout=120)
    for pattern in REGEXES:
        grammar = Grammar(type=GrammarType.Regex, value=pattern)
        text = client.generate("Zuti", max_new_tokens=40, grammar=grammar).generated_text
        assert re.fullmatch(pattern, text)
        streamed = list(client.generate_stream("Zuti", max_new_tokens=40, grammar=grammar))
        assert streamed[-1].generated_text == text
    body = {"inputs": "Zuti", "parameters": {"max_new_tokens": 20,
                                             "grammar": {"type": "regex", "value": "(yes|no)"}}}
    compat = httpx.post(BASE + "/", json=body, timeout=60).json()
    assert re.fullmatch("(yes|no)", compat[0]["generated_text"])


def test_openai_response_format(openai_client, monkeypatch):
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        chat = openai_client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, response_format=fmt, seed=i)
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        assert chat.choices[0].finish_reason == "stop"
    schema = SCHEMAS[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                  "strict": True}}
    chat = openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=200,
                                                 response_format=fmt, n=2, temperature=1.0,
                                                 seed=3, logprobs=True)
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.finish_reason == "stop"
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    text = "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=200, response_format=fmt, stream=True))
    jsonschema.validate(json.loads(text), schema)
    # huggingface_hub's InferenceClient sends TGI's shape, {"type": "json", "value": schema}.
    # (It refuses every URL, this one too, while HF_HUB_OFFLINE is set, as it is here.)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub = InferenceClient(BASE, timeout=120)
    out = hub.chat_completion(MESSAGES, model="m", max_tokens=200, seed=1,
                              response_format={"type": "json", "value": schema})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    for seed in range(3):  # any object: unbounded, so it may run out of tokens
        obj = openai_client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=100, seed=seed,
            response_format={"type": "json_object"}).choices[0]
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.message.content), dict)
        else:
            assert obj.finish_reason == "length" and obj.message.content.startswith("{")
    completion = openai_client.completions.create(model="m", prompt="Tona", max_tokens=200,
                                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    # max_tokens still bounds it: cut short, the text is what was made, "length".
    short = openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3,
                                                  response_format=fmt)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3


def test_vllm_structured_outputs_and_guided_fields(openai_client):
    """What clients of vLLM send in `extra_body`: `structured_outputs` (vLLM 0.12 on) and the
    older `guided_*` fields, on both routes, sampled: every answer is in the language."""
    options = ["positive", "negative", "neutral"]
    for i, body in enumerate(({"structured_outputs": {"choice": options}},
                              {"guided_choice": options})):
        for choice in openai_client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=20, n=3, temperature=1.0, seed=i,
                extra_body=body).choices:
            assert choice.message.content in options and choice.finish_reason == "stop"
    gbnf = 'root ::= "id-" [0-9] [0-9]? ("," "id-" [0-9] [0-9]?)?'
    for body, pattern in (({"structured_outputs": {"grammar": gbnf}}, r"id-\d\d?(,id-\d\d?)?"),
                          ({"guided_regex": "[a-c]{2,4}!"}, r"[a-c]{2,4}!")):
        completion = openai_client.completions.create(
            model="m", prompt="Tona", max_tokens=30, temperature=1.0, seed=5, extra_body=body)
        text = completion.choices[0].text
        assert re.fullmatch(pattern, text) and completion.choices[0].finish_reason == "stop", text
    with pytest.raises(BadRequestError, match="Invalid guided_grammar: neither Lark nor GBNF"):
        openai_client.completions.create(model="m", prompt="Tona", max_tokens=5,
                                         extra_body={"guided_grammar": "root ::= ("})
    with pytest.raises(BadRequestError, match="Grammar and tools are mutually exclusive"):
        openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5,
                                              tools=TOOLS,
                                              extra_body={"guided_choice": options})


def test_vllm_allowed_token_ids_and_bad_words(openai_client, offline, tokenizer):
    """vLLM's token rules through the server equal the offline engine's, and hold."""
    from deployments.openai_schema import CompletionRequest, vocabulary_rules

    prompt, keep = "Tona sefi", list(range(200, 260))
    free = greedy(offline, prompt, 8)
    banned = tokenizer.decode(free[:1]).strip()
    for body in ({"allowed_token_ids": keep}, {"bad_words": [banned]}):
        got = openai_client.completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
            extra_body={**body, "return_tokens_as_token_ids": True})
        drawn = [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]
        rules = vocabulary_rules(tokenizer, CompletionRequest(prompt=prompt, **body))
        assert drawn == offline.generate([prompt], SamplingParams(max_new_tokens=8, **rules)
                                         )[0].token_ids != free[:len(drawn)]
        if "allowed_token_ids" in body:
            assert set(drawn) <= set(keep)
    with pytest.raises(BadRequestError, match="cannot be used with response_format or tools"):
        openai_client.completions.create(model="m", prompt=prompt, max_tokens=5, extra_body={
            "bad_words": [banned], "guided_choice": ["a", "b"]})


def test_openai_responses_api(openai_client):
    """The openai client's Responses API: the answer the chat route gives the same messages,
    whole and as its typed events (the client's own stream helper checks their order); an
    answer cut short by max_output_tokens is incomplete; a schema holds; what is not
    implemented is refused."""
    instructions, question = "Answer briefly.", "Tona sefi?"
    chat = openai_client.chat.completions.create(
        model="m", max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": instructions}, {"role": "user", "content": question}])
    whole = openai_client.responses.create(model="m", instructions=instructions, input=question,
                                           max_output_tokens=12, temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                            else "completed")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with openai_client.responses.stream(model="m", instructions=instructions, input=question,
                                        max_output_tokens=12, temperature=0) as events:
        streamed = list(events)
    kinds = [event.type for event in streamed]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == \
        streamed[-1].response.output_text == whole.output_text
    short = openai_client.responses.create(model="m", input=question, max_output_tokens=2,
                                           temperature=0)
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 2)
    # a schema's answer ends by EOS: completed, and the client's helper parses it whole
    schema, fmt = SCHEMAS[1], {"type": "json_schema", "name": "place", "schema": SCHEMAS[1],
                               "strict": True}
    placed = openai_client.responses.create(model="m", input=question, max_output_tokens=200,
                                            temperature=0, text={"format": fmt})
    jsonschema.validate(json.loads(placed.output_text), schema)
    with openai_client.responses.stream(model="m", input=question, max_output_tokens=200,
                                        temperature=0, text={"format": fmt}) as events:
        final = events.get_final_response()
    assert (final.status, final.output_text) == ("completed", placed.output_text)
    with pytest.raises(BadRequestError, match="store is not supported"):
        openai_client.responses.create(model="m", input=question, store=True)


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_openai_tools_stream_and_not(openai_client, choice):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=200, tools=TOOLS, tool_choice=choice,
                  temperature=0)
    chat = openai_client.chat.completions.create(**kwargs)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    _check_call(call)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # vLLM's skip_special_tokens false: the same call (the end token is no part of it)
    raw = openai_client.chat.completions.create(**kwargs,
                                                extra_body={"skip_special_tokens": False})
    assert raw.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_openai_tools_auto_and_none(openai_client):
    for seed in range(3):
        chat = openai_client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, tools=TOOLS, temperature=1.0,
            seed=seed)
        choice = chat.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check_call(choice.message.tool_calls[0])
        elif choice.finish_reason == "stop":  # it chose to answer: the text, no envelope
            assert not choice.message.content.startswith('{"name"')
        else:  # an answer cut short by max_tokens comes back as written
            assert choice.finish_reason == "length"
            assert choice.message.content.startswith('{"name":"no_tool"')
    none = openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8,
                                                 tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def test_mixed_batch_unconstrained_equal_offline(server, llama_dir):
    offline = LLM(llama_dir, num_blocks=256)
    prompts = ["Hello kari", "Tona sefi mole dasu", "ka"]
    expected = [offline.generate([p], SamplingParams(max_new_tokens=16))[0].token_ids
                for p in prompts]
    client = AsyncClient(BASE, timeout=120)
    grammar = Grammar(type=GrammarType.Json, value=SCHEMAS[0])

    async def run():
        free = [client.generate(p, max_new_tokens=16)
                for p in prompts]
        constrained = [client.generate(f"Sefi {i}", max_new_tokens=100, grammar=grammar,
                                       do_sample=True, seed=i) for i in range(4)]
        return await asyncio.gather(*free, *constrained)

    results = asyncio.run(run())
    for response, ids in zip(results[:3], expected, strict=True):
        assert [t.id for t in response.details.tokens] == ids
    for response in results[3:]:
        jsonschema.validate(json.loads(response.generated_text), SCHEMAS[0])


BAD_TGI = [
    ({"type": "json", "value": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     "Invalid grammar"),
    ({"type": "json", "value": "{not json"}, "Invalid grammar"),
    ({"type": "regex", "value": "["}, "Invalid grammar"),
    ({"type": "regex", "value": "(x{1000}){1000}"}, "Invalid grammar"),  # pathological
    ({"type": "lark", "value": "start: 'a'"}, "unknown grammar type"),
]


@pytest.mark.parametrize(("grammar", "message"), BAD_TGI)
def test_tgi_bad_grammars_are_refused_with_422(server, grammar, message):
    body = {"inputs": "Zuti", "parameters": {"max_new_tokens": 5, "grammar": grammar}}
    for route in ("/generate", "/generate_stream"):
        response = httpx.post(BASE + route, json=body, timeout=60)
        assert response.status_code == 422
        assert message in response.json()["error"]
        assert response.json()["error_type"] == "validation"
    with pytest.raises(ValidationError):
        Client(BASE).generate("Zuti", grammar=Grammar(type=GrammarType.Regex, value="["))


BAD_OPENAI = [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
     "Invalid"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}),
     "Grammar and tools are mutually exclusive"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not in tools"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}),
     "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_OPENAI)
def test_openai_bad_constraints_are_refused_with_400(openai_client, kwargs, message):
    with pytest.raises(BadRequestError) as info:
        openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5,
                                              **kwargs)
    assert info.value.status_code == 400
    assert message in info.value.body["message"]


# -- a bad start: checked in the builder, before Ray starts -------------------------------
@pytest.mark.parametrize("args, line", [
    (["model=/no/such/model"], "raygen: model=/no/such/model: no such file or directory"),
    (["tensor_parallel_size=3"], "raygen: tensor_parallel_size=3: the model's 4 attention "
                                 "heads (2 key/value heads) do not split over 3 ranks"),
])
def test_a_bad_start_is_one_line_and_a_failed_exit(args, line, llama_dir, tmp_path):
    """Checked in the builder before Ray starts: no cluster, no waiting for replicas."""
    args = [f"model={llama_dir}", *args] if args[0].startswith("tensor") else args
    serve_bin = Path(sys.executable).with_name("serve")
    started = time.monotonic()
    done = subprocess.run([str(serve_bin), "run", "deployments.app:build_app", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == line
    assert time.monotonic() - started < 60
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(dict(a.split("=", 1) for a in args))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    preflight = subprocess.run([sys.executable, "-m", "deployments.preflight",
                                str(tmp_path / "config.yaml")], capture_output=True,
                               text=True, timeout=120, cwd=ROOT)
    assert preflight.returncode == 1
    assert preflight.stderr.strip() == line.replace("raygen: ", "raygen: application raygen: ")
