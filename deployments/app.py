"""The Serve application: `serve run deployments.app:build_app model=DIR ...` or the
`import_path` of serve_config.yaml. Deployment options (replicas, autoscaling) come from
the config's `deployments:` section; the builder sets what the model dictates."""

import os
from collections.abc import Mapping

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.batcher import Batcher
from deployments.config import AppArgs
from deployments.ingress import Ingress
from deployments.metrics_hub import MetricsHub
from deployments.router import ROUTER_PATH

# A replica batches many requests at once: Serve's default of 5 ongoing requests per
# replica would starve the batch. Overload past this queues at most max_queued_requests,
# then the handle refuses and the ingress answers 503. Serve replaces a replica after three
# failed health checks in a row; the check is a GCS read (no call to a busy shard), so a
# short period costs nothing and a dead shard's replica is replaced in about 6 s, not 15.
# A stopping replica checks for drained requests every 0.5 s, not Serve's 2 s (an ingress
# closes its output channels when it stops: `serve shutdown` of an app that had just
# served went from 11.3 to 5.7 s, benchmarks/NOTES.md 36).
# Requests go to the replica holding their prompt's prefix (deployments/router.py), from
# stats each replica reports every second; a config's `request_router_config` replaces it.
BatcherDeployment = serve.deployment(
    Batcher, name="Batcher", max_ongoing_requests=256, max_queued_requests=512,
    health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=60,
    graceful_shutdown_wait_loop_s=0.5,
    request_router_config=RequestRouterConfig(
        request_router_class=ROUTER_PATH, request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0))


# Serve's throughput mode is cluster-wide environment variables. These four act inside a
# replica's own process (ray/serve/_private/constants.py reads them at import): user code
# on the replica's main loop rather than a thread of its own, the handle's router on the
# caller's loop, request logs buffered, the start-up heap frozen out of the GC. Set through
# the replicas' runtime_env, a plain `serve run deployments.app:build_app` gets them beside
# Serve's proxy actor: with the core plan on 2 cores, +11% to +14% output tok/s at
# concurrency 1 and about even at 32 (benchmarks/NOTES.md 35; entry 14, before the plan,
# measured nothing).
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
}


def replica_actor_options(args: AppArgs, num_cpus: float,
                          environ: Mapping[str, str] = os.environ) -> dict:
    """A replica's ray_actor_options; with `replica_fast_path`, throughput mode's in-process
    settings that the environment the app is built in does not set itself."""
    options: dict = {"num_cpus": num_cpus}
    env = {k: v for k, v in REPLICA_ENV.items() if k not in environ}
    if args.replica_fast_path and env:
        options["runtime_env"] = {"env_vars": env}
    return options


def build_app(args: AppArgs) -> Application:
    # Serve validates against the annotation; a dict still arrives from older callers.
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    hub = MetricsHub.bind()  # one /metrics for every replica (deployments/metrics_hub.py)
    batcher = BatcherDeployment.options(
        ray_actor_options=replica_actor_options(
            args, max(args.replica_cpus, 0.01) if args.replica_cpus else 0),
        placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy="STRICT_PACK",
    ).bind(args, hub)
    ingress = Ingress.options(ray_actor_options=replica_actor_options(args, 0))
    return ingress.bind(batcher, args, hub)
