"""The Serve app over real HTTP: TGI's validation rules with their status codes and
messages, limits, auth, OpenAI's error shape, metrics in a real Prometheus, and what a dead
shard does to a request."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from benchmarks.serving_floor import build_app as floor_app
from benchmarks.serving_floor import main as floor_benchmark
from deployments.app import build_app
from deployments.config import AppArgs
from deployments.offline import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration  # Ray in the test process

PORT = 8123
BASE = f"http://127.0.0.1:{PORT}"
KEY = "sekret-key"


# Ray's fixed default ports (GCS, dashboard, Ray client, the dashboard agent's HTTP port):
# ray.init refuses a port given to another component that equals one of them.
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}


def free_port(taken: frozenset[int] = frozenset()) -> int:
    """A port below the OS's ephemeral range, where nothing that binds port 0 lands: Ray
    picks its own random ports that way after this one is chosen, and the range holds
    52365 (CI once failed on exactly that collision)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 12000), low)
        if port in RAY_DEFAULT_PORTS | taken | {PORT}:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


METRICS_EXPORT_PORT = free_port()


@pytest.fixture(scope="module")
def app(llama_dir):
    # Ray's metrics export, every second, for the Prometheus test.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _metrics_export_port=METRICS_EXPORT_PORT,
             _system_config={"metrics_report_interval_ms": 1000})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run_many([  # deployed together: their replicas start side by side
        serve.RunTarget(build_app(AppArgs(model=llama_dir, max_input_tokens=64,
                                          max_total_tokens=128, payload_limit=65536,
                                          num_blocks=256)), name="main", route_prefix="/"),
        serve.RunTarget(build_app(AppArgs(model=llama_dir, api_key=KEY,
                                          max_concurrent_requests=1, num_blocks=256)),
                        name="locked", route_prefix="/locked"),
        # benchmarks.serving_floor: the same process shape with a shard that only sleeps.
        serve.RunTarget(floor_app({"step_ms": 1}), name="floor", route_prefix="/floor"),
    ])
    yield
    serve.shutdown()
    ray.shutdown()


def post(path: str, payload, **kw) -> httpx.Response:
    return httpx.post(BASE + path, json=payload, timeout=60, **kw)


VALIDATION = [
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 200},
     "`inputs` tokens + `max_new_tokens` must be <= 128. Given: 7 `inputs` tokens and 200 "
     "`max_new_tokens`"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 64. Given: 0"),
    ({"truncate": 65}, "`truncate` must be strictly positive and less than 64. Given: 65"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"adapter_id": "my-lora"},
     "`adapter_id` my-lora is not loaded: this server serves no LoRA adapters "
     "(lora_adapters, POST /v1/load_lora_adapter)"),
    ({"grammar": {"type": "regex"}}, "`grammar` must be an object with `type` and `value`"),
    ({"ignore_eos": True},
     "`ignore_eos` is not a TGI parameter (the OpenAI routes take vLLM's sampling fields)"),
]


@pytest.mark.parametrize(("parameters", "message"), VALIDATION)
def test_validation_rules(app, parameters, message):
    r = post("/generate",
             {"inputs": "Hello world", "parameters": {"max_new_tokens": 4, **parameters}})
    assert r.status_code == 422
    assert r.json() == {"error": message, "error_type": "validation"}


