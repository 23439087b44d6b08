"""The Serve application: `serve run deployments.app:build_app model=DIR ...` or the
`import_path` of serve_config.yaml. Deployment options (replicas, autoscaling) come from
the config's `deployments:` section; the builder sets what the model dictates."""

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
# Requests go to the replica holding their prompt's prefix (deployments/router.py), from
# stats each replica reports every second; a config's `request_router_config` replaces it.
BatcherDeployment = serve.deployment(
    Batcher, name="Batcher", max_ongoing_requests=256, max_queued_requests=512,
    health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=60,
    graceful_shutdown_wait_loop_s=2,
    request_router_config=RequestRouterConfig(
        request_router_class=ROUTER_PATH, request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0))


def build_app(args: AppArgs) -> Application:
    # Serve validates against the annotation; a dict still arrives from older callers.
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    hub = MetricsHub.bind()  # one /metrics for every replica (deployments/metrics_hub.py)
    batcher = BatcherDeployment.options(
        ray_actor_options={"num_cpus": max(args.replica_cpus, 0.01) if args.replica_cpus else 0},
        placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy="STRICT_PACK",
    ).bind(args, hub)
    return Ingress.bind(batcher, args, hub)
