"""LoRA adapters in PEFT's format over the model's linears, several adapters in one step.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes it. For each linear it adapts, a layer keeps per adapter
A (r x K) and B (N x r), PEFT's scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) folded
into B. A step groups its rows by adapter in runs of consecutive rows (the runner orders
them so), and adds `(x A^T) B^T` to each run's output: one shrink, one expand per run.

Tensor parallel as the layer it adapts: a column-parallel layer (q/k/v, gate/up) keeps A
whole and its own rows of B; a row-parallel one (o, down) keeps its own columns of A and B
whole, and adds its partial delta before the all-reduce, which sums them (the delta is
linear in x). The merged layers keep their parts' A stacked along the rank and one B per
part, each added to that part's columns of the output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shards.checkpoints.adapters import (
    TARGETS,
    WEIGHTS_FILE,
    AdapterError,
    AdapterSpec,
    module_of,
    read_adapter_config,
)


@dataclass
class LoRABatch:
    """This step's rows by adapter: (slot, first row, end row) runs; slot 0 (the base)
    is left out. Set by the runner before each forward, read by every adapted layer."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)


class LoRALinear:
    """One linear's adapters: slot -> (A stacked over the parts, [(part's output columns,
    its rank columns in A's output, B)])."""

    def __init__(self, layer: nn.Module, batch: LoRABatch, dtype: torch.dtype):
        self.layer = layer
        self.batch = batch
        self.dtype = dtype  # the activations'
        self.slots: dict[int, tuple[torch.Tensor, list[tuple[slice, slice, torch.Tensor]]]] = {}

    def add(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
            scale: float, name: str) -> None:
        """`parts`: part index -> (A as in the file, B as in the file), each sliced here
        for this rank."""
        layer = self.layer
        a_blocks, bs, rank_at = [], [], 0
        row_parallel = not hasattr(layer, "shard_range")
        for index in sorted(parts):
            a, b = parts[index]
            if row_parallel:
                local = layer.local_input_size
                if a.shape[1] != layer.input_size:
                    raise ValueError(f"{name}: lora_A has {a.shape[1]} inputs, the model's "
                                     f"layer {layer.input_size}")
                a = a[:, layer.start:layer.start + local]
                out = slice(0, layer.output_size)
                if b.shape[0] != layer.output_size:
                    raise ValueError(f"{name}: lora_B has {b.shape[0]} outputs, the model's "
                                     f"layer {layer.output_size}")
            else:
                offset, start, length = layer.shard_range(index)
                if a.shape[1] != layer.input_size or b.shape[0] != layer.part_sizes[index]:
                    raise ValueError(
                        f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit the "
                        f"model's ({layer.part_sizes[index]} x {layer.input_size}) layer")
                b = b[start:start + length]
                out = slice(offset, offset + length)
            rank = a.shape[0]
            a_blocks.append(a)
            bs.append((out, slice(rank_at, rank_at + rank),
                       (b.float() * scale).to(self.dtype).t().contiguous()))
            rank_at += rank
        a_all = torch.cat(a_blocks).to(self.dtype).t().contiguous()  # K x R
        self.slots[slot] = (a_all, bs)

    def remove(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += this step's adapters' deltas, run by run (y is the layer's fresh output)."""
        for slot, start, end in self.batch.runs:
            held = self.slots.get(slot)
            if held is None:  # this layer is not adapted by that adapter
                continue
            a, bs = held
            shrunk = torch.mm(x[start:end], a)
            out = y[start:end]
            for columns, ranks, b in bs:
                out[:, columns].addmm_(shrunk[:, ranks], b)
        return y


def adapted_layers(model: nn.Module) -> dict[tuple[int, str], nn.Module]:
    """(layer index, raygen module name) -> that linear, for every linear LoRA can adapt."""
    found = {}
    for i, layer in enumerate(model.model.layers):
        found[(i, "qkv_proj")] = layer.self_attn.qkv_proj
        found[(i, "o_proj")] = layer.self_attn.o_proj
        found[(i, "gate_up_proj")] = layer.mlp.gate_up_proj
        found[(i, "down_proj")] = layer.mlp.down_proj
    return found


class LoRAAdapters:
    """The adapters one rank holds, by slot (1, 2, ...; 0 is the base model)."""

    def __init__(self, model: nn.Module, max_rank: int, dtype: torch.dtype):
        self.model = model
        self.max_rank = max_rank
        self.dtype = dtype
        self.batch = LoRABatch()
        self.layers = adapted_layers(model)
        self.slots: dict[str, int] = {}
        for layer in self.layers.values():
            layer.lora = LoRALinear(layer, self.batch, dtype)

    def load(self, name: str, path: str, slot: int) -> AdapterSpec:
        """Read the adapter at `path` into `slot`; nothing changes if it cannot be served."""
        spec = read_adapter_config(name, path, self.max_rank)
        weights: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                layer, module, ab = module_of(key)
                target, part = TARGETS[module]
                if (layer, target) not in self.layers:
                    raise AdapterError(
                        f"LoRA adapter {name!r} ({path}): tensor {key} adapts layer {layer}; "
                        f"the model has {len(self.model.model.layers)} (is it an adapter of "
                        "another base model?)")
                weights.setdefault((layer, target), {}).setdefault(part, {})[ab] = \
                    f.get_tensor(key)
        staged = []
        for where, parts in weights.items():
            for part, ab in parts.items():
                if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
                    raise AdapterError(f"LoRA adapter {name!r} ({path}): layer {where[0]} "
                                       f"{where[1]} part {part} lacks a matching lora_A/lora_B")
            scratch = LoRALinear(self.layers[where], self.batch, self.dtype)
            try:
                scratch.add(slot, {p: (ab["A"], ab["B"]) for p, ab in parts.items()},
                            spec.scale, f"layer {where[0]} {where[1]}")
            except ValueError as e:
                raise AdapterError(f"LoRA adapter {name!r} ({path}): {e} (is it an adapter "
                                   "of another base model?)") from None
            staged.append((where, scratch.slots[slot]))
        for where, held in staged:
            self.layers[where].lora.slots[slot] = held
        self.slots[name] = slot
        return spec

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        for layer in self.layers.values():
            layer.lora.remove(slot)