def test_input_length_rules(app):
    long_text = " ".join(["kari"] * 100)
    r = post("/generate", {"inputs": long_text, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 422
    assert r.json()["error"].startswith("`inputs` tokens + `max_new_tokens` must be <= 128")
    r = post("/generate", {"inputs": " ".join(["kari"] * 40), "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 422
    assert r.json()["error"].startswith("`inputs` must have less than 64 tokens. Given: ")
    r = post("/generate", {"inputs": "", "parameters": {"max_new_tokens": 1}})
    assert (r.status_code, r.json()["error"]) == (422, "`inputs` cannot be empty")


def test_streaming_only_rules(app):
    for params, message in (
        ({"best_of": 2, "do_sample": True},
         "`best_of` != 1 is not supported when streaming tokens"),
        ({"decoder_input_details": True},
         "`decoder_input_details` == true is not supported when streaming tokens"),
    ):
        r = post("/generate_stream",
                 {"inputs": "Hi", "parameters": {"max_new_tokens": 2, **params}})
        assert r.status_code == 422 and r.json() == {"error": message, "error_type": "validation"}


@pytest.mark.parametrize("body", [
    b'{"inputs": "hi", "parameters": {"temperature": NaN}}',
    b'{"inputs": "hi", "parameters": {"top_p": Infinity}}',
    b'{"inputs": "\xff\xfe bad utf8"}',
    b'{"inputs": "hi", "parameters": {"max_new_tokens": "many"}}',
    b'{"inputs": "hi", "parameters": {"max_new_tokens": -5}}',
    b'{"parameters": {}}',
    b'not json',
])
def test_malformed_bodies_are_422(app, body):
    r = httpx.post(BASE + "/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation" and r.json()["error"]


def test_payload_limit_is_413(app):
    r = post("/generate", {"inputs": "x" * 100_000})
    assert r.status_code == 413
    assert r.json()["error_type"] == "payload_limit"


def test_tgi_watermark_equals_the_offline_engine_s(app, llama_dir):
    """TGI's `watermark: true` (the clients' `watermark=True`): greedy output through the
    route equals the offline engine's with the watermark, which tests/shards/test_sampler.py
    checks against transformers, and differs from the unmarked output."""
    def ids(watermark: bool) -> list[int]:
        r = post("/generate", {"inputs": "Tona sefi mole kari", "parameters": {
            "max_new_tokens": 12, "details": True, "watermark": watermark}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    llm = LLM(llama_dir, num_blocks=64)
    prompt = llm.tokenizer("Tona sefi mole kari").input_ids
    offline = llm.generate([prompt], SamplingParams(max_new_tokens=12, watermark=True))[0]
    assert ids(True) == offline.token_ids != ids(False)


def test_generate_headers_and_details(app):
    r = post("/generate", {"inputs": "Hello world", "parameters": {
        "max_new_tokens": 5, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"]) == 5
    assert body["details"]["prefill"][0]["logprob"] is None
    assert all(len(t) == 2 for t in body["details"]["top_tokens"])
    for header in ("x-compute-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                   "x-prompt-tokens", "x-generated-tokens"):
        assert header in r.headers
    assert r.headers["x-generated-tokens"] == "5"
    assert int(r.headers["x-prompt-tokens"]) == len(body["details"]["prefill"])


def test_tokenize_and_info(app, tokenizer):
    r = post("/tokenize", {"inputs": "Hello kari"})
    assert [t["id"] for t in r.json()] == tokenizer("Hello kari").input_ids
    # `truncate` keeps the last tokens, as /generate does (TGI's /tokenize honours it too).
    text = "Hello kari tona sefi"
    r = post("/tokenize", {"inputs": text, "parameters": {"truncate": 2}})
    assert [t["id"] for t in r.json()] == tokenizer(text).input_ids[-2:]
    assert "".join(t["text"] for t in r.json()) == text[r.json()[0]["start"]:]
    # vLLM's /tokenize shares the route, told by its body (`prompt` or `messages`) ...
    r = post("/tokenize", {"model": "m", "prompt": text, "return_token_strs": True})
    ids = tokenizer(text).input_ids
    assert r.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Hello kari"}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    chat_ids = tokenizer(templated, add_special_tokens=False).input_ids
    r = post("/tokenize", {"messages": messages})
    assert (r.json()["tokens"], r.json()["token_strs"]) == (chat_ids, None)
    assert post("/tokenize", {"messages": messages, "add_generation_prompt": False}
                ).json()["count"] < len(chat_ids)
    # ... its /detokenize, and TGI's /chat_tokenize (the template's text and its tokens)
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    r = post("/chat_tokenize", {"model": "tgi", "messages": messages})
    assert r.json()["templated_text"] == templated
    assert [t["id"] for t in r.json()["tokenize_response"]] == chat_ids
    assert "".join(t["text"] for t in r.json()["tokenize_response"]) == templated
    for path, body, message in (
            ("/detokenize", {"tokens": [len(tokenizer)]}, "tokens must be token ids in"),
            ("/tokenize", {"prompt": 5}, "prompt: Input should be a valid string"),
            ("/tokenize", {"messages": messages, "chat_template": "{{ x }}"},
             "chat_template is not supported"),
            ("/chat_tokenize", {"messages": []}, "messages: List should have at least 1")):
        r = post(path, body)
        assert r.status_code in (400, 422) and message in r.text, (path, r.text)
    info = httpx.get(BASE + "/info").json()
    assert info["max_input_tokens"] == 64 and info["max_total_tokens"] == 128
    # The admission policy in effect: TGI v3 with chunked prefill admits at every step.
    assert (info["waiting_served_ratio"], info["max_waiting_tokens"]) == (0, 0)
    assert info["speculate"] == 0  # TGI's field: draft tokens per step, off by default
    # What runs, not what was asked (dtype=auto): float32 weights on CPU, raygen's kernel.
    assert (info["model_dtype"], info["model_device_type"]) == ("float32", "cpu")
    # A second copy of the weights for small steps, where the start-up timing kept one.
    copy = info["raygen"]["compute_path"].pop("weight_copy")
    assert copy in (None, "rows in lanes", "panels", "K x N")
    assert info["raygen"] == {
        "tensor_parallel_size": 1, "num_scheduler_steps": 4, "compute_path": {
            "device": "cpu", "weight_dtype": "float32", "activation_dtype": "float32",
            "attention_backend": "cpu", "kv_cache_dtype": "float32",
            # The demo llama's LM head is a weight of its own (not tied to the embedding),
            # freed once packed: no greedy screen (shards/cpu/greedy_screen.py).
            "quant_blocks": None, "greedy_screen": False}}


def test_sagemaker_invocations_answer_each_kind_of_body_as_its_own_route_does(app):
    """TGI's SageMaker routes: /invocations takes TGI's body (`inputs`, streamed or not by
    its `stream`), a chat completion's (`messages`) or a completion's (`prompt`) and answers
    as that body's own route does; a body of none of them is a 422 that names the three;
    /ping is /health."""
    tgi_body = {"inputs": "Tona sefi mole", "parameters": {"max_new_tokens": 6,
                                                             "details": True}}
    r = post("/invocations", tgi_body)
    assert r.status_code == 200, r.text
    assert r.json() == post("/", tgi_body).json()
    r = post("/invocations", {**tgi_body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert len(events) == 6 and events[-1]["generated_text"] == \
        post("/generate", tgi_body).json()["generated_text"]
    for route, body, read in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tona sefi"}]},
             lambda c: c["message"]["content"]),
            ("/v1/completions", {"prompt": "Tona sefi mole"}, lambda c: c["text"])):
        body = {"model": "m", "max_tokens": 6, "temperature": 0, **body}
        got, want = post("/invocations", body).json(), post(route, body).json()
        assert got["object"] == want["object"]
        for count in ("prompt_tokens", "completion_tokens"):
            assert got["usage"][count] == want["usage"][count]
        assert read(got["choices"][0]) == read(want["choices"][0])
    r = post("/invocations", {"text": "hi"})
    assert r.status_code == 422 and "`inputs`" in r.json()["error"] and \
        r.json()["error_type"] == "validation"
    assert post("/invocations", {"prompt": "hi", "max_tokens": 1000}).status_code == 400
    assert httpx.get(BASE + "/ping", timeout=30).status_code == 200
    assert httpx.get(BASE + "/version", timeout=30).json()["version"] == \
        httpx.get(BASE + "/info", timeout=30).json()["version"]


def test_openai_errors_use_openai_shape(app):
    for payload in (
        {"model": "m", "prompt": "hi", "temperature": 3},
        {"model": "m", "prompt": "hi", "n": 100},
        {"model": "m", "prompt": "hi", "max_tokens": 1000},
        {"model": "m", "prompt": ""},
        {"model": "m", "messages": []},
    ):
        path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
        r = post(path, payload)
        assert r.status_code == 400, (payload, r.text)
        assert set(r.json()["error"]) >= {"message", "type"}


def test_openai_refuses_output_changing_fields_it_does_not_implement(app):
    """A field that would change the output is honoured or refused, never ignored; fields
    that change nothing (`user`, `metadata`) and neutral values pass."""
    completion = {"model": "m", "prompt": "Hello kari", "max_tokens": 4, "temperature": 0}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    for path, body, field in (
            ("/v1/completions", {**completion, "suffix": " end"}, "suffix"),
            ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
            ("/v1/completions", {**completion, "best_of": 2}, "best_of"),
            ("/v1/completions", {**completion, "priority": 1}, "priority"),
            ("/v1/completions", {**completion, "logprobs": 1, "logprob_token_ids": [5]},
             "logprob_token_ids"),
            ("/v1/chat/completions", {**chat, "watermarking": True}, "watermarking"),
            ("/v1/chat/completions", {**chat, "guided_whitespace_pattern": " "},
             "guided_whitespace_pattern"),
            ("/v1/chat/completions", {**chat, "structured_outputs": {
                "regex": "a+", "structural_tag": "{}"}}, "structural_tag"),
            ("/v1/chat/completions", {**chat, "functions": [{"name": "f"}]}, "functions"),
            ("/v1/chat/completions", {**chat, "modalities": ["text", "audio"]}, "text output"),
            ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
             "image_url")):
        r = post(path, body)
        assert r.status_code == 400, (field, r.text)
        assert field in r.json()["error"]["message"]
    for path, body in (("/v1/completions", {**completion, "logit_bias": {}, "best_of": 1,
                                            "user": "u", "length_penalty": 1.0, "priority": 0}),
                       ("/v1/chat/completions", {**chat, "modalities": ["text"],
                                                 "metadata": {"k": "v"}})):
        assert post(path, body).status_code == 200, body
    # vLLM's chat template options: an assistant's message continued, or a clear 400
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Tona"}]
    continued = post("/v1/chat/completions", {**chat, "messages": turns,
                                              "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert continued.status_code == 200, continued.text
    assert continued.json()["usage"]["prompt_tokens"] < post("/v1/chat/completions", {
        **chat, "messages": turns}).json()["usage"]["prompt_tokens"]
    r = post("/v1/chat/completions", {**chat, "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]


def strict_json(text: str):
    """JSON as a strict parser (JavaScript's, serde's) reads it: no NaN or Infinity."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def sse_events(path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", BASE + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [strict_json(line[5:]) for line in r.iter_lines()
                if line.startswith("data:") and line != "data: [DONE]"]


def test_openai_return_token_ids_as_vllm_returns_them(app, tokenizer):
    """vLLM's return_token_ids: a completion's choices carry the prompt's ids and their
    own output ids; a chat response the prompt's ids beside its choices' output ids.
    Streamed, the prompt's ids come once (the first chunk) and the chunks' output ids add
    up to the whole answer's, which the text decodes to."""
    prompt = "Tona sefi mole"
    completion = {"model": "m", "prompt": prompt, "max_tokens": 9, "temperature": 0,
                  "return_token_ids": True}
    whole = post("/v1/completions", completion).json()["choices"][0]
    assert whole["prompt_token_ids"] == tokenizer(prompt).input_ids
    assert len(whole["token_ids"]) == 9 and tokenizer.decode(whole["token_ids"]) == whole["text"]
    chunks = sse_events("/v1/completions", {**completion, "stream": True})
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == \
        [whole["prompt_token_ids"]] + [None] * (len(chunks) - 1)
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["token_ids"]
    assert "token_ids" not in post("/v1/completions", {
        **completion, "return_token_ids": False}).json()["choices"][0]
    # vLLM's request_id names the response; else the X-Request-Id Serve's proxy keeps
    assert post("/v1/completions", {**completion, "request_id": "r-1"},
                headers={"X-Request-Id": "h-2"}).json()["id"] == "cmpl-r-1"
    assert post("/v1/completions", completion,
                headers={"X-Request-Id": "h-2"}).json()["id"] == "cmpl-h-2"

    chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 7,
            "temperature": 0, "return_token_ids": True, "n": 2}
    body = post("/v1/chat/completions", chat).json()
    templated = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert body["prompt_token_ids"] == templated
    for choice in body["choices"]:
        assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = sse_events("/v1/chat/completions", {**chat, "n": 1, "stream": True})
    assert chunks[0]["prompt_token_ids"] == templated
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == \
        body["choices"][0]["token_ids"]


def test_openai_honours_vllm_top_k_and_repetition_penalty(app):
    """vLLM's extensions, taken as the engine's own top_k, min_p and repetition_penalty:
    top_k 1 (or min_p 1) samples the greedy token at any temperature; a penalty changes
    what greedy picks exactly as the TGI route with the same penalty does."""
    body = {"model": "m", "prompt": "Tona sefi mole", "max_tokens": 12}
    greedy = post("/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    sampled = [post("/v1/completions", {**body, "temperature": 1.5, "top_k": k, "seed": seed})
               .json()["choices"][0]["text"] for k in (1, -1) for seed in (1, 2, 3)]
    assert sampled[:3] == [greedy] * 3
    assert any(text != greedy for text in sampled[3:])  # top_k -1: off, so it samples
    # min_p 1: only tokens as likely as the top one stay, so it samples the greedy text too.
    assert [post("/v1/completions", {**body, "temperature": 1.5, "min_p": 1.0, "seed": seed})
            .json()["choices"][0]["text"] for seed in (1, 2, 3)] == [greedy] * 3
    assert post("/v1/completions", {**body, "min_p": 1.5}).status_code == 400
    penalised = post("/v1/completions", {**body, "temperature": 0, "repetition_penalty": 3.0})
    tgi = post("/generate", {"inputs": "Tona sefi mole", "parameters": {
        "max_new_tokens": 12, "repetition_penalty": 3.0}})
    assert penalised.json()["choices"][0]["text"] == tgi.json()["generated_text"] != greedy
    assert post("/v1/completions", {**body, "top_k": -2}).status_code == 400
    assert post("/v1/completions", {**body, "repetition_penalty": 0}).status_code == 400


def test_a_stop_string_at_the_last_token_allowed_ends_each_route_in_its_order(app):
    """The length limit and a stop string at the same token: TGI checks the length first
    (finish_reason `length`, the string kept in its text); vLLM's stop string wins (`stop`,
    its stop_reason, the string cut from the text)."""
    prompt = "Tona sefi mole"
    tokens = post("/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": 24, "details": True}}).json()["details"]["tokens"]
    texts = ["".join(t["text"] for t in tokens[:k]) for k in range(len(tokens) + 1)]
    # the first length whose last token's text comes nowhere earlier in the text
    n = next(k for k in range(4, 25) if texts[k][len(texts[k - 1]):].strip()
             and texts[k].index(texts[k][len(texts[k - 1]):]) == len(texts[k - 1]))
    text, stop = texts[n], texts[n][len(texts[n - 1]):]
    tgi = post("/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": n, "stop": [stop], "details": True}}).json()
    assert tgi["details"]["finish_reason"] == "length" and tgi["generated_text"] == text
    events = sse_events("/generate_stream", {"inputs": prompt, "parameters": {
        "max_new_tokens": n, "stop": [stop]}})
    assert events[-1]["details"]["finish_reason"] == "length"
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "stop": [stop]}
    choice = post("/v1/completions", body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == text[:-len(stop)]


def test_logprobs_of_tokens_a_grammar_masks_are_json_on_every_route(app):
    """A grammar leaves a step few tokens, so its top alternatives include masked ones at
    -inf, which JSON cannot carry: the whole responses failed with a 500 once generated and
    the streams wrote `-Infinity`. TGI's serializer writes null; vLLM floors at -9999.0."""
    regex = {"type": "regex", "value": "(yes|no)"}
    tgi = post("/generate", {"inputs": "Tona sefi", "parameters": {
        "max_new_tokens": 4, "details": True, "top_n_tokens": 3, "grammar": regex}})
    assert tgi.status_code == 200, tgi.text
    body = strict_json(tgi.text)
    assert body["generated_text"] in ("yes", "no")
    tops = [t["logprob"] for step in body["details"]["top_tokens"] for t in step]
    assert None in tops and all(lp is None or lp <= 0 for lp in tops)
    events = sse_events("/generate_stream", {"inputs": "Tona sefi", "parameters": {
        "max_new_tokens": 4, "top_n_tokens": 3, "grammar": regex}})
    assert None in [t["logprob"] for e in events for t in e["top_tokens"]]
    for path, extra in (("/v1/completions", {"prompt": "Tona sefi", "logprobs": 3}),
                        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 3, "messages": [
                            {"role": "user", "content": "Tona sefi"}]})):
        body = {"model": "m", "max_tokens": 4, "structured_outputs": {"regex": "(yes|no)"},
                **extra}
        r = post(path, body)
        assert r.status_code == 200, r.text
        chunks = [strict_json(r.text)] + sse_events(path, {**body, "stream": True})
        for chunk in chunks:
            for choice in chunk["choices"]:
                lp = choice["logprobs"] or {}
                tops = [v for top in lp.get("top_logprobs") or [] for v in top.values()] + [
                    t["logprob"] for e in lp.get("content") or [] for t in e["top_logprobs"]]
                assert all(v >= -9999.0 for v in tops)
        whole = chunks[0]["choices"][0]["logprobs"]
        floored = whole["top_logprobs"] if "top_logprobs" in whole else [
            {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in whole["content"]]
        assert -9999.0 in [v for top in floored for v in top.values()]


def test_openai_honours_vllm_stop_token_ids_and_include_stop_str(app):
    """vLLM's stop extensions, taken as the engine's own: a stop token ends the output
    where it first comes (it counts as generated, as an EOS does), and not before
    min_tokens; include_stop_str_in_output keeps the stop string that trimmed text would
    lose."""
    body = {"model": "m", "prompt": "Tona sefi mole", "max_tokens": 12, "temperature": 0}
    ids = [t["id"] for t in post("/generate", {"inputs": body["prompt"], "parameters": {
        "max_new_tokens": 12, "details": True}}).json()["details"]["tokens"]]
    at = 3
    cut = post("/v1/completions", {**body, "stop_token_ids": [ids[at]]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] == ids.index(ids[at]) + 1
    text = post("/v1/completions", body).json()["choices"][0]["text"]
    stop = text.strip()[2:5]
    kept = post("/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})
    trimmed = post("/v1/completions", {**body, "stop": [stop]})
    assert kept.json()["choices"][0]["text"] == trimmed.json()["choices"][0]["text"] + stop
    assert kept.json()["choices"][0]["text"] == text[:text.index(stop) + len(stop)]
    # vLLM's stop_reason: the stop string or stop token id that ended the choice
    assert trimmed.json()["choices"][0]["stop_reason"] == stop
    assert cut["choices"][0]["stop_reason"] == ids[at]
    assert post("/v1/completions", body).json()["choices"][0]["stop_reason"] is None  # length
    streamed = sse_events("/v1/completions", {**body, "stop": ["zzzq", stop], "stream": True})
    assert [c["choices"][0]["stop_reason"] for c in streamed][-1] == stop
    assert {c["choices"][0]["stop_reason"] for c in streamed[:-1]} <= {None}
    assert post("/v1/completions", {**body, "stop_token_ids": [-1]}).status_code == 400
    # min_tokens: the stop token is not drawn before 6 tokens (greedy draws another there)
    held = post("/v1/completions", {**body, "stop_token_ids": [ids[at]], "min_tokens": 6})
    assert held.json()["usage"]["completion_tokens"] >= 6, held.text
    for extra, field in (({"min_tokens": 13}, "min_tokens must be between 0 and max_tokens"),
                         ({"min_tokens": 2, "response_format": {"type": "json_object"}},
                          "min_tokens cannot be used with response_format")):
        r = post("/v1/completions", {**body, **extra})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_openai_honours_logit_bias(app, tokenizer):
    """+100 on one token: greedy and sampled output is that token; -100 on greedy's first
    token: another comes first; an id past the vocabulary is a 400, not a failed step."""
    body = {"model": "m", "prompt": "Tona sefi mole", "max_tokens": 4, "temperature": 0}
    word = tokenizer("kari", add_special_tokens=False).input_ids[-1]
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        r = post("/v1/completions", {**body, **extra, "logit_bias": {str(word): 100}})
        assert r.json()["choices"][0]["text"] == tokenizer.decode([word] * 4), r.text
    ids = [t["id"] for t in post("/generate", {"inputs": body["prompt"], "parameters": {
        "max_new_tokens": 1, "details": True}}).json()["details"]["tokens"]]
    first = post("/v1/completions", {**body, "max_tokens": 1, "logprobs": 0,
                                     "logit_bias": {str(ids[0]): -100}}).json()
    assert first["choices"][0]["logprobs"]["tokens"][0] != tokenizer.decode(ids)
    r = post("/v1/completions", {**body, "logit_bias": {str(len(tokenizer) + 10): 1}})
    assert r.status_code == 400 and "logit_bias" in r.text


def test_openai_echo_scores_the_prompt_as_lm_evaluation_harness_reads_it(app, llama_dir,
                                                                          tokenizer):
    """lm-evaluation-harness's loglikelihood request (token-id prompts, `echo`, `logprobs:
    1`, one new token): each choice's logprobs start with its prompt's, the first None, the
    others transformers' own; the best alternative at each token, equal to the token's
    logprob where the token is the best (its `is_greedy`); offsets that index the text.
    Streamed, the same text; `echo` without logprobs, the prompt's text before the answer;
    with `max_tokens: 0`, the prompt and its logprobs alone."""
    import torch

    from tests.reference import hf_model, make_prompts

    prompts = make_prompts(2048, [21, 9], seed=31)
    body = {"model": "m", "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    r = post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    model = hf_model(llama_dir)
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert choice["text"].startswith(text) and len(choice["text"]) > len(text)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.inference_mode():
            logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), ref, atol=1e-4)
        for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert len(top) == 1 and max(top.values()) >= token_lp
        # the answer's token is greedy's: the best one, so lm-eval's is_greedy holds
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        assert lp["tokens"][-1] == tokenizer.decode([logp[-1].argmax().item()])
        assert all(choice["text"][o:o + len(t)] == t
                   for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    streamed = ["", ""]
    with httpx.stream("POST", BASE + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed[choice["index"]] += choice["text"]
    assert streamed == [c["text"] for c in choices]
    plain = post("/v1/completions", {"model": "m", "prompt": "Tona sefi mole", "echo": True,
                                     "max_tokens": 3, "temperature": 0}).json()["choices"][0]
    answer = post("/v1/completions", {"model": "m", "prompt": "Tona sefi mole",
                                      "max_tokens": 3, "temperature": 0}).json()["choices"][0]
    assert plain["text"] == "Tona sefi mole" + answer["text"] and plain["logprobs"] is None
    # max_tokens 0 (OpenAI's older scoring request): the prompt and its logprobs alone
    body = {**body, "prompt": prompts[0], "max_tokens": 0, "logprobs": 0}
    alone = post("/v1/completions", body).json()
    lp, scored = alone["choices"][0]["logprobs"], choices[0]["logprobs"]
    assert alone["choices"][0]["text"] == tokenizer.decode(prompts[0],
                                                           clean_up_tokenization_spaces=False)
    assert lp["tokens"] == scored["tokens"][:-1] and lp["top_logprobs"][1:] == [{}] * 20
    assert lp["token_logprobs"] == pytest.approx(scored["token_logprobs"][:-1], abs=1e-6)
    assert alone["choices"][0]["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    chunks = [json.loads(line[6:]) for line in post("/v1/completions", {
        **body, "stream": True}).text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert post("/v1/completions", {**body, "echo": False}).status_code == 400


def test_openai_honours_vllm_prompt_logprobs(app, llama_dir, tokenizer):
    """vLLM's prompt_logprobs: per prompt token (None for the first), keyed by token id,
    its logprob (transformers'), rank and text, then the best alternatives with ranks 1..k;
    on a completion's choice, at the top of a chat response; refused when streaming."""
    import torch

    from tests.reference import hf_model, make_prompts

    ids = make_prompts(2048, [14], seed=32)[0]
    r = post("/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 2,
                                 "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    ranked = r.json()["choices"][0]["prompt_logprobs"]
    with torch.inference_mode():
        logp = hf_model(llama_dir)(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert ranked[0] is None and len(ranked) == len(ids)
    for i, at in enumerate(ranked[1:]):
        own = at[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(logp[i, ids[i + 1]].item(), abs=1e-4)
        assert own["decoded_token"] == tokenizer.decode([ids[i + 1]])
        best = logp[i].topk(2).indices.tolist()
        assert [at[str(t)]["rank"] for t in best] == [1, 2]
        assert len(at) == (2 if ids[i + 1] in best else 3)
        lp = logp[i, ids[i + 1]]  # 1 + the tokens more likely, give or take near-ties
        assert 1 + (logp[i] > lp + 1e-4).sum() <= own["rank"] <= 1 + (logp[i] > lp - 1e-4).sum()
    chat = post("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Tona sefi"}], "max_tokens": 2, "prompt_logprobs": 0})
    body = chat.json()
    assert body["prompt_logprobs"][0] is None and body["usage"]["prompt_tokens"] == \
        len(body["prompt_logprobs"]) and all(len(at) == 1 for at in body["prompt_logprobs"][1:])
    for payload in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 6}):
        r = post("/v1/completions", {"model": "m", "prompt": "hi", **payload})
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_openai_usage_reports_cached_prompt_tokens(app):
    from tests.reference import make_prompts

    prompt = make_prompts(2048, [50], seed=77)[0]  # unseen so far: nothing cached
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post("/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == 50
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = post("/v1/completions", body).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 50 and cached % 16 == 0  # whole KV blocks
    # vLLM's cache_salt: blocks shared only among requests with the same salt
    salted = [post("/v1/completions", {**body, "cache_salt": "tenant-a"}).json()["usage"]
              ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    assert salted == [0, cached]
    assert post("/v1/completions", {**body, "cache_salt": ""}).status_code == 400
    lines = post("/v1/completions", {**body, "stream": True,
                                     "stream_options": {"include_usage": True}}).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert all("usage" not in c for c in chunks[:-1])
    # vLLM's continuous_usage_stats: each chunk's usage so far, up to the final one's
    lines = post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "Tona sefi"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text
    chunks = [json.loads(x[6:]) for x in lines.splitlines() if x.startswith("data: {")]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done[0] == 0 and done == sorted(done) and done[-1] == 6 == done[-2]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}


def test_api_key_guards_every_route_but_health(app):
    for method, path, body in (("POST", "/locked/generate", {"inputs": "hi"}),
                               ("GET", "/locked/info", None), ("GET", "/locked/metrics", None),
                               ("GET", "/locked/v1/models", None),
                               ("GET", "/locked/v1/models/m", None),
                               ("POST", "/locked/v1/completions", {"model": "m", "prompt": "hi"}),
                               ("POST", "/locked/invocations", {"inputs": "hi"})):
        r = httpx.request(method, BASE + path, json=body, timeout=30)
        assert r.status_code == 401, path
        r = httpx.request(method, BASE + path, json=body, timeout=30,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
    assert httpx.get(BASE + "/locked/health", timeout=30).status_code == 200
    r = post("/locked/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
             headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


def test_past_max_concurrent_requests_is_429(app):
    started = threading.Event()
    done = threading.Event()

    def long_stream():
        with httpx.stream("POST", BASE + "/locked/generate_stream", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"inputs": "hi", "parameters": {"max_new_tokens": 300}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()
                    if done.is_set():
                        break

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(30)
        r = post("/locked/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                 headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 429
        assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    finally:
        done.set()
        t.join(60)


HOSTILE = [
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 10**12}}, 422),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}, 422),
    ("/generate", {"inputs": "hi", "parameters": {"best_of": 10**9, "do_sample": True}}, 422),
    ("/generate", {"inputs": "hi", "parameters": {"top_n_tokens": 10**9}}, 422),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["x"] * 10_000}}, 422),
    ("/generate", {"inputs": "hi", "parameters": {"seed": -3}}, 422),
    ("/generate", {"inputs": ["a", "list"]}, 422),
    ("/generate", [1, 2, 3], 422),
    ("/v1/completions", {"model": "m", "prompt": "hi", "n": 10**9}, 400),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 10**12}, 400),
    ("/v1/completions", {"model": "m", "prompt": [10**9]}, 400),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 10**6}, 400),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["x"] * 10_000}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": "not a list"}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}], "top_logprobs": 10**6,
                              "logprobs": True}, 400),
]


