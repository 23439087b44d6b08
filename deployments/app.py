"""The Serve application: `serve run deployments.app:build_app model=DIR ...` or the
`import_path` of serve_config.yaml. Deployment options (replicas, autoscaling) come from
the config's `deployments:` section; the builder sets what the model dictates."""

import atexit
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import click
import ray
from ray import serve
from ray._private.services import canonicalize_bootstrap_address
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.batcher import Batcher
from deployments.config import DEMO_MODEL, AppArgs
from deployments.ingress import Ingress
from deployments.metrics_hub import MetricsHub
from deployments.router import ROUTER_PATH
from shards.checkpoints.adapters import read_adapter_config
from shards.checkpoints.resolve import CheckpointError, checkpoint_files, gguf_file, model_dir
from shards.model.config import ModelConfig

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
# A replica that fails to start fails the deploy at once: what stops a batcher starting (a
# model it cannot read, a KV cache that does not fit) fails it again, and Serve's default
# of three tries reloaded the model twice more before saying so (`serve run` took 33 s to
# exit). A replica that fails after one has started is replaced as before.
BatcherDeployment = serve.deployment(
    Batcher, name="Batcher", max_ongoing_requests=256, max_queued_requests=512,
    max_constructor_retry_count=1,
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
# measured nothing). Not part of the mode but read the same way: each replica, and each
# handle's router in it, hands Serve's own cached metrics to Ray every second instead of
# every 0.1 s. Ray exports them every 10 s anyway; idle, the wake-ups were 8-20% of each
# replica's CPU, 1-3 ms a second (benchmarks/NOTES.md 51).
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def replica_actor_options(args: AppArgs, num_cpus: float,
                          environ: Mapping[str, str] = os.environ) -> dict:
    """A replica's ray_actor_options, with throughput mode's in-process settings that the
    environment the app is built in does not set itself."""
    options: dict = {"num_cpus": num_cpus}
    env = {k: v for k, v in REPLICA_ENV.items() if k not in environ}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


# Serve's throughput mode itself (HAProxy on the HTTP port forwarding straight to the
# ingress replica, gRPC between replicas) is chosen where Serve's controller starts, from its
# environment: serve_config.yaml sets these in `controller_options`. `serve run IMPORT_PATH`
# has no such option, but it calls this builder before it starts Ray, and the Ray instance
# it starts inherits the CLI process's environment, as it would from
# `RAY_SERVE_THROUGHPUT_OPTIMIZED=1 ... serve run`. Under Serve's proxy actor the serving
# plane costs 2.1 ms of CPU per token on 2 cores against 0.9 ms (benchmarks/NOTES.md 36).
# On Ctrl-C the ingress waits the draining period for load balancers to stop sending to it
# (Ray's default, 30 s, is for clusters; HAProxy retries refused connections).
# Not part of Serve's mode but set with it: Serve's controller wakes every 0.5 s instead of
# 0.1 s. Each wake-up (and the GCS calls it makes) can preempt a shard thread on a node
# whose cores the controller shares with the shards: +3.5% and +10.5% output tok/s at concurrency
# 32, +2.9% and +5.3% decode-heavy, +2% at 1 on 2 cores (benchmarks/NOTES.md 40). Serve
# then reacts to replica changes within 0.5 s.
THROUGHPUT_MODE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


def serve_run_starts_ray() -> bool:
    """True inside `serve run IMPORT_PATH` when its `ray.init` will start a fresh local Ray
    instance: the CLI's own --address (default $RAY_ADDRESS), resolved as `ray.init`
    resolves it (an address, or a running local cluster, means it connects instead)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.command.name != "run" or ray.is_initialized():
        return False
    try:
        return canonicalize_bootstrap_address(ctx.params.get("address")) is None
    except (ConnectionError, ValueError):  # `ray.init` will fail with the same error
        return False


def start_ray_in_throughput_mode(args: AppArgs, starts_ray: bool | None = None,
                                 environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """With `serve_throughput_mode`, where `serve run` is about to start Ray: sets throughput
    mode's variables that `environ` does not set itself, and returns them. A cluster that
    already runs keeps its mode (variables here would reach only the CLI process); a config
    file's builder runs inside the cluster, where its controller_options decide."""
    if starts_ray is None:
        starts_ray = serve_run_starts_ray()
    if not args.serve_throughput_mode or not starts_ray:
        return {}
    env = {k: v for k, v in THROUGHPUT_MODE_ENV.items() if k not in environ}
    environ.update(env)
    if env:  # the CLI configures no logging before it starts Ray: straight to its stderr
        print(f"raygen: serve_throughput_mode: the Ray instance that `serve run` starts runs "
              f"Serve's throughput mode ({' '.join(f'{k}={v}' for k, v in env.items())}); "
              f"serve_throughput_mode=false keeps Serve's proxy actor", file=sys.stderr)
    return env


def exit_nonzero_if_deploy_fails() -> None:
    """`serve run IMPORT_PATH` ends with status 0 when the application fails to deploy
    (a replica that cannot start; Ray's CLI ends every error with a bare `sys.exit()`).
    Watch the deployment from the CLI's process and, where it failed, end the process with
    status 1 once the CLI has shut Serve down and printed why."""
    failed = threading.Event()

    def watch() -> None:
        while not ray.is_initialized():
            time.sleep(0.2)
        while True:
            try:
                statuses = [a.status for a in serve.status().applications.values()]
            except Exception:  # Serve not started yet, or already gone
                statuses = []
            if "DEPLOY_FAILED" in statuses:
                failed.set()
                return
            if statuses and all(status == "RUNNING" for status in statuses):
                return  # deployed: Serve replaces replicas that fail from here on
            time.sleep(0.2)

    def exit_status() -> None:
        if failed.is_set():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watch, name="raygen-deploy-watch", daemon=True).start()
    atexit.register(exit_status)  # before Ray's own (LIFO): it runs after them


