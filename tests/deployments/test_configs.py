"""The shipped configs are valid for Serve (its own schema) and for raygen (AppArgs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]


def serve_configs() -> dict[str, dict]:
    configs = {p: yaml.safe_load((ROOT / p).read_text())
               for p in ("serve_config.yaml", "configs/gpu-llama3-8b-tp2.yaml")}
    rayservice = yaml.safe_load((ROOT / "configs/kuberay-rayservice.yaml").read_text())
    configs["configs/kuberay-rayservice.yaml"] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return configs


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_config_is_valid(name):
    config = serve_configs()[name]
    ServeDeploySchema.parse_obj(config)
    for app in config["applications"]:
        assert app["import_path"] == "deployments.app:build_app"
        args = AppArgs.model_validate(app["args"])
        batcher = next(d for d in app["deployments"] if d["name"] == "Batcher")
        auto = batcher.get("autoscaling_config")
        if auto:
            # Scaling on per-replica load only works below the point where it queues.
            assert auto["target_ongoing_requests"] < batcher["max_ongoing_requests"]
        if args.device == "cuda":
            assert args.placement_group_bundles()[1:] == [{"GPU": 1.0}] * args.tensor_parallel_size


def test_gpu_configs_agree():
    """The KubeRay manifest serves what the GPU example serves."""
    configs = serve_configs()
    gpu = configs["configs/gpu-llama3-8b-tp2.yaml"]["applications"][0]
    kuberay = configs["configs/kuberay-rayservice.yaml"]["applications"][0]
    for key in ("model", "device", "tensor_parallel_size", "dtype"):
        assert gpu["args"][key] == kuberay["args"][key]
    assert kuberay["deployments"][0]["autoscaling_config"]["max_replicas"] == 4


def test_cluster_configs_route_on_prefixes_and_scale_on_llm_load():
    """The router and the policy the configs name import, and are raygen's."""
    from ray.serve.config import AutoscalingPolicy, RequestRouterConfig

    from deployments.autoscaling import POLICY_PATH
    from deployments.router import ROUTER_PATH

    configs = serve_configs()
    for name in ("serve_config.yaml", "configs/kuberay-rayservice.yaml"):
        batcher = configs[name]["applications"][0]["deployments"][0]
        router = RequestRouterConfig(**batcher["request_router_config"])
        assert router.request_router_class == ROUTER_PATH
        assert router.get_serialized_request_router_cls()  # imported and pickled
    policy = configs["configs/kuberay-rayservice.yaml"]["applications"][0]["deployments"][0][
        "autoscaling_config"]["policy"]
    assert AutoscalingPolicy(**policy).policy_function == POLICY_PATH


THROUGHPUT_MODE = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def test_shipped_configs_run_serves_throughput_mode():
    """Every shipped config runs HAProxy and direct ingress (README: Running): the serve
    configs through their controller_options, the KubeRay pods through their env too."""
    configs = serve_configs()
    for name in ("serve_config.yaml", "configs/gpu-llama3-8b-tp2.yaml"):
        options = ServeDeploySchema.parse_obj(configs[name]).controller_options
        assert THROUGHPUT_MODE.items() <= options.runtime_env["env_vars"].items(), name
    rayservice = yaml.safe_load((ROOT / "configs/kuberay-rayservice.yaml").read_text())
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert THROUGHPUT_MODE.items() <= env.items()


@pytest.mark.parametrize(("knobs", "reserved", "borrow"), [
    ({}, None, True),  # the default on CPU: each node reserves one core where it can
    ({"reserved_cpus": 0}, 0, False),  # the whole node, two unpinned threads on 2 cores
    ({"reserved_cpus": 2}, 2, True),
    ({"device": "cuda"}, 0, False),  # GPU shards: nothing reserved unless asked
    ({"device": "cuda", "reserved_cpus": 1}, 1, False),
])
def test_the_core_plan_is_the_default_on_cpu(knobs, reserved, borrow):
    from shards.cpu.plan import resolve_reserved

    config = AppArgs(model="m", **knobs).shard_config()
    assert (config.reserved_cpus, config.borrow_reserved_cpus) == (reserved, borrow)
    # Unset, a node reserves one core where each of its ranks keeps one of its own.
    assert [resolve_reserved(None, cores, ranks) for cores, ranks in
            ((2, 1), (2, 2), (16, 2), (16, 15), (16, 16), (1, 1))] == [1, 0, 1, 1, 0, 0]
    assert resolve_reserved(3, 2, 2) == 3  # set: as asked (cpu_plan.split bounds it)


