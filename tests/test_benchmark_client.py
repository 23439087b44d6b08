"""The benchmarks' HTTP clients (benchmarks/serve.py, benchmarks/speculation.py) against a
scripted server: a request that a closed connection fails before any response is sent
again once; one whose response breaks off is a failure, never sent twice."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.serve import send
from benchmarks.speculation import one

EVENTS = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
          {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}]


def _body(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)


async def _serve(script: list[str], call, answer: bytes = _body(EVENTS),
                 kind: bytes = b"text/event-stream") -> tuple[object, int]:
    """Each connection does what the script's next entry says: `close` (read the request,
    answer nothing), `answer` (the whole of `answer`) or `break` (headers and one event,
    then gone). Returns what `call(client, url)` returned (or raised) and the number of
    connections made."""
    connections = 0

    async def handle(reader, writer):
        nonlocal connections
        what = script[min(connections, len(script) - 1)]
        connections += 1
        await _read_request(reader)
        if what == "answer":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\n"
                         b"connection: close\r\n\r\n" + answer)
        elif what == "break":
            chunk = _body(EVENTS[:1])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient(timeout=10) as client:
        try:
            result = await call(client, f"http://127.0.0.1:{port}")
        except httpx.HTTPError as exc:
            result = exc
    return result, connections


@pytest.mark.parametrize(("script", "connections", "success"), [
    (["answer"], 1, True),
    (["close", "answer"], 2, True),  # the stale connection's request, sent again
    (["close", "close"], 2, False),  # once only
    (["break", "answer"], 1, False),  # it began: not sent again
])
def test_a_request_goes_again_only_where_nothing_was_answered(script, connections, success):
    result, made = asyncio.run(_serve(
        script, lambda client, url: send(client, url, "openai", "m", [1, 2, 3], 2, True, "")))
    assert (made, result.success) == (connections, success), result.error
    if success:
        assert (result.output_tokens, result.prompt_len) == (2, 3)
        assert result.ttft > 0 and len(result.itl) == 1
    else:
        assert "RemoteProtocolError" in result.error


CHAT = {"choices": [{"message": {"content": "same text"}}], "usage": {"completion_tokens": 2}}


async def _chat(client: httpx.AsyncClient, url: str):
    client.base_url = url  # benchmarks.speculation's client names the server once
    return await one(client, "m", "hi", 2, False)


@pytest.mark.parametrize(("script", "connections", "answer"), [
    (["close", "answer"], 2, ("same text", 2)),
    (["close", "close"], 2, httpx.RemoteProtocolError),
])
def test_the_speculation_benchmarks_request_goes_again_once_where_nothing_was_answered(
        script, connections, answer):
    result, made = asyncio.run(_serve(
        script, _chat,
        json.dumps(CHAT).encode(), b"application/json"))
    assert made == connections
    if isinstance(answer, tuple):
        assert result == answer
    else:
        assert isinstance(result, answer)


def test_serving_floor_load_sends_prompts_the_server_has_not_cached(monkeypatch):
    """`serving_floor load` measures prompts that neither its warm-up nor an earlier run on
    the same server sent (a repeat is served from the prefix cache); --seed repeats a run."""
    from benchmarks import serve, serving_floor

    sent: list[list[list[int]]] = []

    async def fake_run(args):
        sent.append([prompt for prompt, _ in serve.make_requests(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio,
            args.vocab_size, args.seed)])
        return {"total_output_tokens": 8, "failed": 0, "median_itl_ms": 1.0,
                "output_throughput": 8.0, "errors": []}

    monkeypatch.setattr(serve, "run", fake_run)
    argv = ["load", "--num-prompts", "6", "--input-len", "16"]
    first, second = serving_floor.main(argv), serving_floor.main(argv)
    warm_1, measured_1, warm_2, measured_2 = sent
    assert len(warm_1) == 4 and len(measured_1) == 6
    assert not set(map(tuple, warm_1)) & set(map(tuple, measured_1))
    assert not set(map(tuple, measured_1)) & set(map(tuple, measured_2 + warm_2))
    assert first["seed"] != second["seed"]
    sent.clear()
    assert serving_floor.main([*argv, "--seed", "5"])["seed"] == 5
    serving_floor.main([*argv, "--seed", "5"])
    assert sent[1] == sent[3]


def test_side_by_side_serves_both_settings_in_one_config_and_alternates_their_turns(
        monkeypatch, tmp_path):
    """`benchmarks.speculation --side-by-side`: one `serve run` of two applications under
    their own route prefixes (each with its setting's builder args, each waited for), and
    every cell measured on both, the order turning with each cell and each pass."""
    from benchmarks import compare, speculation

    model = str(tmp_path)  # a directory: the servers' commands only name it
    args = speculation.parse_args(["--side-by-side", "--passes", "2", "--model", model])
    ns = compare.parse_args(["--model", model, "--servers",
                             "raygen-tp1@speculate=0,raygen-tp1@speculate=4"])
    servers = compare.make_servers(ns)
    started, turns = [], []
    monkeypatch.setattr(compare, "start", lambda server, log: started.append(server) or "proc")
    monkeypatch.setattr(compare, "stop", lambda proc, sig: started.append(proc))

    def fake_measure(cell, args, peer, prefix):
        turns.append((cell, prefix))
        return {"output_tok_s": float(len(turns))}

    monkeypatch.setattr(speculation, "measure", fake_measure)
    cells = [("grounded", 1), ("free", 16)]
    passes = speculation.side_by_side(servers, cells, args, tmp_path)

    both, stopped = started
    assert stopped == "proc"
    config = json.loads(open(both.command[2]).read())
    apps = {a["route_prefix"]: a["args"]["speculate"] for a in config["applications"]}
    assert apps == {"/app0": 0, "/app1": 4}
    assert both.health_paths == ("/app0/health", "/app1/health")
    assert turns == [(("grounded", 1), "/app0"), (("grounded", 1), "/app1"),
                     (("free", 16), "/app1"), (("free", 16), "/app0"),
                     (("grounded", 1), "/app1"), (("grounded", 1), "/app0"),
                     (("free", 16), "/app0"), (("free", 16), "/app1")]
    off, on = (passes[s.key] for s in servers)
    assert [p["free@16"]["output_tok_s"] for p in on] == [3.0, 8.0]
    assert [p["grounded@1"]["output_tok_s"] for p in off] == [1.0, 6.0]
