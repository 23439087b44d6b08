"""LoRA adapters in PEFT's format over the model's linears, several adapters in one step.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes it. For each linear it adapts, a layer keeps per adapter
A (r x K) and B (N x r), PEFT's scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) folded
into B, and adds `(x A^T) B^T` to the output rows of the requests of that adapter: every
adapter's A and B side by side, two products and a mask per layer (LoRALinear).

Tensor parallel as the layer it adapts: a column-parallel layer (q/k/v, gate/up) keeps A
whole and its own rows of B; a row-parallel one (o, down) keeps its own columns of A and B
whole, and adds its partial delta before the all-reduce, which sums them (the delta is
linear in x). The merged layers keep their parts' A stacked along the rank, and their B
placed in their parts' output columns."""

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
    """This step's rows by adapter, set by the runner before each forward and read by every
    adapted layer. `runs`: (slot, first row, end row) of each request of an adapter (slot 0,
    the base, left out). The first `single_rows` rows are one-row requests (decodes, mixed
    adapters): their slots are `row_slots`, and the layers' masks over them are made once a
    step per column layout. The other runs (prefill chunks, drafts) go one by one."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    single_rows: int = 0
    row_slots: torch.Tensor | None = None
    slot_list: list[int] = field(default_factory=list)
    long_runs: list[tuple[int, int, int]] = field(default_factory=list)
    masks: dict = field(default_factory=dict)

    def set(self, runs: list[tuple[int, int, int]], single_rows: int, device) -> None:
        self.runs, self.masks, self.single_rows = runs, {}, single_rows
        self.long_runs = [run for run in runs if run[1] >= single_rows]
        self.row_slots = None
        if len(self.long_runs) < len(runs):
            self.slot_list = [0] * single_rows
            for slot, start, end in runs:
                if start < single_rows:
                    self.slot_list[start:end] = [slot] * (end - start)
            self.row_slots = torch.tensor(self.slot_list, dtype=torch.long, device=device)

    def mask(self, layout: tuple, column_slots: torch.Tensor, dtype) -> torch.Tensor:
        """rows x columns: 1 where the column belongs to the row's adapter."""
        found = self.masks.get(layout)
        if found is None:
            found = (self.row_slots[:, None] == column_slots[None, :]).to(dtype)
            self.masks[layout] = found
        return found

    def row_columns(self, layout: tuple, columns: dict[int, tuple[int, int]]) -> torch.Tensor:
        """rows x 2: each one-row request's adapter's columns [from, to) ((0, 0): none)."""
        key = ("columns", layout)
        found = self.masks.get(key)
        if found is None:
            found = torch.tensor([columns.get(slot, (0, 0)) for slot in self.slot_list],
                                 dtype=torch.long)
            self.masks[key] = found
        return found


