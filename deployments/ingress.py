"""The HTTP front: one Serve deployment with TGI's and OpenAI's routes.

Both protocols stand on one admission layer (admission.py: API key, payload size, strict
JSON, the concurrency cap, metrics, error mapping) and are two adapters over it
(tgi_api.py, openai_api.py) that translate requests and responses."""

# No `from __future__ import annotations` here: FastAPI must see real annotations through
# Serve's class-based routes.

import asyncio
import importlib.metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from deployments import openai_schema, tgi
from deployments.adapters import Adapters
from deployments.admission import Admission, ApiError
from deployments.channels import OutputChannels
from deployments.config import DEMO_MODEL, AppArgs, server_limits
from deployments.grammar import GrammarChecker
from deployments.metrics import INGRESS, Metrics
from deployments.metrics_hub import Pusher, collect, render, replica_source
from deployments.openai_api import OpenAIApi
from deployments.responses_api import ResponsesApi, ResponsesRequest
from deployments.routing import router_families
from deployments.tgi_api import TGIApi
from shards.checkpoints.resolve import load_tokenizer
from shards.model.config import ModelConfig
from shards.worker import logs

# How long /health waits for the batcher's check. Under 32 streams the check answered in
# 22 ms at p50 and 204 ms at most (NOTES 41); while a killed batcher replica is replaced the
# call waits for the new one, and a probe then got a late 200 after 8 s instead of a 503.
# Kubernetes' default probe timeout is 1 s.
HEALTH_TIMEOUT_S = 2.0
VERSION = importlib.metadata.version("raygen")  # pyproject.toml's

app = FastAPI(title="raygen", summary="TGI- and OpenAI-compatible text generation on Ray Serve")
# Routes read raw bodies (payload limit, strict JSON, TGI-shaped errors), so FastAPI cannot
# infer their schemas: they are published here, for clients and for schemathesis.
BODIES = {"/generate": tgi.TGIRequest, "/generate_stream": tgi.TGIRequest, "/": tgi.TGIRequest,
          "/tokenize": tgi.TGIRequest, "/chat_tokenize": openai_schema.ChatRequest,
          "/detokenize": openai_schema.Detokenize,
          "/v1/completions": openai_schema.CompletionRequest,
          "/v1/chat/completions": openai_schema.ChatRequest, "/v1/responses": ResponsesRequest,
          "/v1/load_lora_adapter": openai_schema.LoadLoRAAdapter,
          "/v1/unload_lora_adapter": openai_schema.UnloadLoRAAdapter}

# SageMaker's /invocations takes any of these (TGI's order: the first that fits).
INVOCATIONS = (tgi.TGIRequest, openai_schema.ChatRequest, openai_schema.CompletionRequest)


def _openapi() -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=VERSION, summary=app.summary, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            spec["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        spec["paths"]["/invocations"]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"anyOf": [
                {"$ref": f"#/components/schemas/{m.__name__}"} for m in INVOCATIONS]}}}}
        app.openapi_schema = spec
    return app.openapi_schema


