"""One /metrics for the whole application.

Every batcher and ingress replica pushes its metrics registry to the `Metrics`
deployment (a Serve deployment of one replica, so Serve starts, restarts and stops it
with the application) when it changed, at most every `PUSH_PERIOD_S`; `GET /metrics` on
any ingress renders them all: each series once summed over the replicas, under TGI's
plain names (what TGI dashboards read), and once per replica with a `replica` label.
Sum over `{replica=""}` for the application, or over `{replica!=""}` by replica; a sum
over both counts twice. A replica that stops pushing (gone) drops out after
`STALE_AFTER_S`, and with it its counters: `rate()` reads that as a counter reset."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable

import prometheus_client as prom
from ray import serve

logger = logging.getLogger("ray.serve")

# Each push is a Serve handle call (routing, a request, a reply): at 0.5 s the pushes were
# about a quarter of the batcher's event loop at concurrency 1 (py-spy), and at 2 s the
# batcher, ingress and hub spend 0.5 ms less CPU per token there (NOTES.md 50). Prometheus
# scrapes every 15-60 s; the ingress answering /metrics renders its own numbers fresh.
PUSH_PERIOD_S = 2.0
PUSH_TIMEOUT_S = 5.0  # a push that never returns (the hub not yet routable) is retried
STALE_AFTER_S = 30.0

# (family name, type, help, [(sample name, labels, value)])
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


def collect(registry: prom.CollectorRegistry) -> list[Family]:
    return [(f.name, f.type, f.documentation,
             [(s.name, dict(s.labels), s.value) for s in f.samples])
            for f in registry.collect()]


def render(reports: dict[str, list[Family]]) -> str:
    """Prometheus text of several replicas' families: the sums, then per replica."""
    order: dict[str, tuple[str, str]] = {}
    totals: dict[str, dict[tuple, float]] = {}
    per_replica: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for replica, families in sorted(reports.items()):
        for name, kind, doc, samples in families:
            order.setdefault(name, (kind, doc))
            summed = totals.setdefault(name, {})
            rows = per_replica.setdefault(name, [])
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                summed[key] = summed.get(key, 0.0) + value
                rows.append((sample, {**labels, "replica": replica}, value))
    lines = []
    for name, (kind, doc) in order.items():
        lines.append(f"# HELP {name} {_escape(doc, help_text=True)}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample, labels), value in totals[name].items():
            lines.append(_line(sample, dict(labels), value))
        for sample, labels, value in per_replica[name]:
            lines.append(_line(sample, labels, value))
    return "\n".join(lines) + "\n"


def _line(sample: str, labels: dict[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        sample = f"{sample}{{{inner}}}"
    return f"{sample} {prom.utils.floatToGoString(value)}"


def _escape(text: str, help_text: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if help_text else text.replace('"', '\\"')


@serve.deployment(name="Metrics", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=10_000, logging_config={"enable_access_log": False},
                  graceful_shutdown_wait_loop_s=0.5)
class MetricsHub:
    """One per application: the metrics its replicas push, and the LoRA adapters loaded
    at run time (deployments/adapters.py), which every replica asks it about."""

    def __init__(self):
        self.reports: dict[str, tuple[float, list[Family]]] = {}
        self.runtime_adapters: dict[str, tuple[str, str]] = {}  # name -> (id, path)
        self.adapter_loads = 0

    async def adapters(self) -> dict[str, tuple[str, str]]:
        return dict(self.runtime_adapters)

    async def add_adapter(self, name: str, path: str) -> str | None:
        """The new adapter's id, or None where `name` is taken."""
        if name in self.runtime_adapters:
            return None
        self.adapter_loads += 1
        self.runtime_adapters[name] = (f"{name}@{self.adapter_loads}", path)
        return self.runtime_adapters[name][0]

    async def remove_adapter(self, name: str) -> bool:
        return self.runtime_adapters.pop(name, None) is not None

    async def report(self, source: str, families: list[Family]) -> None:
        self.reports[source] = (time.monotonic(), families)

    async def snapshot(self) -> dict[str, list[Family]]:
        now = time.monotonic()
        self.reports = {k: v for k, v in self.reports.items() if now - v[0] < STALE_AFTER_S}
        return {k: families for k, (_, families) in self.reports.items()}


class Pusher:
    """A replica's side: pushes `families()` when they changed (and at least every
    STALE_AFTER_S / 3, so an idle replica stays listed). Started from the replica's
    event loop: at once where the constructor runs on it, else by `ensure_started` from
    the first async call (Serve's periodic health check is one)."""

    def __init__(self, hub, source: str, families: Callable[[], list[Family]]):
        self.hub, self.source, self.families = hub, source, families
        self._task: asyncio.Task | None = None
        self.ensure_started()

    def ensure_started(self) -> None:
        if self._task is not None and not self._task.done() and self._task.get_loop().is_running():
            return  # (a task left on a loop that stopped, e.g. the constructor's, is replaced)
        try:
            # A fresh context, like the engine loop's: pushes must not be calls of (and
            # cancelled with) whichever request happened to start the pusher.
            self._task = asyncio.get_running_loop().create_task(
                self._run(), context=contextvars.Context())
        except RuntimeError:  # no loop in this thread yet
            pass

    async def _run(self) -> None:
        last, last_sent, failing = None, 0.0, False
        while True:
            try:
                families = self.families()
                now = time.monotonic()
                if families != last or now - last_sent > STALE_AFTER_S / 3:
                    await asyncio.wait_for(self._push(families), PUSH_TIMEOUT_S)
                    last, last_sent = families, now
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the hub restarting, a push timed out: try again
                (logger.debug if failing else logger.warning)(
                    "metrics push from %s failed: %r", self.source, exc)
                failing = True
            await asyncio.sleep(PUSH_PERIOD_S)

    async def _push(self, families: list[Family]) -> None:
        await self.hub.report.remote(self.source, families)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def replica_source(kind: str) -> str:
    """`Batcher:<replica id>` inside Serve; a unique fallback outside it (tests)."""
    try:
        return f"{kind}:{serve.get_replica_context().replica_id.unique_id}"
    except Exception:
        return f"{kind}:{id(object()):x}"
