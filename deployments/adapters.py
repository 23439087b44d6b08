"""The LoRA adapters an application serves, as the ingress replicas see them.

Those named at start (`lora_adapters`) every batcher replica loads as it starts. Those
loaded at run time (vLLM's `POST /v1/load_lora_adapter`) the application's hub keeps
(deployments/metrics_hub.py), each under an id of its own (`name@N`), so that every
ingress replica learns of them and a name loaded again after an unload is never mistaken
for the adapter it replaced; a batcher replica loads one the first time a request of it
reaches the replica (deployments/batcher.py), with its next step."""

from __future__ import annotations

import time
from typing import Any

from shards.checkpoints.adapters import AdapterError, read_adapter_config

# How long an ingress replica trusts what it knows of the run-time adapters before it
# asks the hub again (an unload through another ingress replica takes this long here).
REFRESH_S = 2.0


class AdapterNotFound(LookupError):
    pass


class Adapters:
    """`known`: name -> (the id batchers know it by, its path), shared with the protocol
    adapters' Limits (a live mapping: run-time loads show there at once)."""

    def __init__(self, start: tuple[tuple[str, str], ...], hub: Any, max_rank: int,
                 model_config: Any):
        self.start = {name: (name, path) for name, path in start}
        self.known: dict[str, tuple[str, str]] = dict(self.start)
        self.hub, self.max_rank, self.model_config = hub, max_rank, model_config
        self.refreshed = -1e18

    async def refresh(self) -> None:
        if self.hub is None:
            return
        runtime = await self.hub.adapters.remote()
        self.known.clear()
        self.known.update(self.start)
        self.known.update(runtime)  # never a start name: `load` refuses those
        self.refreshed = time.monotonic()

    async def resolve(self, name: str) -> bool:
        """Whether `name` is an adapter this application serves now."""
        if name in self.start:
            return True
        if name not in self.known or time.monotonic() - self.refreshed > REFRESH_S:
            await self.refresh()
        return name in self.known

    async def load(self, name: str, path: str) -> None:
        """Check the adapter at `path` (AdapterError says why it cannot be served) and
        serve it as `name` from now on; ValueError if the name is taken."""
        if not name or ":" in name or "@" in name:
            raise AdapterError(f"LoRA adapter name {name!r}: give a name without ':' or '@'")
        read_adapter_config(name, path, self.max_rank, self.model_config)
        if self.hub is None:
            raise AdapterError("adapters are loaded at run time through the application's "
                               "hub, which this ingress was built without")
        if name in self.start or await self.hub.add_adapter.remote(name, path) is None:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        await self.refresh()

    async def unload(self, name: str) -> None:
        if name in self.start:
            raise ValueError(f"The lora adapter '{name}' was named at start (lora_adapters): "
                             "it is served until the application is redeployed without it")
        if self.hub is None or not await self.hub.remove_adapter.remote(name):
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        await self.refresh()
