"""Test doubles that reach into Ray's worker processes, so the production shard carries
no test hooks.

`slow_steps_runtime_env(path)`, passed to `ray.init(runtime_env=...)`, makes every shard
rank sleep before each step that admits new requests, as long as the JSON file at `path`
says for the model it serves (`set_slow_steps(path, {model_dir: seconds})`; read at each
such step, so a module changes the delays between its tests without restarting its apps):
steps of any length without long prompts. Ray runs the setup hook in each worker process
before any actor starts in it; a replica's or shard's own runtime_env (env_vars only)
merges with it. Point each slow app at its own path (a symlink to the model, `slow_model`)
so apps beside it keep their speed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SLOW_STEPS_ENV = "RAYGEN_TEST_SLOW_STEPS"
ROOT = Path(__file__).resolve().parents[1]


def slow_steps_runtime_env(path: Path) -> dict:
    # The hook is imported before Ray adds the driver's paths: PYTHONPATH finds `tests`.
    search = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"worker_process_setup_hook": "tests.doubles.install_slow_steps",
            "env_vars": {SLOW_STEPS_ENV: str(path), "PYTHONPATH": search}}


def set_slow_steps(path: Path, delays: dict[str, float]) -> None:
    """Each model path's delay in seconds, for the steps that start after this returns."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(delays))
    tmp.replace(path)  # a step never reads half a file


def slow_model(model_dir: str, directory: Path) -> str:
    """A second path to `model_dir` (a symlink in `directory`) to key a delay on."""
    link = directory / f"slow-{Path(model_dir).name}"
    if not link.exists():
        link.symlink_to(Path(model_dir).resolve(), target_is_directory=True)
    return str(link)


def install_slow_steps() -> None:
    path = os.environ.get(SLOW_STEPS_ENV)
    if not path:
        return
    from shards.worker.actor import ShardActor  # only in these tests' workers: it loads torch

    step = ShardActor._step

    def slow_step(self, step_input):
        if step_input.new_requests:
            delays: dict[str, float] = json.loads(Path(path).read_text())
            time.sleep(delays.get(self.config.model, 0.0))
        return step(self, step_input)

    ShardActor._step = slow_step