app.openapi = _openapi


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(app)
class Ingress:
    def __init__(self, batcher, args: AppArgs, metrics_hub=None):
        with logs.start_failure_to_console("Ingress"):
            self._start(batcher, args, metrics_hub)

    def _start(self, batcher, args: AppArgs, metrics_hub) -> None:
        self.args = args
        if args.model == DEMO_MODEL:
            from shards.demo_model import ensure_demo_model  # torch: only for the demo

            ensure_demo_model(args.model)
        self.batcher = batcher
        tokenizer = load_tokenizer(args.model, without_torch=True)
        model_config = ModelConfig.from_pretrained(args.model)
        self.adapters = Adapters(args.adapters, metrics_hub, args.max_lora_rank, model_config)
        self.limits = server_limits(args, model_config.max_position_embeddings,
                                    self.adapters.known, model_config.eos_token_ids)
        grammars = GrammarChecker(args.model, model_config.vocab_size,
                                  args.grammar_check_timeout_s)
        self.metrics = Metrics(INGRESS)
        self.admission = Admission(self.metrics, args.max_concurrent_requests,
                                   args.payload_limit, args.resolved_api_key)
        # One message per step per batcher replica, not one per request (channels.py).
        streaming = self.channels = OutputChannels(batcher.options(stream=True))
        self.tgi = TGIApi(self.admission, grammars, streaming, tokenizer, self.limits, args.device,
                          self.adapters)
        self.openai = OpenAIApi(self.admission, grammars, streaming, tokenizer, self.limits,
                                args.max_n, args.model_name, self.adapters)
        self.responses = ResponsesApi(self.openai)
        self.batcher_info: dict | None = None  # /info's raygen part, from a batcher replica
        self.hub, self.pusher = metrics_hub, None
        if metrics_hub is not None:
            self.source = replica_source("Ingress")
            self.pusher = Pusher(metrics_hub, self.source, self._families)

    def _families(self):
        return collect(self.metrics.registry) + router_families()

    def __del__(self):
        """Serve calls this on the replica's loop once its requests have drained. Ending
        the output channels here lets the batcher replicas drain at once; each would
        otherwise wait for its channel to end idle (CHANNEL_IDLE_S) before stopping."""
        channels = getattr(self, "channels", None)
        if channels is not None:
            channels.close()

    async def check_health(self) -> None:
        """Serve's periodic check: the ingress has nothing that can fail alone; it starts
        the metrics pusher on the replica's loop."""
        if self.pusher is not None:
            self.pusher.ensure_started()

    # -- TGI -------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self.tgi.generate(request, stream_tokens=False)

    @app.post("/generate_stream")
    async def generate_stream(self, request: Request) -> Response:
        return await self.tgi.generate(request, stream_tokens=True)

    @app.post("/")
    async def compat_generate(self, request: Request) -> Response:
        return await self.tgi.generate(request, stream_tokens=None)

    @app.post("/invocations")
    async def invocations(self, request: Request) -> Response:
        """Amazon SageMaker's route, as TGI serves it: TGI's body (`inputs`), a chat
        completion (`messages`) or a completion (`prompt`), told apart by that field."""
        try:
            body = await self.admission.read_json(request)
            kind = next((k for k in ("inputs", "messages", "prompt")
                         if isinstance(body, dict) and k in body), None)
            if kind is None:
                raise ApiError(422, "an /invocations body needs `inputs` (TGI's generate), "
                               "`messages` (a chat completion) or `prompt` (a completion)",
                               "validation")
        except Exception as exc:
            return self.tgi.error(exc)
        if kind == "inputs":
            return await self.tgi.generate(request, stream_tokens=None, body=body)
        return await self.openai.create(request, chat=kind == "messages", body=body)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """TGI's (a body with `inputs`) or vLLM's (`prompt` or `messages`)."""
        try:
            body = await self.admission.read_json(request)
        except Exception as exc:
            return self.tgi.error(exc)
        if isinstance(body, dict) and "inputs" not in body and body.keys() & {"prompt",
                                                                              "messages"}:
            return await self.openai.tokenize(body)
        return await self.tgi.tokenize(body)

    @app.post("/chat_tokenize")
    async def chat_tokenize(self, request: Request) -> Response:
        return await self.tgi.chat_tokenize(request)

    @app.get("/ping")  # SageMaker's health check, as TGI and vLLM answer it
    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.batcher.check_health.remote(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return JSONResponse(tgi.error_json(
                f"unhealthy: the batcher did not answer within {HEALTH_TIMEOUT_S:g} s",
                "healthcheck"), status_code=503)
        except Exception as exc:
            return JSONResponse(tgi.error_json(f"unhealthy: {exc}"[:500], "healthcheck"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")  # vLLM's
    async def version(self) -> Response:
        return JSONResponse({"version": VERSION})

    @app.get("/info")
    async def info(self, request: Request) -> Response:
        try:
            self.admission.check_auth(request)
        except Exception as exc:
            return self.tgi.error(exc)
        a = self.args
        waiting_served_ratio, max_waiting_tokens = a.admission
        if self.batcher_info is None:  # asked once: it is fixed when the replica starts
            self.batcher_info = await asyncio.wait_for(self.batcher.info.remote(), 10)
        path = self.batcher_info["compute_path"]
        return JSONResponse({
            "model_id": a.model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": path["weight_dtype"], "model_device_type": path["device"],
            "max_concurrent_requests": a.max_concurrent_requests, "max_best_of": a.max_best_of,
            "max_stop_sequences": a.max_stop_sequences,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_batch_prefill_tokens": a.max_batch_prefill_tokens,
            "max_batch_total_tokens": a.max_batch_total_tokens,
            "max_waiting_tokens": max_waiting_tokens, "max_batch_size": a.max_batch_size,
            "waiting_served_ratio": waiting_served_ratio, "speculate": a.speculate,
            "validation_workers": 1,
            "max_client_batch_size": 1, "router": "raygen", "version": VERSION, "sha": None,
            "docker_label": None,
            # raygen's own: how the shards compute (the weight products, the attention).
            "raygen": self.batcher_info,
        })

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        try:
            self.admission.check_auth(request)
            if self.hub is None:  # built without the hub: the batcher replica reached
                text = self.metrics.text() + await asyncio.wait_for(
                    self.batcher.metrics_text.remote(), 10)
            else:  # every replica (metrics_hub.py); this one's own numbers fresh
                reports = await asyncio.wait_for(self.hub.snapshot.remote(), 10)
                reports[self.source] = self._families()
                text = render(reports)
        except Exception as exc:
            return self.tgi.error(exc)
        return Response(text, media_type="text/plain; version=0.0.4")

    # -- OpenAI ----------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self.openai.models(request)

    @app.get("/v1/models/{name:path}")
    async def model(self, request: Request, name: str) -> Response:
        return await self.openai.model(request, name)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await self.openai.load_adapter(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self.openai.unload_adapter(request)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self.openai.detokenize(request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.openai.create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.openai.create(request, chat=True)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self.responses.create(request)
