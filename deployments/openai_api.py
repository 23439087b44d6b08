"""OpenAI's completions and chat completions, as the official `openai` client expects them.
Errors use OpenAI's shape (`{"error": {"message", "type", ...}}`) with status 400."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments.generation import (
    Generation,
    GenerationError,
    collect_all,
    new_request_id,
    stream,
)
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deployments.ingress import Ingress

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class BadRequest(ValueError):
    pass


def error_response(status: int, message: str, error_type: str) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
            422: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    status = 400 if status == 422 else status
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": error_type}}, status_code=status)


def models_json(name: str) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "raygen"}]}


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _prompts(ingress: Ingress, req: CompletionRequest | ChatRequest, chat: bool) -> list[list[int]]:
    tok = ingress.tokenizer
    if chat:
        messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return [tok(text, add_special_tokens=False).input_ids]
    prompt = req.prompt
    if prompt == "" or (isinstance(prompt, list) and any(p == "" for p in prompt)):
        raise BadRequest("prompt must not be empty")
    if isinstance(prompt, str):
        prompts = [tok(prompt).input_ids]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(p) for p in prompt]
    else:
        prompts = [tok(p).input_ids for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise BadRequest("prompt must not be empty")
    vocab = len(tok)
    if any(not 0 <= t < vocab for p in prompts for t in p):
        raise BadRequest(f"prompt token ids must be in [0, {vocab})")
    return prompts


def _params(ingress: Ingress, req, chat: bool, num_prompt_tokens: int) -> SamplingParams:
    limits, args = ingress.limits, ingress.args
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    checks = [
        (0 <= temperature <= 2, "temperature must be between 0 and 2"),
        (0 < top_p <= 1, "top_p must be in (0, 1]"),
        (1 <= req.n <= args.max_n, f"n must be between 1 and {args.max_n}"),
        (-2 <= req.presence_penalty <= 2, "presence_penalty must be between -2 and 2"),
        (-2 <= req.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2"),
    ]
    for ok, message in checks:
        if not ok:
            raise BadRequest(message)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_sequences or any(not s for s in stop):
        raise BadRequest(f"stop must be up to {limits.max_stop_sequences} non-empty strings")
    if chat:
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
    else:
        top_n = req.logprobs or 0
    if not 0 <= top_n <= limits.max_top_n_tokens:
        raise BadRequest(f"logprobs must be between 0 and {limits.max_top_n_tokens}")
    if num_prompt_tokens > limits.max_input_tokens:
        raise BadRequest(f"This model's maximum input length is {limits.max_input_tokens} tokens; "
                         f"the prompt has {num_prompt_tokens}")
    room = limits.max_total_tokens - num_prompt_tokens
    max_tokens = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    if max_tokens is None:
        max_tokens = min(room, 1024) if chat else min(room, DEFAULT_MAX_TOKENS)
    if max_tokens < 1 or max_tokens > room:
        raise BadRequest(f"This model's maximum context length is {limits.max_total_tokens} tokens. "
                         f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                         f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion).")
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, stop=tuple(stop), top_n_tokens=top_n, ignore_eos=req.ignore_eos)


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else ("length" if reason is FinishReason.LENGTH else "stop")


async def handle(ingress: Ingress, request: Request, chat: bool) -> Response:
    try:
        body = await ingress._body(request)
        req = (ChatRequest if chat else CompletionRequest).model_validate(body)
        runs = []
        for prompt_ids in _prompts(ingress, req, chat):
            params = _params(ingress, req, chat, len(prompt_ids))
            for i in range(req.n):
                seed = params.seed + i if params.seed is not None else random.getrandbits(63)
                runs.append(Generation(new_request_id(), prompt_ids,
                                       dataclasses.replace(params, seed=seed)))
        ingress._admit()
    except Exception as exc:
        if isinstance(exc, BadRequest):
            return error_response(400, str(exc), "invalid_request")
        return ingress._error(exc, openai=True)
    rid = new_request_id("chatcmpl-" if chat else "cmpl-")
    want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
    view = _View(ingress, rid, req.model or ingress.args.model_name, chat, want_logprobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(view.events(runs, include_usage), media_type="text/event-stream")
    try:
        await collect_all(ingress.batcher, runs)
        for g in runs:
            ingress._succeeded(g, "chat_completions" if chat else "completions")
        return JSONResponse(view.response(runs))
    except Exception as exc:
        return ingress._error(exc, openai=True)
    finally:
        ingress._release()


@dataclasses.dataclass
class _View:
    ingress: Ingress
    rid: str
    model: str
    chat: bool
    want_logprobs: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "raygen", "choices": choices}

    def _logprobs(self, g: Generation, start: int, end: int) -> dict | None:
        if not self.want_logprobs:
            return None
        decode = self.ingress.tokenizer.decode
        tokens = g.token_texts[start:end]
        if self.chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": decode([i]), "logprob": v, "bytes": list(decode([i]).encode())}
                                  for i, v in top]}
                for t, lp, top in zip(tokens, g.logprobs[start:end], g.top_logprobs[start:end],
                                      strict=True)]}
        offsets, pos = [], len("".join(g.token_texts[:start]))
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": g.logprobs[start:end],
                "top_logprobs": [{decode([i]): v for i, v in top} for top in g.top_logprobs[start:end]],
                "text_offset": offsets}

    def usage(self, runs: list[Generation]) -> dict:
        prompt = sum(len(p) for p in {id(g.prompt_token_ids): g.prompt_token_ids for g in runs}.values())
        completion = sum(len(g.token_ids) for g in runs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def response(self, runs: list[Generation]) -> dict:
        choices = []
        for index, g in enumerate(runs):
            choice: dict[str, Any] = {"index": index, "finish_reason": _finish(g.finish_reason),
                                      "logprobs": self._logprobs(g, 0, len(g.token_ids))}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": g.text}
            else:
                choice["text"] = g.text
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": self.usage(runs)}

    async def events(self, runs: list[Generation], include_usage: bool) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, g: Generation) -> None:
            try:
                async for output in stream(self.ingress.batcher, g):
                    await queue.put((index, output, None))
            except Exception as exc:
                await queue.put((index, None, exc))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(runs)]
        try:
            if self.chat:
                for i in range(len(runs)):
                    yield _sse(self._chunk(i, {"role": "assistant", "content": ""}, None, None))
            remaining = len(runs)
            while remaining:
                index, output, exc = await queue.get()
                if exc is not None:
                    kind = "generation" if isinstance(exc, GenerationError) else "internal"
                    self.ingress._failed(kind)
                    yield _sse({"error": {"message": str(exc), "type": "server_error", "code": kind}})
                    break
                g = runs[index]
                end = len(g.token_ids)
                logprobs = self._logprobs(g, end - len(output.token_ids), end)
                finish = _finish(output.finish_reason) if output.finished else None
                if output.text or finish or logprobs:
                    delta = {"content": output.text} if self.chat else output.text
                    yield _sse(self._chunk(index, delta, finish, logprobs))
                remaining -= output.finished
                if output.finished:
                    self.ingress._succeeded(g, "chat_completions" if self.chat else "completions")
            else:
                if include_usage:
                    yield _sse({**self._envelope([], chunk=True), "usage": self.usage(runs)})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            self.ingress._release()

    def _chunk(self, index: int, delta: Any, finish: str | None, logprobs: dict | None) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta if finish is None or delta.get("content") else {}
        else:
            choice["text"] = delta
        return self._envelope([choice], chunk=True)


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