class LoRALinear:
    """One linear's adapters. Each adapter's A (this rank's slice, stacked over a merged
    layer's parts) and B (its parts' rows placed in their output columns, the scale folded
    in) side by side in one product each: a step multiplies its one-row requests' rows by
    every adapter's A (a few columns each), masks the columns of other adapters than the
    row's, and adds the product with every B: two products and a mask however many adapters
    the decodes mix (the extra work is rows x (K + N) x the loaded adapters' ranks). A run
    of rows of one request (a prefill chunk) is multiplied by its own adapter's columns.

    The adapters' columns of A^T (K x r each) and rows of B^T (r x N) fill buffers with room
    to grow, so that loading one copies only its own (in the step that carries the load;
    read from its files beside the steps before, ModelRunner.stage_adapter).
    (A^T's columns in a K x room buffer: a product by its first columns ran 0.7-0.9x the
    time of one by A's first rows transposed, here.)"""

    def __init__(self, layer: nn.Module, batch: LoRABatch, dtype: torch.dtype,
                 device: torch.device, kernels=None):
        self.layer = layer
        # raygen's CPU kernel for the one-row requests: each row by its own adapter's
        # columns in one call (benchmarks/NOTES.md 62); the masked product elsewhere.
        self.kernels = kernels if dtype == torch.float32 and device.type == "cpu" else None
        self.batch = batch
        self.dtype, self.device = dtype, device  # the activations'
        # slot -> (A: r x K, B^T: r x N), r over the parts; [0, used) of the buffers
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.used = 0
        self.a_cols = self.a_rows = self.b_rows = self.column_slots = None
        self.columns: dict[int, tuple[int, int]] = {}  # slot -> its columns [from, to)
        self.layout: tuple = ()  # ((slot, rank), ...) in buffer order

    def add(self, slot: int, prepared: tuple[torch.Tensor, torch.Tensor]) -> None:
        a, b = prepared
        rank = a.shape[0]
        if self.a_cols is None or self.used + rank > self.a_cols.shape[1]:
            self._grow(max(8 * rank, 2 * (self.used + rank)), a.shape[1], b.shape[1])
        end = self.used + rank
        self.a_cols[:, self.used:end] = a.t()
        self.a_rows[self.used:end] = a
        self.b_rows[self.used:end] = b
        self.column_slots[self.used:end] = slot
        self.columns[slot] = (self.used, end)
        self.slots[slot], self.used = prepared, end
        self.layout += ((slot, rank),)

    def remove(self, slot: int) -> None:
        if self.slots.pop(slot, None) is None:
            return
        kept, self.used, self.layout = dict(self.slots), 0, ()
        self.slots.clear()
        self.columns.clear()
        for other, prepared in kept.items():  # the others, packed again in their order
            self.add(other, prepared)

    def _grow(self, rows: int, k: int, n: int) -> None:
        a = torch.zeros(k, rows, dtype=self.dtype, device=self.device)
        a_rows = torch.zeros(rows, k, dtype=self.dtype, device=self.device)
        b = torch.zeros(rows, n, dtype=self.dtype, device=self.device)
        slots = torch.full((rows,), -1, dtype=torch.long, device=self.device)
        if self.used:
            a[:, :self.used], b[:self.used] = self.a_cols[:, :self.used], self.b_rows[:self.used]
            a_rows[:self.used] = self.a_rows[:self.used]
            slots[:self.used] = self.column_slots[:self.used]
        self.a_cols, self.a_rows, self.b_rows, self.column_slots = a, a_rows, b, slots

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += this step's adapters' deltas (y is the layer's fresh output)."""
        if not self.used:
            return y
        batch, used = self.batch, self.used
        if batch.row_slots is not None and self.kernels is not None:
            d = batch.single_rows
            self.kernels.lora_add(x[:d], y[:d], self.a_rows, self.b_rows,
                                  batch.row_columns(self.layout, self.columns))
        elif batch.row_slots is not None:
            d = batch.single_rows
            mask = batch.mask(self.layout, self.column_slots[:used], x.dtype)
            y[:d].addmm_(torch.mm(x[:d], self.a_cols[:, :used]).mul_(mask), self.b_rows[:used])
        for slot, start, end in batch.long_runs:
            columns = self.columns.get(slot)
            if columns is not None:
                c0, c1 = columns
                y[start:end].addmm_(torch.mm(x[start:end], self.a_cols[:, c0:c1]),
                                    self.b_rows[c0:c1])
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

    def __init__(self, model: nn.Module, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels=None):
        """`kernels`: raygen's CPU kernel module where the shard uses it (None: torch)."""
        self.model = model
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.layers = adapted_layers(model)
        self.slots: dict[str, int] = {}
        for layer in self.layers.values():
            layer.lora = LoRALinear(layer, self.batch, dtype, device,
                                    kernels if hasattr(kernels, "lora_add") else None)

    def load(self, name: str, path: str, slot: int,
             staged: StagedAdapter | None = None) -> AdapterSpec:
        """The adapter at `path` into `slot`, from `staged` where it was read ahead
        (`read_adapter`); nothing changes if it cannot be served."""
        spec, prepared_layers = staged or read_adapter(
            self.model, self.layers, self.max_rank, name, path, self.dtype, self.device)
        for where, prepared in prepared_layers:  # all checked: now the layers take it
            self.layers[where].lora.add(slot, prepared)
        self.slots[name] = slot
        return spec

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        for layer in self.layers.values():
            layer.lora.remove(slot)


# An adapter read and laid out for the layers it adapts, in none yet: its spec and, for
# each of those layers, ((layer index, module), (A, B^T)).
StagedAdapter = tuple[AdapterSpec,
                      list[tuple[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]]


def read_adapter(model: nn.Module, layers: dict[tuple[int, str], nn.Module], max_rank: int,
                 name: str, path: str, dtype: torch.dtype,
                 device: torch.device) -> StagedAdapter:
    """Read the adapter at `path` and lay it out for `layers` (adapted_layers(model)) on
    this rank; AdapterError if it cannot be served. It reads the layers' shapes and writes
    nothing a step reads, so it may run beside a step (ModelRunner.stage_adapter)."""
    spec = read_adapter_config(name, path, max_rank)
    weights: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            layer, module, ab = module_of(key)
            target, part = TARGETS[module]
            if (layer, target) not in layers:
                raise AdapterError(
                    f"LoRA adapter {name!r} ({path}): tensor {key} adapts layer {layer}; "
                    f"the model has {len(model.model.layers)} (is it an adapter of "
                    "another base model?)")
            weights.setdefault((layer, target), {}).setdefault(part, {})[ab] = \
                f.get_tensor(key)
    staged = []
    for where, parts in weights.items():
        for part, ab in parts.items():
            if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
                raise AdapterError(f"LoRA adapter {name!r} ({path}): layer {where[0]} "
                                   f"{where[1]} part {part} lacks a matching lora_A/lora_B")
        try:
            staged.append((where, prepare(
                layers[where], {p: (ab["A"], ab["B"]) for p, ab in parts.items()},
                spec.scale, f"layer {where[0]} {where[1]}", dtype, device)))
        except ValueError as e:
            raise AdapterError(f"LoRA adapter {name!r} ({path}): {e} (is it an adapter "
                               "of another base model?)") from None
    return spec, staged


def prepare(layer: nn.Module, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
            scale: float, name: str, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's (A, B^T) rows for `layer` on this rank, from `parts`: part index ->
    (A as in the file, B as in the file); ValueError if their shapes do not fit."""
    row_parallel = not hasattr(layer, "shard_range")
    width = layer.output_size if row_parallel else sum(layer.local_sizes)
    a_blocks, b_blocks = [], []
    for index in sorted(parts):
        a, b = parts[index]
        if row_parallel:
            if a.shape[1] != layer.input_size:
                raise ValueError(f"{name}: lora_A has {a.shape[1]} inputs, the model's "
                                 f"layer {layer.input_size}")
            if b.shape[0] != layer.output_size:
                raise ValueError(f"{name}: lora_B has {b.shape[0]} outputs, the model's "
                                 f"layer {layer.output_size}")
            a = a[:, layer.start:layer.start + layer.local_input_size]
            offset, length = 0, layer.output_size
        else:
            offset, start, length = layer.shard_range(index)
            if a.shape[1] != layer.input_size or b.shape[0] != layer.part_sizes[index]:
                raise ValueError(
                    f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit the "
                    f"model's ({layer.part_sizes[index]} x {layer.input_size}) layer")
            b = b[start:start + length]
        placed = torch.zeros(a.shape[0], width)
        placed[:, offset:offset + length] = b.float().t() * scale
        a_blocks.append(a.float())  # r x K
        b_blocks.append(placed)  # r x N
    return torch.cat(a_blocks).to(device, dtype), torch.cat(b_blocks).to(device, dtype)