@pytest.mark.parametrize(("path", "payload", "status"), HOSTILE)
def test_hostile_values_get_clear_4xx(app, path, payload, status):
    r = post(path, payload)
    assert r.status_code == status, r.text
    assert "error" in r.json()


def test_ten_megabyte_body_is_413_without_reading_it_all(app):
    r = httpx.post(BASE + "/generate", content=b'{"inputs": "' + b"x" * 10_000_000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_schemathesis_finds_no_server_error_and_no_hang(app):
    import subprocess
    import sys
    from pathlib import Path

    st = Path(sys.executable).with_name("st")
    run = subprocess.run(
        [str(st), "run", BASE + "/openapi.json", "--checks", "not_a_server_error",
         "--phases", "fuzzing", "--max-examples", "30", "--request-timeout", "30",
         "--seed", "1", "--no-color"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    import re

    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", run.stdout).groups())
    assert generated == passed >= 200  # every route, a few hundred cases, no 5xx, no hang


def test_api_key_never_reaches_the_logs(app):
    from pathlib import Path

    from ray._private.worker import _global_node

    r = post("/locked/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
             headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    logs = Path(_global_node.get_session_dir_path()) / "logs"
    leaked = [p.name for p in logs.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []


def test_serving_floor_streams_every_token_and_counts_its_processes_cpu(app):
    """The model-free floor (benchmarks/NOTES.md 52) under its own load command: every
    token asked for arrives as its own SSE event, and the CPU per token it reports comes
    from the floor's replicas and its sleeping shard actor."""
    result = floor_benchmark(["load", "--url", BASE + "/floor", "--num-prompts", "20",
                              "--input-len", "8", "--output-len", "16"])
    assert (result["completed"], result["failed"]) == (20, 0)
    assert result["total_output_tokens"] == 20 * 16
    assert result["total_input_tokens"] == 20 * 8
    assert result["median_itl_ms"] >= 1.0  # each token waited for its 1 ms step
    names = [name for _, name in result["processes"]]
    assert any("ServeReplica:floor:Batcher" in n for n in names), names
    assert any("SleepShard" in n for n in names), names
    assert result["cpu_ms_per_token"] >= sum(ms for ms, _ in result["processes"])
    with pytest.raises(ValueError, match="hop must be"):
        floor_app({"hop": "graph"})


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory):
    """A real Prometheus (Debian's package) on loopback, scraping Ray's metrics export."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (make test installs it)")
    prom_port = free_port(frozenset({METRICS_EXPORT_PORT}))
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        f"scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{METRICS_EXPORT_PORT}']\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{prom_port}"
    finally:
        proc.terminate()
        proc.wait(30)


def query(base: str, expr: str) -> float | None:
    try:
        body = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=5).json()
    except httpx.HTTPError:
        return None
    result = body.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def wait_for(base: str, expr: str, predicate, timeout: float = 90) -> float:
    deadline = time.monotonic() + timeout
    value = query(base, expr)
    while (value is None or not predicate(value)) and time.monotonic() < deadline:
        time.sleep(1)
        value = query(base, expr)
    assert value is not None and predicate(value), f"{expr} = {value}"
    return value


def test_request_ttft_and_kv_series_move_in_prometheus(prometheus):
    """Metrics reach Prometheus under the names the Grafana dashboard queries: request
    count, TTFT and KV usage series move while the `locked` app serves."""
    auth = {"Authorization": f"Bearer {KEY}"}
    for i in range(6):
        r = post("/locked/generate", {"inputs": f"kari tona {i}",
                                      "parameters": {"max_new_tokens": 8}}, headers=auth)
        assert r.status_code == 200
    app = 'application="locked"'
    assert wait_for(prometheus, f"sum(ray_tgi_request_count_total{{{app}}})",
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, f"sum(ray_tgi_request_success_total{{{app}}})",
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, f"sum(ray_raygen_time_to_first_token_seconds_count{{{app}}})",
                    lambda v: v >= 6) >= 6
    assert wait_for(prometheus, f'sum(ray_raygen_kv_blocks_capacity{{{app},deployment="Batcher"}})',
                    lambda v: v == 256) == 256
    # KV usage moves while a long request holds blocks, and returns to zero after.
    with httpx.stream("POST", BASE + "/locked/generate_stream", timeout=60, headers=auth,
                      json={"inputs": "mole dasu", "parameters": {"max_new_tokens": 1000}}) as r:
        assert r.status_code == 200
        assert wait_for(prometheus, f"max(ray_raygen_kv_blocks_used{{{app}}})",
                        lambda v: v > 0) > 0
        r.close()
    assert wait_for(prometheus, f"max(ray_raygen_kv_blocks_used{{{app}}})",
                    lambda v: v == 0) == 0
    # Tagged per replica, so the dashboard can split by it.
    tagged = httpx.get(prometheus + "/api/v1/series", timeout=5,
                       params={"match[]": "ray_tgi_batch_current_size"}).json()["data"]
    assert tagged and {"application", "deployment", "replica"} <= set(tagged[0])


def test_dead_shard_gives_424_then_unhealthy(app):
    """Last in the module: it breaks the main app's replica."""
    prefix = "main-"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if isinstance(a, dict) and a["name"].startswith(prefix) and "shard-0" in a["name"]]
    assert names, "shard actors are named <app>-<replica>-shard-<rank>"
    results = {}

    def generate():
        results["r"] = post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 100}})

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(0.3)
    namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"] == names[0])
    ray.kill(ray.get_actor(names[0], namespace=namespace))
    t.join(30)
    r = results["r"]
    if r.status_code == 200:  # finished before the kill landed: the next one must fail
        r = post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 424, r.text
    assert r.json()["error_type"] == "generation"
    deadline = time.monotonic() + 20
    health = httpx.get(BASE + "/health", timeout=30)
    while health.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        health = httpx.get(BASE + "/health", timeout=30)
    assert health.status_code == 503
    assert json.loads(health.text)["error_type"] == "healthcheck"

