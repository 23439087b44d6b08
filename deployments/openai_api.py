"""The OpenAI adapter: completions and chat completions as the official `openai` client
expects them, over the admission layer. Requests become engine generations
(openai_schema.py); outputs become OpenAI's JSON and SSE chunks. Errors use OpenAI's shape
(`{"error": {"message", "type", ...}}`), with 400 where TGI would say 422."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployments import openai_schema as schema
from deployments import openai_tools as tools
from deployments.adapters import AdapterNotFound, Adapters
from deployments.admission import Admission
from deployments.config import Limits
from deployments.generation import (
    Generation,
    GenerationError,
    collect_all,
    new_request_id,
    stream,
)
from deployments.grammar import GrammarChecker, InvalidGrammar
from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason
from shards.checkpoints.adapters import AdapterError


def error_response(status: int, message: str, error_type: str) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
            422: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    status = 400 if status == 422 else status
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": error_type}}, status_code=status)


def models_json(name: str, adapters: Iterable[str] = (), max_model_len: int | None = None
                ) -> dict:
    """The base model, then each LoRA adapter with the base as its parent, each with the
    longest sequence it takes (as vLLM lists them: clients size prompts by it)."""
    card = {"object": "model", "created": 0, "owned_by": "raygen", "root": name,
            "max_model_len": max_model_len}
    return {"object": "list", "data": [
        {"id": name, **card, "parent": None},
        *({"id": a, **card, "parent": name} for a in adapters)]}


def not_found(message: str) -> JSONResponse:
    """vLLM's answer to a model (or LoRA adapter) it does not serve."""
    return JSONResponse({"error": {"message": message, "type": "NotFoundError",
                                   "param": None, "code": 404}}, status_code=404)


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else ("length" if reason is FinishReason.LENGTH else "stop")


