"""The HTTP front: TGI's routes here, OpenAI's in openai_api.py.

Every request is checked before it reaches a batcher: API key, payload size, strict JSON
(no NaN/Infinity), TGI's validation rules, and the concurrency cap (429 past it)."""

# No `from __future__ import annotations` here: FastAPI must see real annotations through
# Serve's class-based routes.

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError as PydanticError
from ray import serve
from transformers import AutoTokenizer

from deployments import openai_api, tgi
from deployments.config import DEMO_MODEL, AppArgs, token_limits
from deployments.generation import (
    Generation,
    GenerationError,
    ReplicaUnavailable,
    collect_all,
    new_request_id,
    reseeded,
    stream,
)
from deployments.metrics import INGRESS, Metrics
from shards.demo_model import ensure_demo_model
from shards.model_config import ModelConfig

logger = logging.getLogger("ray.serve")
app = FastAPI(title="raygen", summary="TGI- and OpenAI-compatible text generation on Ray Serve")
# Routes read raw bodies (payload limit, strict JSON, TGI-shaped errors), so FastAPI cannot
# infer their schemas: they are published here, for clients and for schemathesis.
BODIES = {"/generate": tgi.TGIRequest, "/generate_stream": tgi.TGIRequest, "/": tgi.TGIRequest,
          "/tokenize": tgi.TGIRequest, "/v1/completions": openai_api.CompletionRequest,
          "/v1/chat/completions": openai_api.ChatRequest}


