"""A rank's LoRA adapters: those loaded, each in a slot of the batch's LoRA products, and
those read ahead of the step that loads them."""

from __future__ import annotations

import logging
import threading
import time

import torch

from shards.checkpoints.adapters import AdapterError
from shards.model.lora import LoRAAdapters, StagedAdapter, adapted_layers, read_adapter

logger = logging.getLogger(__name__)

# Adapters read ahead (stage) whose loading step has not come yet: a few at most.
MAX_STAGED_ADAPTERS = 4


class RankAdapters:
    def __init__(self, model: torch.nn.Module, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels, preloaded: tuple[tuple[str, str], ...] = ()):
        """`kernels`: raygen's CPU kernels, which come with its attention backend (None:
        torch's products, the pure-torch reference); `preloaded`: (name, path) of the
        adapters the rank starts with, in slots 1, 2, ..."""
        self.model, self.max_rank, self.dtype, self.device = model, max_rank, dtype, device
        self.kernels = kernels
        self.lora: LoRAAdapters | None = None  # made at the first adapter
        # stage's, written on the shard actor's other thread, taken by steps
        self.staged: dict[tuple[str, str], StagedAdapter] = {}
        self._lock = threading.Lock()
        for slot, (name, path) in enumerate(preloaded, start=1):
            spec = self._loaded().load(name, path, slot)
            logger.info("LoRA adapter %s: rank %d over %s (%s)", name, spec.rank,
                        ", ".join(spec.target_modules), path)

    def _loaded(self) -> LoRAAdapters:
        if self.lora is None:
            self.lora = LoRAAdapters(self.model, self.max_rank, self.dtype, self.device,
                                     self.kernels)
        return self.lora

    def slot(self, adapter: str | None) -> int:
        """The slot of a request's adapter (0: the base model)."""
        if adapter is None:
            return 0
        if self.lora is None or adapter not in self.lora.slots:
            raise ValueError(f"LoRA adapter {adapter!r} is not loaded on this shard")
        return self.lora.slots[adapter]

    def set_batch(self, runs: list[tuple[int, int, int]], num_decodes: int,
                  device: torch.device) -> None:
        """The step's rows by adapter: (slot, first row, end row); none after the step."""
        if self.lora is not None:
            self.lora.batch.set(runs, num_decodes, device)

    def change(self, name: str, path: str | None) -> None:
        """Load (`path`) or drop (None) a LoRA adapter, at the same step on every rank: the
        engine checked it can be served (shards/checkpoints/adapters.py) and that no
        request of a dropped one is left."""
        if path is None:
            with self._lock:  # read ahead by a request that came too late
                for key in [k for k in self.staged if k[0] == name]:
                    del self.staged[key]
            if self.lora is not None and name in self.lora.slots:
                self.lora.unload(name)
                logger.info("LoRA adapter %s dropped", name)
            return
        lora = self._loaded()
        used = set(lora.slots.values())
        slot = next(s for s in range(1, len(used) + 2) if s not in used)
        t0 = time.perf_counter()
        with self._lock:
            staged = self.staged.pop((name, path), None)
        spec = lora.load(name, path, slot, staged)
        logger.info("LoRA adapter %s: rank %d over %s (%s), loaded in %.2f s", name, spec.rank,
                    ", ".join(spec.target_modules), path, time.perf_counter() - t0)

    def stage(self, name: str, path: str) -> None:
        """Read the LoRA adapter at `path` and lay it out for this rank ahead of the step
        that loads it, which then only copies it into place: called beside the steps (the
        shard actor's other thread), since reading it inside a step stalled every stream
        for that long. A bad one is left for that step to refuse."""
        layers = self.lora.layers if self.lora is not None else adapted_layers(self.model)
        t0 = time.perf_counter()
        try:
            staged = read_adapter(self.model, layers, self.max_rank, name, path, self.dtype,
                                  self.device)
        except AdapterError:
            return
        with self._lock:
            while len(self.staged) >= MAX_STAGED_ADAPTERS:  # never loaded: oldest go
                self.staged.pop(next(iter(self.staged)))
            self.staged[(name, path)] = staged
        logger.info("LoRA adapter %s read ahead of its step in %.2f s", name,
                    time.perf_counter() - t0)