@pytest.mark.parametrize(("knobs", "per_rank", "borrow", "shard_bundle"), [
    ({}, None, True, {"CPU": 0.1}),  # below 1: each replica splits the node among its ranks
    ({"shard_cpus": 4}, 4, False, {"CPU": 4}),  # whole cores, claimed node-wide: no borrowing
    ({"shard_cpus": 1, "reserved_cpus": 1}, 1, False, {"CPU": 1}),
    ({"device": "cuda"}, None, False, {"GPU": 1.0}),
    ({"device": "cuda", "shard_cpus": 8}, 8, False, {"GPU": 1.0, "CPU": 8}),
])
def test_shard_cpus_of_one_or_more_are_whole_cores_each_rank_owns(knobs, per_rank, borrow,
                                                                   shard_bundle):
    args = AppArgs(model="m", tensor_parallel_size=2, **knobs)
    config = args.shard_config()
    assert (config.cores_per_rank, config.borrow_reserved_cpus) == (per_rank, borrow)
    assert args.placement_group_bundles()[1:] == [shard_bundle] * 2


def test_shard_cpus_of_one_or_more_must_be_whole():
    with pytest.raises(ValueError, match="whole number of cores"):
        AppArgs(model="m", shard_cpus=1.5)


@pytest.mark.parametrize(("knobs", "compiled", "in_flight"), [
    ({}, False, 2),  # tp 1: actor calls, async scheduling
    ({"tensor_parallel_size": 2}, True, 1),  # a compiled graph runs steps one by one
])
def test_async_scheduling_is_on_unless_a_compiled_graph_runs_the_steps(knobs, compiled,
                                                                       in_flight):
    args = AppArgs(model="m", **knobs)
    assert (args.uses_compiled_graph, args.steps_in_flight) == (compiled, in_flight)


def test_replicas_get_throughput_modes_in_process_settings_unless_the_environment_says():
    """Under Serve's defaults too, the ingress and batcher replicas run user code on their
    main loop (and three more of throughput mode's settings) through their runtime_env; a
    variable already set where the app is built wins."""
    from deployments.app import REPLICA_ENV, replica_actor_options

    args = AppArgs(model="m")
    options = replica_actor_options(args, 0.1, environ={})
    assert options == {"num_cpus": 0.1, "runtime_env": {"env_vars": REPLICA_ENV}}
    assert REPLICA_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"

    mine = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
    env = replica_actor_options(args, 0, environ=mine)["runtime_env"]["env_vars"]
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in env
    assert set(env) == set(REPLICA_ENV) - set(mine)
    assert replica_actor_options(args, 0, environ=REPLICA_ENV) == {"num_cpus": 0}


def test_serve_run_of_the_import_path_starts_ray_in_throughput_mode(monkeypatch):
    """`serve run deployments.app:build_app` calls the builder before it starts Ray: the
    builder sets throughput mode's variables for the Ray instance to inherit, the same ones
    serve_config.yaml's controller_options give. Not over a variable already set, not with
    the knob off, and not where `serve run` will connect to a running cluster."""
    import click

    from deployments.app import (
        THROUGHPUT_MODE_ENV,
        serve_run_starts_ray,
        start_ray_in_throughput_mode,
    )

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["controller_options"]["runtime_env"]["env_vars"] == THROUGHPUT_MODE_ENV
    args = AppArgs(model="m")

    environ: dict[str, str] = {}
    assert start_ray_in_throughput_mode(args, True, environ) == environ == THROUGHPUT_MODE_ENV
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    set_now = start_ray_in_throughput_mode(args, True, environ)
    assert environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert set(set_now) == set(THROUGHPUT_MODE_ENV) - {"RAY_SERVE_ENABLE_HA_PROXY"}
    for knob, starts in ((True, False), (False, True)):
        environ = {}
        assert start_ray_in_throughput_mode(
            AppArgs(model="m", serve_throughput_mode=knob), starts, environ) == {} == environ

    # Whether `serve run` starts Ray: read from the CLI's own click context, resolved as
    # ray.init resolves its address ("local": always a fresh instance; an address: connect).
    monkeypatch.setattr("deployments.app.ray.is_initialized", lambda: False)
    assert not serve_run_starts_ray()  # not under the CLI at all
    run, build = click.Command("run"), click.Command("build")
    for command, address, starts in ((run, "local", True), (run, "127.0.0.1:6379", False),
                                     (build, "local", False)):
        with click.Context(command) as ctx:
            ctx.params["address"] = address
            assert serve_run_starts_ray() is starts, (command.name, address)
    with click.Context(run) as ctx:
        ctx.params["address"] = "local"
        monkeypatch.setattr("deployments.app.ray.is_initialized", lambda: True)
        assert not serve_run_starts_ray()


def test_the_builder_and_the_serving_plane_load_no_torch():
    """Only shard processes need torch: importing the builder (`serve run` imports
    deployments.app), the batcher, which creates the shard actors, or the ingress loads
    neither torch nor transformers (torch alone is two seconds of CPU here, paid on every
    replica start)."""
    import subprocess
    import sys

    code = ("import sys, deployments.app, deployments.batcher, deployments.ingress; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_kv_cache_dtype_reaches_the_shards_and_only_its_values_pass():
    assert AppArgs(model="m").shard_config().kv_cache_dtype == "auto"
    assert AppArgs(model="m", kv_cache_dtype="float16").shard_config().kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        AppArgs(model="m", kv_cache_dtype="fp8")