def _openapi() -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version="0.1.0", summary=app.summary, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            spec["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = spec
    return app.openapi_schema


app.openapi = _openapi


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


def sse(payload: Any, space: bool = False) -> bytes:
    return f"data:{' ' if space else ''}{json.dumps(payload)}\n\n".encode()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON number {name}")


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, batcher, args: AppArgs):
        self.args = args
        if args.model == DEMO_MODEL:
            ensure_demo_model(args.model)
        self.batcher = batcher.options(stream=True)
        self.batcher_unary = batcher
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.special_ids = set(self.tokenizer.all_special_ids)
        model_config = ModelConfig.from_pretrained(args.model)
        max_input, max_total = token_limits(args, model_config.max_position_embeddings)
        self.limits = tgi.Limits(max_input, max_total, args.max_stop_sequences, args.max_best_of,
                                 args.max_top_n_tokens)
        self.in_flight = 0
        self.metrics = Metrics(INGRESS)
        key = args.resolved_api_key
        self.api_key = key.encode() if key else None

    # -- checks shared by every route ------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if not hmac.compare_digest(token, self.api_key):  # constant time
            raise ApiError(401, "Unauthorized", "authentication")

    async def _body(self, request: Request) -> Any:
        self._check_auth(request)
        limit = self.args.payload_limit
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"Payload too large: limit is {limit} bytes", "payload_limit")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"Payload too large: limit is {limit} bytes", "payload_limit")
        try:
            return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(422, f"Failed to parse the JSON body: {exc}", "validation") from exc

    def _admit(self) -> None:
        if self.in_flight >= self.args.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        self.in_flight += 1
        self.metrics.set("raygen_ingress_in_flight_requests", self.in_flight)

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.set("raygen_ingress_in_flight_requests", self.in_flight)

    def _failed(self, error_type: str) -> None:
        self.metrics.inc("tgi_request_count")
        self.metrics.inc("tgi_request_failure", tags={"err": error_type})

    def _succeeded(self, g: Generation, route: str, validation_time: float = 0.0) -> None:
        """Account one finished generation, and log it as one structured line (as TGI)."""
        m = self.metrics
        total = (g.end or time.monotonic()) - g.start
        m.inc("tgi_request_count")
        m.inc("tgi_request_success")
        m.observe("tgi_request_duration", total + validation_time)
        m.observe("tgi_request_validation_duration", validation_time)
        m.observe("tgi_request_queue_duration", g.queue_time)
        m.observe("tgi_request_inference_duration", g.inference_time)
        m.observe("tgi_request_mean_time_per_token_duration",
                  g.inference_time / max(1, len(g.token_ids)))
        m.observe("tgi_request_input_length", len(g.prompt_token_ids))
        m.observe("tgi_request_generated_tokens", len(g.token_ids))
        if g.ttft is not None:
            m.observe("raygen_time_to_first_token_seconds", g.ttft)
        for gap in g.inter_token_latencies:
            m.observe("raygen_inter_token_latency_seconds", gap)
        logger.info(json.dumps({
            "event": "request_finished", "request_id": g.request_id, "route": route,
            "prompt_tokens": len(g.prompt_token_ids), "generated_tokens": len(g.token_ids),
            "queue_time_s": round(g.queue_time, 4),
            "ttft_s": None if g.ttft is None else round(g.ttft, 4),
            "total_time_s": round(total + validation_time, 4),
            "finish_reason": g.finish_reason.value if g.finish_reason else None}))

    def _token(self, token_id: int, text: str, logprob: float | None) -> dict:
        special = token_id in self.special_ids
        if special:
            text = self.tokenizer.convert_ids_to_tokens(token_id)
        return tgi.token_json(token_id, text, logprob, special)

    def _error(self, exc: Exception, openai: bool = False) -> JSONResponse:
        if isinstance(exc, ApiError):
            status, message, error_type = exc.status, exc.message, exc.error_type
        elif isinstance(exc, tgi.ValidationError):
            status, message, error_type = 422, str(exc), "validation"
        elif isinstance(exc, PydanticError):
            status, message, error_type = 422, tgi.pydantic_message(exc), "validation"
        elif isinstance(exc, ReplicaUnavailable):
            status, message, error_type = 503, str(exc), "generation"
        elif isinstance(exc, GenerationError):
            status, message, error_type = 424, str(exc), "generation"
        else:
            logger.exception("unexpected error")
            status, message, error_type = 500, f"{type(exc).__name__}: {exc}", "internal"
        self._failed(error_type)
        if openai:
            return openai_api.error_response(status, message, error_type)
        return JSONResponse(tgi.error_json(message, error_type), status_code=status)

    # -- TGI routes ------------------------------------------------------------------
    @app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._tgi(request, stream_tokens=False)

    @app.post("/generate_stream")
    async def generate_stream(self, request: Request) -> Response:
        return await self._tgi(request, stream_tokens=True)

    @app.post("/")
    async def compat_generate(self, request: Request) -> Response:
        return await self._tgi(request, stream_tokens=None)

    async def _tgi(self, request: Request, stream_tokens: bool | None) -> Response:
        start = time.monotonic()
        compat = stream_tokens is None
        try:
            body = await self._body(request)
            req = tgi.TGIRequest.model_validate(body)
            if compat:
                stream_tokens = req.stream
            valid = tgi.validate(req, self.tokenizer, self.limits, stream_tokens)
            self._admit()
        except Exception as exc:
            return self._error(exc)
        validation_time = time.monotonic() - start
        if stream_tokens:
            return StreamingResponse(self._tgi_events(req, valid), media_type="text/event-stream")
        try:
            response = await self._tgi_response(req, valid, start, validation_time)
            if compat:  # TGI's `/` answers a list of one, as the Inference API did
                response.body = b"[" + response.body + b"]"
                response.headers["content-length"] = str(len(response.body))
            return response
        except Exception as exc:
            return self._error(exc)
        finally:
            self._release()

    async def _tgi_response(self, req, valid, start, validation_time) -> Response:
        runs = [Generation(new_request_id(), valid.prompt_token_ids, valid.params)]
        for _ in range(valid.best_of - 1):  # best_of: independent samples, different seeds
            runs.append(Generation(new_request_id(), valid.prompt_token_ids,
                                   reseeded(valid.params)))
        await collect_all(self.batcher, runs)
        best = max(runs, key=lambda g: g.sum_logprob)
        for g in runs:
            self._succeeded(g, "generate", validation_time)
        p = req.parameters
        body: dict[str, Any] = {"generated_text": self._full_text(req, best)}
        if p.details or p.decoder_input_details:
            body["details"] = self._details(best, valid, p.decoder_input_details)
            if valid.best_of > 1:
                body["details"]["best_of_sequences"] = [
                    {**self._details(g, valid, p.decoder_input_details),
                     "generated_text": self._full_text(req, g)} for g in runs if g is not best]
        return JSONResponse(body, headers=self._headers(best, start, validation_time))

    def _details(self, g: Generation, valid, prefill: bool) -> dict:
        details = {
            "finish_reason": g.finish_reason.value,
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
                {"id": t, "text": self.tokenizer.decode([t]), "logprob": lp}
                for t, lp in zip(g.prompt_token_ids, g.prompt_logprobs, strict=True)]
        return details

    def _full_text(self, req: tgi.TGIRequest, g: Generation) -> str:
        return (req.inputs + g.text) if req.parameters.return_full_text else g.text

    def _headers(self, g: Generation, start: float, validation_time: float) -> dict[str, str]:
        total = time.monotonic() - start
        n = max(1, len(g.token_ids))
        return {
            "x-compute-type": self.args.device,
            "x-compute-time": f"{total:.6f}",
            "x-total-time": str(int(total * 1000)),
            "x-validation-time": str(int(validation_time * 1000)),
            "x-queue-time": str(int(g.queue_time * 1000)),
            "x-inference-time": str(int(g.inference_time * 1000)),
            "x-time-per-token": str(int(g.inference_time * 1000 / n)),
            "x-prompt-tokens": str(len(g.prompt_token_ids)),
            "x-generated-tokens": str(len(g.token_ids)),
        }

    async def _tgi_events(self, req: tgi.TGIRequest, valid) -> AsyncIterator[bytes]:
        g = Generation(new_request_id(), valid.prompt_token_ids, valid.params)
        index = 0
        try:
            async for output in stream(self.batcher, g):
                for i, token_id in enumerate(output.token_ids):
                    index += 1
                    last = output.finished and i == len(output.token_ids) - 1
                    event = {
                        "index": index,
                        "token": self._token(token_id, output.token_texts[i], output.logprobs[i]),
                        "top_tokens": [self._token(t, self.tokenizer.decode([t]), lp)
                                       for t, lp in output.top_logprobs[i]],
                        "generated_text": self._full_text(req, g) if last else None,
                        "details": {"finish_reason": g.finish_reason.value,
                                    "generated_tokens": len(g.token_ids),
                                    "seed": g.params.seed if valid.sampling else None,
                                    "input_length": len(g.prompt_token_ids)} if last else None,
                    }
                    yield sse(event)
            self._succeeded(g, "generate_stream")
        except GenerationError as exc:
            self._failed("generation")
            yield sse(tgi.error_json(str(exc), "generation"))
        except Exception as exc:  # never cut a stream without saying why
            logger.exception("stream failed")
            self._failed("internal")
            yield sse(tgi.error_json(f"{type(exc).__name__}: {exc}"[:500], "generation"))
        finally:
            self._release()

    # -- other TGI routes ------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.batcher_unary.check_health.remote(), 10)
        except Exception as exc:
            return JSONResponse(tgi.error_json(f"unhealthy: {exc}"[:500], "healthcheck"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/info")
    async def info(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except ApiError as exc:
            return self._error(exc)
        a = self.args
        return JSONResponse({
            "model_id": a.model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": a.dtype, "model_device_type": a.device,
            "max_concurrent_requests": a.max_concurrent_requests, "max_best_of": a.max_best_of,
            "max_stop_sequences": a.max_stop_sequences,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_batch_prefill_tokens": a.max_batch_prefill_tokens,
            "max_batch_total_tokens": a.max_batch_total_tokens,
            "max_waiting_tokens": a.max_waiting_tokens, "max_batch_size": a.max_batch_size,
            "waiting_served_ratio": a.waiting_served_ratio, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "raygen", "version": "0.1.0", "sha": None,
            "docker_label": None,
        })

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        try:
            req = tgi.TGIRequest.model_validate(await self._body(request))
        except Exception as exc:
            return self._error(exc)
        enc = self.tokenizer(req.inputs, add_special_tokens=req.add_special_tokens,
                             return_offsets_mapping=True)
        return JSONResponse([
            {"id": t, "text": req.inputs[a:b], "start": a, "stop": b}
            for t, (a, b) in zip(enc.input_ids, enc.offset_mapping, strict=True)])

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            batcher_text = await asyncio.wait_for(self.batcher_unary.metrics_text.remote(), 10)
        except Exception as exc:
            return self._error(exc)
        # One batcher replica's numbers (the one this call reached); Ray's Prometheus
        # export has every replica's, tagged with application, deployment and replica.
        return Response(self.metrics.text() + batcher_text,
                        media_type="text/plain; version=0.0.4")

    # -- OpenAI routes ---------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except ApiError as exc:
            return self._error(exc, openai=True)
        return JSONResponse(openai_api.models_json(self.args.model_name))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await openai_api.handle(self, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await openai_api.handle(self, request, chat=True)