class OpenAIApi:
    def __init__(self, admission: Admission, grammars: GrammarChecker, batcher, tokenizer: Any,
                 limits: Limits, max_n: int, model_name: str, adapters: Adapters | None = None):
        self.admission = admission
        self.adapters = adapters  # the LoRA adapters, refreshed before a request names one
        self.grammars = grammars
        self.batcher = batcher  # a streaming handle
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_n = max_n
        self.model_name = model_name

    def error(self, exc: Exception) -> JSONResponse:
        return error_response(*self.admission.failure(exc))

    async def _listed(self, request: Request) -> list[dict]:
        """The model cards /v1/models lists, the adapters loaded anywhere included."""
        self.admission.check_auth(request)
        if self.adapters is not None:
            await self.adapters.refresh()
        return models_json(self.model_name, list(self.limits.adapters),
                           self.limits.max_total_tokens)["data"]

    async def models(self, request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": await self._listed(request)})
        except Exception as exc:
            return self.error(exc)

    async def model(self, request: Request, name: str) -> Response:
        """GET /v1/models/{name}: the base model or a LoRA adapter, as /v1/models lists it
        (the `openai` client's `models.retrieve`); 404 for a name it does not list."""
        try:
            cards = await self._listed(request)
        except Exception as exc:
            return self.error(exc)
        return next((JSONResponse(card) for card in cards if card["id"] == name),
                    not_found(f"The model `{name}` does not exist."))

    async def load_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter: serve the adapter at `lora_path` as
        `lora_name`; batcher replicas load it with the first request of it they get."""
        try:
            req = await self.admission.read(request, schema.LoadLoRAAdapter)
            if self.adapters is None:
                raise schema.bad("LoRA adapters cannot be loaded here")
            await self.adapters.load(req.lora_name, req.lora_path)
        except (AdapterError, ValueError) as exc:
            return error_response(400, str(exc), "BadRequestError")
        except Exception as exc:
            return self.error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter: requests may no longer name it (batcher
        replicas drop it once none of its requests is left)."""
        try:
            req = await self.admission.read(request, schema.UnloadLoRAAdapter)
            if self.adapters is None:
                raise AdapterNotFound(f"The lora adapter '{req.lora_name}' cannot be found.")
            await self.adapters.unload(req.lora_name)
        except AdapterNotFound as exc:
            return not_found(str(exc))
        except ValueError as exc:
            return error_response(400, str(exc), "BadRequestError")
        except Exception as exc:
            return self.error(exc)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def adapter(self, model: str | None) -> str | None:
        """The id of the LoRA adapter that `model` names (`name`, or `base:name` as Ray
        Serve LLM names it), None for the base model. With adapters loaded, any other name
        is an unknown model; without, `model` is not checked (as TGI's OpenAI routes)."""
        if model is None or model == self.model_name:
            return None
        base, colon, name = model.partition(":")
        if not colon or base != self.model_name:
            name = model
        if self.adapters is not None:
            await self.adapters.resolve(name)
        if name in self.limits.adapters:
            return self.limits.adapters[name][0]
        if colon or self.limits.adapters:
            raise AdapterNotFound(f"The model `{model}` does not exist.")
        return None

    async def tokenize(self, body: Any) -> Response:
        """vLLM's POST /tokenize (the body read): a prompt's or a chat's token ids, their
        count against the longest sequence served, and with `return_token_strs` the
        tokenizer's own strings for them."""
        try:
            if "messages" in body:
                req = self.admission.parse(body, schema.ChatTokenize)
                schema.refuse_unsupported(req)  # a request's own chat_template, say
                text = schema.chat_text(self.tokenizer, req)
            else:
                req = self.admission.parse(body, schema.CompletionTokenize)
                text = req.prompt
            ids = self.tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids
        except Exception as exc:
            return self.error(exc)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.limits.max_total_tokens,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's POST /detokenize: the text of token ids."""
        try:
            req = await self.admission.read(request, schema.Detokenize)
            vocab = schema.vocab_size(self.tokenizer)
            if any(not 0 <= t < vocab for t in req.tokens):
                raise schema.bad(f"tokens must be token ids in [0, {vocab})")
        except Exception as exc:
            return self.error(exc)
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    async def _grammar(self, req, chat: bool) -> tuple[str | None, bool]:
        """(the grammar of `tools` or of `response_format`, checked, or None for free text;
        whether the output is a tool call)."""
        constraint = tools.tool_grammar(req) if chat else None
        tool_calls = constraint is not None
        if constraint is None:
            constraint = schema.response_grammar(req)
        if constraint is None:
            return None, False
        if req.ignore_eos:
            raise schema.bad("ignore_eos cannot be used with response_format or tools")
        if req.min_tokens:
            raise schema.bad("min_tokens cannot be used with response_format or tools: "
                             "the grammar decides where the output ends")
        if req.allowed_token_ids is not None or req.bad_words:
            raise schema.bad("allowed_token_ids and bad_words cannot be used with "
                             "response_format or tools: the grammar decides what may be drawn")
        try:
            await self.grammars.check(constraint)
        except InvalidGrammar as exc:
            raise schema.bad(f"Invalid grammar: {exc}") from exc
        return constraint, tool_calls

    async def create(self, request: Request, chat: bool, body: Any = None) -> Response:
        """POST /v1/completions (chat=False) or /v1/chat/completions (chat=True); `body`:
        the JSON already read (/invocations)."""
        try:
            model = schema.ChatRequest if chat else schema.CompletionRequest
            req = (self.admission.parse(body, model) if body is not None
                   else await self.admission.read(request, model))
            runs, echoes, tool_calls = await self.runs(req, chat)
            self.admission.admit()
        except AdapterNotFound as exc:
            return not_found(str(exc))
        except Exception as exc:
            return self.error(exc)
        prefix = "chatcmpl-" if chat else "cmpl-"
        # vLLM's request_id, else the X-Request-Id that Serve's proxy sets (the client's
        # if it sent one, else the id in Serve's request logs)
        given = req.request_id or request.headers.get("x-request-id")
        rid = prefix + given if given else new_request_id(prefix)
        want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        view = _View(self, rid, req.model or self.model_name, chat, want_logprobs,
                     tool_calls, echoes, req.prompt_logprobs,
                     bool(req.return_tokens_as_token_ids), req.return_token_ids)
        if req.stream:
            options = req.stream_options or schema.StreamOptions()
            return StreamingResponse(view.events(runs, options.include_usage,
                                                 options.continuous_usage_stats),
                                     media_type="text/event-stream")
        try:
            await collect_all(self.batcher, runs)
            for g in runs:
                self.admission.succeeded(g, view.route)
            return JSONResponse(view.response(runs))
        except Exception as exc:
            return self.error(exc)
        finally:
            self.admission.release()

    async def runs(self, req: schema.CompletionRequest | schema.ChatRequest, chat: bool
                   ) -> tuple[list[Generation], list[_Echo | None], bool]:
        """The generations a request asks for (n per prompt), checked, not yet admitted;
        per run what `echo` puts first; whether the output is a tool call."""
        adapter = await self.adapter(req.model)
        constraint, tool_calls = await self._grammar(req, chat)
        runs, echoes = [], []
        sent = schema.prompts(self.tokenizer, req, chat)
        prompt_ids_list = [schema.truncated(self.limits, req, ids) for ids in sent]
        # an echo of a prompt cut short is its kept tokens' text, not the client's
        texts = [text if len(kept) == len(ids) else None for text, kept, ids in
                 zip(schema.prompt_texts(req), prompt_ids_list, sent, strict=True)
                 ] if not chat and req.echo else []
        rules = schema.vocabulary_rules(self.tokenizer, req)
        for k, prompt_ids in enumerate(prompt_ids_list):
            params = dataclasses.replace(
                schema.params(self.limits, self.max_n, req, chat, len(prompt_ids)), **rules)
            schema.check_token_ids(self.tokenizer, params, self.limits.eos_token_ids)
            echo = (_Echo.of(self.tokenizer, prompt_ids, texts[k], req.logprobs or 0,
                             schema.prompt_only(req, chat)) if texts else None)
            if tool_calls:  # parsed from the text: without the end token's, which is
                # all that skip_special_tokens=false would add to a call's JSON
                params = dataclasses.replace(params, skip_special_tokens=True)
            for i in range(req.n):
                seed = params.seed + i if params.seed is not None else random.getrandbits(63)
                runs.append(Generation(new_request_id(), prompt_ids, dataclasses.replace(
                    params, seed=seed, grammar=constraint, adapter=adapter)))
                echoes.append(echo)
        return runs, echoes, tool_calls


@dataclasses.dataclass(frozen=True)
class _Echo:
    """What `echo` puts before a completion: the prompt as the client sent it (its text, or
    the decode of its ids), the prompt's tokens as text and where each starts in it. `only`:
    no completion after it (`max_tokens: 0`; the token drawn is dropped)."""

    text: str
    pieces: list[str]
    offsets: list[int]
    top_n: int = 0  # alternatives at each prompt token (`logprobs`)
    only: bool = False

    @classmethod
    def of(cls, tokenizer: Any, prompt_ids: list[int], text: str | None, top_n: int = 0,
           only: bool = False) -> _Echo:
        pieces = _pieces(tokenizer, prompt_ids, skip_special_tokens=False)
        offsets = _offsets(pieces, 0)
        if text is not None:  # special tokens the tokenizer added (a BOS) are not in it
            plain = _pieces(tokenizer, prompt_ids, skip_special_tokens=True)
            if "".join(plain) == text:
                offsets = _offsets(plain, 0)
        return cls("".join(pieces) if text is None else text, pieces, offsets, top_n, only)


def _pieces(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """Each token's text, as streaming would give it: the pieces join to the decode."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    pieces = [detok.step(t) for t in ids]
    pieces[-1] += detok.flush()
    return pieces


def _offsets(pieces: list[str], start: int) -> list[int]:
    offsets = []
    for piece in pieces:
        offsets.append(start)
        start += len(piece)
    return offsets


@dataclasses.dataclass
class _View:
    api: OpenAIApi
    rid: str
    model: str
    chat: bool
    want_logprobs: bool
    tool_calls: bool  # the output is a tool call (openai_tools.py)
    echoes: list[_Echo | None]  # per run, with `echo`: the prompt to put first
    prompt_logprobs: int | None  # vLLM's: alternatives with each prompt token's logprob
    # vLLM's: logprobs name tokens "token_id:ID", not by their text (which may not be
    # valid UTF-8 alone, or may not say which of two tokens it was)
    token_ids_as_names: bool = False
    # vLLM's return_token_ids: the prompt's ids (a completion's choice, or a chat response)
    # and each choice's output ids; streamed, the prompt's in the first chunk and each
    # chunk's own output ids
    token_ids: bool = False
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.token_ids_as_names else \
            self.api.tokenizer.decode([token])

    @property
    def route(self) -> str:
        return "chat_completions" if self.chat else "completions"

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "raygen", "choices": choices}

    def _logprobs(self, index: int, g: Generation, start: int, end: int) -> dict | None:
        """The logprobs of output tokens start..end of run `index` (`g`); with `echo`, and
        start 0, its prompt's before them (the first prompt token has none)."""
        if not self.want_logprobs:
            return None
        if self._prompt_only(index):
            end = start
        name = self._name
        texts = g.token_texts[start:end]  # what the offsets count, in the text returned
        tokens = [name(t) for t in g.token_ids[start:end]] if self.token_ids_as_names \
            else texts
        if self.chat:
            return {"content": [
                {"token": t, "logprob": _floor(lp), "bytes": list(t.encode()),
                 "top_logprobs": [{"token": name(i), "logprob": _floor(v),
                                   "bytes": list(name(i).encode())} for i, v in top]}
                for t, lp, top in zip(tokens, g.logprobs[start:end], g.top_logprobs[start:end],
                                      strict=True)]}
        echo = self.echoes[index]
        shift = len(echo.text) if echo else 0
        out = {"tokens": tokens, "token_logprobs": [_floor(lp) for lp in g.logprobs[start:end]],
               "top_logprobs": [{name(i): _floor(v) for i, v in top}
                                for top in g.top_logprobs[start:end]],
               "text_offset": _offsets(texts, shift + len("".join(g.token_texts[:start])))}
        if echo is None or start:
            return out
        tops = g.prompt_top_logprobs or [None] + [[]] * (len(echo.pieces) - 1)
        pieces = [name(t) for t in g.prompt_token_ids] if self.token_ids_as_names \
            else echo.pieces
        return {"tokens": pieces + out["tokens"],
                "token_logprobs": [_floor(lp) for lp in g.prompt_logprobs]
                + out["token_logprobs"],
                "top_logprobs": [None if top is None else
                                 {name(i): _floor(v) for i, v in top[:echo.top_n]}
                                 for top in tops] + out["top_logprobs"],
                "text_offset": echo.offsets + out["text_offset"]}

    def _prompt_only(self, index: int) -> bool:
        echo = self.echoes[index]
        return echo is not None and echo.only

    def _finish(self, index: int, g: Generation) -> str | None:
        return "length" if self._prompt_only(index) else _finish(g.finish_reason)

    def _stop_reason(self, index: int, g: Generation) -> str | int | None:
        """vLLM's: the stop string or stop token id that ended the choice, else None."""
        return None if self._prompt_only(index) else g.stop_reason

    def _text(self, index: int, text: str, first: bool) -> str:
        """A completion's text (or a streamed piece of it) as returned: with `echo`, the
        prompt before the first piece; none of it with `max_tokens: 0`."""
        echo = self.echoes[index]
        if echo is None:
            return text
        return (echo.text if first else "") + ("" if echo.only else text)

    def usage(self, runs: list[Generation]) -> dict:
        firsts = list({id(g.prompt_token_ids): g for g in reversed(runs)}.values())  # per prompt
        prompt = sum(len(g.prompt_token_ids) for g in firsts)
        completion = sum(len(g.token_ids) for i, g in enumerate(runs) if not self._prompt_only(i))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(g.num_cached_tokens for g in firsts)}}

    def response(self, runs: list[Generation]) -> dict:
        choices = []
        for index, g in enumerate(runs):
            choice: dict[str, Any] = {"index": index, "finish_reason": self._finish(index, g),
                                      "stop_reason": self._stop_reason(index, g),
                                      "logprobs": self._logprobs(index, g, 0, len(g.token_ids))}
            if self.tool_calls:
                content, calls = tools.message(g.text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:  # "length" where max_tokens cut the call short, as streamed
                    choice["message"]["tool_calls"] = calls
                    if tools.parse(g.text) is not None:
                        choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": g.text}
            else:
                choice["text"] = self._text(index, g.text, first=True)
                if self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._ranked_prompt(g)
            if self.token_ids:
                choice["token_ids"] = [] if self._prompt_only(index) else g.token_ids
                if not self.chat:
                    choice["prompt_token_ids"] = g.prompt_token_ids
            choices.append(choice)
        body = {**self._envelope(choices, chunk=False), "usage": self.usage(runs)}
        if self.chat and self.prompt_logprobs is not None:  # one prompt: vLLM puts it here
            body["prompt_logprobs"] = self._ranked_prompt(runs[0])
        if self.chat and self.token_ids:
            body["prompt_token_ids"] = runs[0].prompt_token_ids
        return body

    def _ranked_prompt(self, g: Generation) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first), by token id, its
        logprob, rank and text, and the best alternatives' (ranks 1, 2, ...)."""
        decode = self.api.tokenizer.decode

        def entry(token: int, logprob: float, rank: int) -> dict:
            return {"logprob": _floor(logprob), "rank": rank,
                    "decoded_token": decode([token])}

        tops = g.prompt_top_logprobs or [[] for _ in g.prompt_token_ids]
        ranked: list[dict | None] = [None]
        for i in range(1, len(g.prompt_token_ids)):
            token = g.prompt_token_ids[i]
            at = {str(token): entry(token, g.prompt_logprobs[i], g.prompt_ranks[i])}
            for rank, (alt, logprob) in enumerate(tops[i][:self.prompt_logprobs], start=1):
                at.setdefault(str(alt), entry(alt, logprob, rank))
            ranked.append(at)
        return ranked

    async def events(self, runs: list[Generation], include_usage: bool,
                     continuous: bool = False) -> AsyncIterator[bytes]:
        """SSE chunks as outputs come; with vLLM's continuous_usage_stats, each chunk carries
        its choice's usage so far."""
        queue: asyncio.Queue = asyncio.Queue()

        def sse(payload: dict, index: int, end: int = 0) -> bytes:
            if include_usage and continuous:
                g = runs[index]
                done = 0 if self._prompt_only(index) else end
                payload["usage"] = {"prompt_tokens": len(g.prompt_token_ids),
                                    "completion_tokens": done,
                                    "total_tokens": len(g.prompt_token_ids) + done}
            return _sse(payload)

        async def pump(index: int, g: Generation) -> None:
            # Each output goes with how many tokens `g` held once it was added: `g` runs
            # ahead of the queue, so its length when an output is taken may count later ones.
            try:
                async for output in stream(self.api.batcher, g):
                    await queue.put((index, output, len(g.token_ids), None))
            except Exception as exc:
                await queue.put((index, None, 0, exc))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(runs)]
        calls = [tools.CallStream() for _ in runs]
        # return_token_ids: output ids not yet sent, per choice (a chunk goes out only once
        # its tokens make text, so a token may wait for the next)
        unsent: list[list[int]] = [[] for _ in runs]
        prompt_sent = [False] * len(runs)

        def ids(index: int, choice: dict) -> dict:
            if self.token_ids:
                if not (self.chat or prompt_sent[index]):
                    choice["prompt_token_ids"] = runs[index].prompt_token_ids
                    prompt_sent[index] = True
                choice["token_ids"], unsent[index] = unsent[index], []
            return choice

        try:
            if self.chat:
                for i in range(len(runs)):
                    first = self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                    if self.token_ids and i == 0:  # vLLM's: in the first chunk only
                        first["prompt_token_ids"] = runs[0].prompt_token_ids
                    yield sse(first, i)
            remaining = len(runs)
            while remaining:
                index, output, end, exc = await queue.get()
                if exc is not None:
                    kind = "generation" if isinstance(exc, GenerationError) else "internal"
                    self.api.admission.failed(kind)
                    yield _sse({"error": {"message": str(exc), "type": "server_error",
                                          "code": kind}})
                    break
                g = runs[index]
                start = end - len(output.token_ids)
                logprobs = self._logprobs(index, g, start, end)
                finish = self._finish(index, g) if output.finished else None
                if not self._prompt_only(index):
                    unsent[index] += output.token_ids
                if self.tool_calls:
                    for delta, why, lp in calls[index].chunks(output, finish, logprobs):
                        yield sse(self._envelope([ids(index, {
                            "index": index, "delta": delta, "finish_reason": why,
                            "stop_reason": None, "logprobs": lp})], chunk=True), index, end)
                else:
                    text = self._text(index, output.text, first=start == 0)
                    if text or finish or logprobs:
                        delta = {"content": text} if self.chat else text
                        chunk = self._chunk(index, delta, finish, logprobs)
                        if finish:
                            chunk["choices"][0]["stop_reason"] = self._stop_reason(index, g)
                        ids(index, chunk["choices"][0])
                        yield sse(chunk, index, end)
                remaining -= output.finished
                if output.finished:
                    self.api.admission.succeeded(g, self.route)
            else:
                if include_usage:
                    yield _sse({**self._envelope([], chunk=True), "usage": self.usage(runs)})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            self.api.admission.release()

    def _chunk(self, index: int, delta: Any, finish: str | None, logprobs: dict | None) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish,
                                  "stop_reason": None, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta if finish is None or delta.get("content") else {}
        else:
            choice["text"] = delta
        return self._envelope([choice], chunk=True)


def _floor(logprob: float | None) -> float | None:
    """vLLM's floor for a logprob in JSON: a token a grammar or a rule masks has -inf, which
    JSON cannot carry (the response failed with a 500 once generated)."""
    return logprob if logprob is None else max(logprob, -9999.0)


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n".encode()
