"""`serve run` as a user starts it, driven by the official `text-generation` and `openai`
clients; outputs must equal the offline engine's, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI
from text_generation import AsyncClient, Client

from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.e2e.serving import BASE, ROOT, listener, replica_environ, serve_run


@dataclasses.dataclass
class Server:
    log: Path  # what `serve run` printed
    pid: int = 0  # the `serve run` process (its Ray instance's processes descend from it)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    """`serve run` of the shipped serve_config.yaml, as `make serve` starts it (its
    `controller_options` turn on Serve's throughput mode): HAProxy on port 8000, direct
    ingress, gRPC, and no RAY_SERVE_* variable in the environment. The other way in,
    `serve run deployments.app:build_app`, is test_import_path.py's; Serve's proxy actor
    runs the chaos module and every in-process deployments test."""
    tmp = tmp_path_factory.mktemp("serve")
    assert not [k for k in os.environ if k.startswith("RAY_SERVE_")], "unset RAY_SERVE_*"
    server = Server(tmp / "serve.log")
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(model=str(llama_dir), num_blocks=1024)
    (tmp / "serve_config.yaml").write_text(yaml.safe_dump(config))
    with serve_run([], server.log, target=str(tmp / "serve_config.yaml")) as proc:
        server.pid = proc.pid
        yield server


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
    assert client.models.list().data[0].id
    prompt = PROMPTS[1]
    expected = offline.tokenizer.decode(greedy(offline, prompt, 10), skip_special_tokens=True)
    completion = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 10 or completion.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected

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
    from benchmarks.disconnects import run_round

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
    summary = main(["--url", BASE, "--num-prompts", "12", "--concurrency", "4",
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
