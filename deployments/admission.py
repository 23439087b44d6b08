"""The admission layer both protocol adapters (TGI, OpenAI) stand on.

It checks what every request must pass before it reaches a batcher (API key, payload size,
strict JSON with no NaN/Infinity, the request schema, the concurrency cap: 429 past it),
accounts every request's end in the metrics (and logs each success as one JSON line, as
TGI does), and maps any failure to (status, message, error type). How an error looks on
the wire is each adapter's business."""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, NamedTuple, TypeVar

from fastapi import Request
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

from deployments.generation import Generation, GenerationError, ReplicaUnavailable
from deployments.metrics import Metrics

logger = logging.getLogger("ray.serve")
Model = TypeVar("Model", bound=BaseModel)


class ApiError(Exception):
    """A request refused with this status, message and error type."""

    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


class Failure(NamedTuple):
    status: int
    message: str
    error_type: str


def schema_message(exc: PydanticError) -> str:
    """A request that does not fit the schema, in the words TGI (axum/serde) uses."""
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ())) or "body"
    return f"Failed to deserialize the JSON body into the target type: {where}: {first.get('msg')}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON number {name}")


class Admission:
    def __init__(self, metrics: Metrics, max_concurrent_requests: int, payload_limit: int,
                 api_key: str | None):
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.payload_limit = payload_limit
        self._api_key = api_key.encode() if api_key else None
        self.in_flight = 0

    # -- before a request is queued --------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if not hmac.compare_digest(token, self._api_key):  # constant time
            raise ApiError(401, "Unauthorized", "authentication")

    async def read_json(self, request: Request) -> Any:
        """The authorized request's body as strict JSON, never more than the payload limit."""
        self.check_auth(request)
        limit = self.payload_limit
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

    async def read(self, request: Request, model: type[Model]) -> Model:
        """The body, read as above, parsed into `model` (422 when it does not fit)."""
        return self.parse(await self.read_json(request), model)

    @staticmethod
    def parse(body: Any, model: type[Model]) -> Model:
        try:
            return model.model_validate(body)
        except PydanticError as exc:
            raise ApiError(422, schema_message(exc), "validation") from exc

    def admit(self) -> None:
        """Take a slot under the concurrency cap; every admit is paired with a release."""
        if self.in_flight >= self.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        self.in_flight += 1
        self.metrics.set("raygen_ingress_in_flight_requests", self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.set("raygen_ingress_in_flight_requests", self.in_flight)

    # -- after it ends ---------------------------------------------------------------
    def failure(self, exc: Exception) -> Failure:
        """What `exc` means to a client, counted as one failed request."""
        if isinstance(exc, ApiError):
            failure = Failure(exc.status, exc.message, exc.error_type)
        elif isinstance(exc, ReplicaUnavailable):
            failure = Failure(503, str(exc), "generation")
        elif isinstance(exc, GenerationError):
            failure = Failure(424, str(exc), "generation")
        else:
            logger.exception("unexpected error")
            failure = Failure(500, f"{type(exc).__name__}: {exc}", "internal")
        self.failed(failure.error_type)
        return failure

    def failed(self, error_type: str) -> None:
        self.metrics.inc("tgi_request_count")
        self.metrics.inc("tgi_request_failure", tags={"err": error_type})

    def succeeded(self, g: Generation, route: str, validation_time: float = 0.0) -> None:
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
        if g.params.adapter is not None:
            tags = {"adapter": g.params.adapter.partition("@")[0]}  # its name, not its id
            m.inc("raygen_lora_requests", tags=tags)
            m.inc("raygen_lora_generated_tokens", len(g.token_ids), tags=tags)
        if any(g.skipped_tokens):  # speculation kept drafts (TGI records them per step)
            for skipped in g.skipped_tokens:
                m.observe("tgi_request_skipped_tokens", skipped)
        logger.info(json.dumps({
            "event": "request_finished", "request_id": g.request_id, "route": route,
            "prompt_tokens": len(g.prompt_token_ids), "generated_tokens": len(g.token_ids),
            "speculated_tokens": sum(g.skipped_tokens),
            "adapter": g.params.adapter and g.params.adapter.partition("@")[0],
            "queue_time_s": round(g.queue_time, 4),
            "ttft_s": None if g.ttft is None else round(g.ttft, 4),
            "total_time_s": round(total + validation_time, 4),
            "finish_reason": g.finish_reason.value if g.finish_reason else None}))