def check_model(args: AppArgs) -> None:
    """What can be known of the checkpoint before any replica starts, so that a bad
    `model=` or `tensor_parallel_size=` is one clear line, not a replica that fails where
    the console cannot see it. A GGUF file is converted here (once per node, cached), so
    the replicas on this node start from the converted directory."""
    if args.model == DEMO_MODEL and not Path(args.model).exists():
        for name, path in args.adapters:  # what the adapter's own files say
            read_adapter_config(name, path, args.max_lora_rank)
        return  # written by the replicas at start (shards/demo_model.py)
    config = ModelConfig.from_pretrained(args.model)
    for name, path in args.adapters:  # and whether its shapes fit the model
        read_adapter_config(name, path, args.max_lora_rank, config)
    directory = model_dir(args.model)
    if args.quantize is not None and gguf_file(directory) is not None:
        raise CheckpointError(f"quantize={args.quantize}: model={args.model} holds a GGUF "
                              "file, whose own blocks are multiplied as they are")
    if gguf_file(directory) is None:
        try:
            checkpoint_files(directory)
        except FileNotFoundError:
            raise CheckpointError(f"model={args.model}: config.json but no .safetensors "
                                  "weights") from None
    tp = args.tensor_parallel_size
    if config.num_heads % tp or (config.num_kv_heads >= tp and config.num_kv_heads % tp):
        raise CheckpointError(
            f"tensor_parallel_size={tp}: the model's {config.num_heads} attention heads "
            f"({config.num_kv_heads} key/value heads) do not split over {tp} ranks")


def build_app(args: AppArgs) -> Application:
    # Serve validates against the annotation; a dict still arrives from older callers.
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    try:
        check_model(args)
    except CheckpointError as exc:
        ctx = click.get_current_context(silent=True)
        if ctx is not None and ctx.command.name == "run":  # `serve run`: one line, exit 1
            print(f"raygen: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        raise
    start_ray_in_throughput_mode(args)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.command.name == "run" and not ray.is_initialized():
        exit_nonzero_if_deploy_fails()
    # One /metrics for every replica (deployments/metrics_hub.py); its calls are all async.
    hub = MetricsHub.options(ray_actor_options=replica_actor_options(args, 0)).bind()
    batcher = BatcherDeployment.options(
        ray_actor_options=replica_actor_options(
            args, max(args.replica_cpus, 0.01) if args.replica_cpus else 0),
        placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy="STRICT_PACK",
    ).bind(args, hub)
    ingress = Ingress.options(ray_actor_options=replica_actor_options(args, 0))
    return ingress.bind(batcher, args, hub)
