"""OpenAI's Responses API, `POST /v1/responses`, stateless: a text answer to `input` (a
string, or messages of text) under `instructions`, streamed as its typed events or whole.

It runs on the chat path: the request becomes a chat request (instructions as the system
message, `max_output_tokens`, `temperature`, `top_p`, `text.format` as `response_format`),
checked and generated as one. Nothing is stored, so `store: true`, `previous_response_id`
and `conversation` are refused, as are tools, reasoning, background runs and logprobs: every
field that would change the output is honoured or refused by name, never ignored."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from deployments import openai_schema as schema
from deployments.adapters import AdapterNotFound
from deployments.admission import Admission
from deployments.generation import Generation, GenerationError, collect_all, new_request_id, stream
from deployments.openai_api import OpenAIApi, not_found
from engine.request import FinishReason

ROUTE = "responses"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


# Fields that change nothing in the output (routing and accounting hints, echoed labels).
_INERT = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
          "service_tier", "stream_options"}
# Fields whose other values this server does not implement: refused unless at these.
_NEUTRAL: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "auto", "none"),
    "parallel_tool_calls": (None, True, False), "include": (None, []),
    "store": (None, False), "background": (None, False), "truncation": (None, "disabled"),
    "top_logprobs": (None, 0), "previous_response_id": (None,), "conversation": (None,),
    "reasoning": (None,), "prompt": (None,), "max_tool_calls": (None,),
}
_TEXT_PARTS = {"input_text", "output_text", "text"}


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in _INERT:
            continue
        neutral = _NEUTRAL.get(name, (None, False, [], {}))
        if not any(schema._same(value, n) for n in neutral):
            raise schema.bad(f"{name} is not supported on /v1/responses" +
                             (" (responses are not stored)" if name in (
                                 "store", "previous_response_id", "conversation") else ""))
    fmt = (req.text or {}).get("format")
    if set(req.text or {}) - {"format"} - {"verbosity"} or \
            (req.text or {}).get("verbosity") not in (None, "medium"):
        raise schema.bad("text supports only format on /v1/responses")
    if fmt is not None and (not isinstance(fmt, dict) or
                            fmt.get("type") not in ("text", "json_object", "json_schema")):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise schema.bad(f"text.format of type {kind!r} is not supported")


def _message(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as a chat message: a message of text, nothing else."""
    kind = item.get("type", "message")
    if kind != "message":
        raise schema.bad(f"input items of type {kind!r} are not supported on /v1/responses")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise schema.bad(f"content parts of type {kind!r} are not supported: this "
                                 "model takes text only")
            texts.append(part["text"])
        content = "".join(texts)
    return {"role": item.get("role"), "content": content}


def chat_request(req: ResponsesRequest) -> schema.ChatRequest:
    """The chat request that asks for the same answer."""
    _refuse_unsupported(req)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) \
        else [_message(item) for item in req.input]
    if req.instructions is not None:
        items.insert(0, {"role": "system", "content": req.instructions})
    fmt = (req.text or {}).get("format") or {"type": "text"}
    response_format = None
    if fmt["type"] == "json_object":
        response_format = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    return Admission.parse({
        "model": req.model, "messages": items, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "response_format": response_format}, schema.ChatRequest)


class ResponsesApi:
    def __init__(self, openai: OpenAIApi):
        self.openai = openai
        self.admission = openai.admission

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        try:
            req = await self.admission.read(request, ResponsesRequest)
            (g,), _, _ = await self.openai.runs(chat_request(req), chat=True)
            self.admission.admit()
        except AdapterNotFound as exc:
            return not_found(str(exc))
        except Exception as exc:
            return self.openai.error(exc)
        view = _View(req, req.model or self.openai.model_name, g)
        if req.stream:
            return StreamingResponse(self._events(view), media_type="text/event-stream")
        try:
            await collect_all(self.openai.batcher, [g])
            self.admission.succeeded(g, ROUTE)
            return JSONResponse(view.response())
        except Exception as exc:
            return self.openai.error(exc)
        finally:
            self.admission.release()

    async def _events(self, view: _View) -> AsyncIterator[bytes]:
        g = view.g
        outputs = stream(self.openai.batcher, g)
        try:
            yield view.event("response.created", response=view.response("in_progress"))
            yield view.event("response.in_progress", response=view.response("in_progress"))
            yield view.event("response.output_item.added", output_index=0,
                             item=view.message("in_progress", with_text=False))
            yield view.event("response.content_part.added", **view.where(),
                             part=view.part(""))
            async for output in outputs:
                if output.text:
                    yield view.event("response.output_text.delta", **view.where(),
                                     delta=output.text, logprobs=[])
            self.admission.succeeded(g, ROUTE)
            yield view.event("response.output_text.done", **view.where(), text=g.text,
                             logprobs=[])
            yield view.event("response.content_part.done", **view.where(),
                             part=view.part(g.text))
            yield view.event("response.output_item.done", output_index=0,
                             item=view.message(view.status()))
            done = view.response()
            yield view.event(f"response.{done['status']}", response=done)
        except Exception as exc:  # the answer could not be finished: say so, in its events
            kind = "generation" if isinstance(exc, GenerationError) else "internal"
            self.admission.failed(kind)
            failed = view.response("failed")
            failed["error"] = {"code": "server_error", "message": str(exc)}
            yield view.event("response.failed", response=failed)
        finally:
            await outputs.aclose()  # a client that left: its request ends now, not at GC
            self.admission.release()


class _View:
    """One response's JSON: the whole object, its message, and its stream's events."""

    def __init__(self, req: ResponsesRequest, model: str, g: Generation):
        self.req, self.model, self.g = req, model, g
        self.id = new_request_id("resp_")
        self.item_id = new_request_id("msg_")
        self.created_at = int(time.time())
        self.sequence_number = 0

    def status(self) -> str:
        return "incomplete" if self.g.finish_reason is FinishReason.LENGTH else "completed"

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, status: str, with_text: bool = True) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [self.part(self.g.text)] if with_text else []}

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def response(self, status: str | None = None) -> dict[str, Any]:
        status = status or self.status()
        g, req = self.g, self.req
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": [], "parallel_tool_calls": True,
            "temperature": g.params.temperature, "top_p": g.params.top_p,
            "tool_choice": "auto", "tools": [], "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": None, "metadata": req.metadata or {},
            "usage": None}
        if status in ("completed", "incomplete"):
            body["output"] = [self.message(status)]
            cached = g.num_cached_tokens
            body["usage"] = {
                "input_tokens": len(g.prompt_token_ids),
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": len(g.token_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(g.prompt_token_ids) + len(g.token_ids)}
        return body

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, allow_nan=False)}\n\n".encode()
