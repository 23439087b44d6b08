"""The TGI adapter: /generate, /generate_stream, / and /tokenize as TGI's clients expect
them, over the admission layer. Requests are checked by TGI's rules (tgi.py) and become
engine generations; outputs become TGI's JSON, headers and SSE events. Errors use TGI's
shape (`{"error", "error_type"}`), 422 for a request TGI would refuse."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments import openai_schema, tgi
from deployments.adapters import Adapters
from deployments.admission import Admission, ApiError
from deployments.config import Limits
from deployments.generation import (
    Generation,
    GenerationError,
    collect_all,
    new_request_id,
    reseeded,
    stream,
)
from deployments.grammar import GrammarChecker, InvalidGrammar
from engine.request import FinishReason

logger = logging.getLogger("ray.serve")


def finish_reason(g: Generation) -> str:
    """TGI's: a generation that drew `max_new_tokens` tokens ended by its length, whatever
    its last token (TGI checks the length before EOS and stop sequences; the engine lets
    EOS, a stop token and a stop string that end there win, as vLLM does)."""
    if len(g.token_ids) >= g.params.max_new_tokens:
        return FinishReason.LENGTH.value
    return g.finish_reason.value


def sse(payload: Any) -> bytes:
    return f"data:{json.dumps(payload, allow_nan=False)}\n\n".encode()


class TGIApi:
    def __init__(self, admission: Admission, grammars: GrammarChecker, batcher, tokenizer: Any,
                 limits: Limits, device: str, adapters: Adapters | None = None):
        self.admission = admission
        self.adapters = adapters  # the LoRA adapters, refreshed before a request names one
        self.grammars = grammars
        self.batcher = batcher  # a streaming handle
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        self.limits = limits
        self.device = device

    def error(self, exc: Exception) -> JSONResponse:
        failure = self.admission.failure(exc)
        return JSONResponse(tgi.error_json(failure.message, failure.error_type),
                            status_code=failure.status)

    async def generate(self, request: Request, stream_tokens: bool | None,
                       body: Any = None) -> Response:
        """POST /generate (False), /generate_stream (True) or / (None: the body's `stream`);
        `body`: the JSON already read (/invocations)."""
        start = time.monotonic()
        compat = stream_tokens is None
        try:
            req = (self.admission.parse(body, tgi.TGIRequest) if body is not None
                   else await self.admission.read(request, tgi.TGIRequest))
            if compat:
                stream_tokens = req.stream
            try:
                if req.parameters.adapter_id and self.adapters is not None:
                    await self.adapters.resolve(req.parameters.adapter_id)
                valid = tgi.validate(req, self.tokenizer, self.limits, stream_tokens)
                if valid.params.grammar is not None:
                    await self.grammars.check(valid.params.grammar)
            except InvalidGrammar as exc:
                raise ApiError(422, f"Invalid grammar: {exc}", "validation") from exc
            except tgi.ValidationError as exc:
                raise ApiError(422, str(exc), "validation") from exc
            self.admission.admit()
        except Exception as exc:
            return self.error(exc)
        validation_time = time.monotonic() - start
        if stream_tokens:
            return StreamingResponse(self._events(req, valid), media_type="text/event-stream")
        try:
            response = await self._response(req, valid, start, validation_time)
            if compat:  # TGI's `/` answers a list of one, as the Inference API did
                response.body = b"[" + response.body + b"]"
                response.headers["content-length"] = str(len(response.body))
            return response
        except Exception as exc:
            return self.error(exc)
        finally:
            self.admission.release()

    async def tokenize(self, body: Any) -> Response:
        """POST /tokenize (the body read): the prompt's tokens with their character offsets;
        with `parameters.truncate`, the last that many, as /generate would keep (TGI's)."""
        try:
            req = self.admission.parse(body, tgi.TGIRequest)
        except Exception as exc:
            return self.error(exc)
        tokens = self._tokens(req.inputs, req.add_special_tokens)
        if req.parameters.truncate is not None:
            tokens = tokens[-req.parameters.truncate :] if req.parameters.truncate else []
        return JSONResponse(tokens)

    async def chat_tokenize(self, request: Request) -> Response:
        """POST /chat_tokenize: a chat request's messages through the chat template, and
        that text's tokens (TGI's)."""
        try:
            req = await self.admission.read(request, openai_schema.ChatRequest)
            text = openai_schema.chat_text(self.tokenizer, req)
        except Exception as exc:
            return self.error(exc)
        return JSONResponse({"tokenize_response": self._tokens(text, False),
                             "templated_text": text})

    def _tokens(self, text: str, add_special_tokens: bool) -> list[dict]:
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens,
                             return_offsets_mapping=True)
        return [{"id": t, "text": text[a:b], "start": a, "stop": b}
                for t, (a, b) in zip(enc.input_ids, enc.offset_mapping, strict=True)]

    # -- responses -------------------------------------------------------------------
    async def _response(self, req, valid, start, validation_time) -> Response:
        runs = [Generation(new_request_id(), valid.prompt_token_ids, valid.params)]
        for _ in range(valid.best_of - 1):  # best_of: independent samples, different seeds
            runs.append(Generation(new_request_id(), valid.prompt_token_ids,
                                   reseeded(valid.params)))
        await collect_all(self.batcher, runs)
        best = max(runs, key=lambda g: g.sum_logprob)
        for g in runs:
            self.admission.succeeded(g, "generate", validation_time)
        p = req.parameters
        body: dict[str, Any] = {"generated_text": self._full_text(req, best)}
        if p.details or p.decoder_input_details:
            body["details"] = self._details(best, valid, p.decoder_input_details)
            if valid.best_of > 1:
                body["details"]["best_of_sequences"] = [
                    {**self._details(g, valid, p.decoder_input_details),
                     "generated_text": self._full_text(req, g)} for g in runs if g is not best]
        return JSONResponse(body, headers=self._headers(best, start, validation_time))

    async def _events(self, req: tgi.TGIRequest, valid) -> AsyncIterator[bytes]:
        g = Generation(new_request_id(), valid.prompt_token_ids, valid.params)
        index = 0
        try:
            async for output in stream(self.batcher, g):
                for i, token_id in enumerate(output.token_ids):
                    index += 1
                    last = output.finished and i == len(output.token_ids) - 1
                    yield sse({
                        "index": index,
                        "token": self._token(token_id, output.token_texts[i], output.logprobs[i]),
                        "top_tokens": [self._token(t, self.tokenizer.decode([t]), lp)
                                       for t, lp in output.top_logprobs[i]],
                        "generated_text": self._full_text(req, g) if last else None,
                        "details": {"finish_reason": finish_reason(g),
                                    "generated_tokens": len(g.token_ids),
                                    "seed": g.params.seed if valid.sampling else None,
                                    "input_length": len(g.prompt_token_ids)} if last else None,
                    })
            self.admission.succeeded(g, "generate_stream")
        except GenerationError as exc:
            self.admission.failed("generation")
            yield sse(tgi.error_json(str(exc), "generation"))
        except Exception as exc:  # never cut a stream without saying why
            logger.exception("stream failed")
            self.admission.failed("internal")
            yield sse(tgi.error_json(f"{type(exc).__name__}: {exc}"[:500], "generation"))
        finally:
            self.admission.release()

    def _token(self, token_id: int, text: str, logprob: float | None) -> dict:
        special = token_id in self.special_ids
        if special:
            text = self.tokenizer.convert_ids_to_tokens(token_id)
        return tgi.token_json(token_id, text, logprob, special)

    def _details(self, g: Generation, valid, prefill: bool) -> dict:
        details = {
            "finish_reason": finish_reason(g),
            "generated_tokens": len(g.token_ids),
            "seed": g.params.seed if valid.sampling else None,
            "prefill": [],
            "tokens": [self._token(t, s, lp) for t, s, lp in
                       zip(g.token_ids, g.token_texts, g.logprobs, strict=True)],
            "top_tokens": [[self._token(t, self.tokenizer.decode([t]), lp) for t, lp in top]
                           for top in g.top_logprobs] if g.params.top_n_tokens else None,
        }
        if prefill and g.prompt_logprobs is not None:
            details["prefill"] = [
                {"id": t, "text": self.tokenizer.decode([t]), "logprob": tgi.finite(lp)}
                for t, lp in zip(g.prompt_token_ids, g.prompt_logprobs, strict=True)]
        return details

    @staticmethod
    def _full_text(req: tgi.TGIRequest, g: Generation) -> str:
        return (req.inputs + g.text) if req.parameters.return_full_text else g.text

    def _headers(self, g: Generation, start: float, validation_time: float) -> dict[str, str]:
        total = time.monotonic() - start
        n = max(1, len(g.token_ids))
        return {
            "x-compute-type": self.device,
            "x-compute-time": f"{total:.6f}",
            "x-total-time": str(int(total * 1000)),
            "x-validation-time": str(int(validation_time * 1000)),
            "x-queue-time": str(int(g.queue_time * 1000)),
            "x-inference-time": str(int(g.inference_time * 1000)),
            "x-time-per-token": str(int(g.inference_time * 1000 / n)),
            "x-prompt-tokens": str(len(g.prompt_token_ids)),
            "x-generated-tokens": str(len(g.token_ids)),
        }
