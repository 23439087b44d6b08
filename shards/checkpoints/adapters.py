"""LoRA adapters as PEFT saves them, read and checked without torch (the builder checks
them before Ray starts; shards/model/lora.py puts them on the model's linears).

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes it, of LoRA weights for the attention and MLP projections."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.checkpoints.resolve import CheckpointError

# PEFT's module name -> (raygen's module, part within a merged one)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class AdapterError(CheckpointError):
    """An adapter that cannot be served: the message names the adapter and the reason."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What `adapter_config.json` says, checked against what raygen serves."""

    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    base_model: str | None = None


def read_adapter_config(name: str, path: str | Path, max_rank: int,
                        model: Any = None) -> AdapterSpec:
    """The adapter at `path`, or AdapterError saying why it cannot be served. Reads only
    the config and the safetensors header (names and shapes): cheap enough for a builder.
    With `model` (shards.model.config.ModelConfig), its tensors' shapes are checked too."""
    root = Path(path)

    def fail(reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {reason}")

    if not root.is_dir():
        raise fail("no such directory")
    if not (root / CONFIG_FILE).is_file():
        raise fail(f"no {CONFIG_FILE} (a PEFT adapter directory holds one)")
    if not (root / WEIGHTS_FILE).is_file():
        raise fail(f"no {WEIGHTS_FILE} (PEFT's save_pretrained writes one)")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise fail(f"{CONFIG_FILE} is not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    unsupported = [(key, config[key]) for key, off in (
        ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
        ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
        ("layers_to_transform", None), ("use_qalora", False))
        if config.get(key, off) not in (off, None, {}, [], "none", False)]
    if unsupported:
        key, value = unsupported[0]
        raise fail(f"{key}={value!r} is not supported")
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        raise fail(f"rank {rank} is over max_lora_rank={max_rank}" if rank > max_rank
                   else f"rank {rank} is not positive")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = set()
    try:
        shapes = safetensors_shapes(root / WEIGHTS_FILE)
    except (OSError, ValueError) as e:
        raise fail(f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None
    for key, shape in shapes.items():
        module = module_of(key)
        if module is None:
            raise fail(f"tensor {key} adapts no linear raygen serves (it adapts "
                       f"{', '.join(TARGETS)})")
        modules.add(module[1])
        if model is not None:
            layer, name_, ab = module
            out, inp = model.projection_shapes[name_]
            want = [rank, inp] if ab == "A" else [out, rank]
            if layer >= model.num_layers or len(shape) != 2 or (
                    ab == "A" and shape[1] != inp) or (ab == "B" and shape[0] != out):
                raise fail(f"tensor {key} of shape {shape} does not fit the model ({want}, "
                           f"{model.num_layers} layers): an adapter of another base model?")
    if not modules:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterSpec(name, str(root), rank, scale, tuple(sorted(modules)),
                       config.get("base_model_name_or_path"))


def module_of(key: str) -> tuple[int, str, str] | None:
    """`base_model.model.model.layers.3.mlp.up_proj.lora_A.weight` -> (3, "up_proj", "A")."""
    parts = key.split(".")
    if len(parts) < 4 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        return None
    module = parts[-3]
    if module not in TARGETS or "layers" not in parts:
        return None
    layer = parts[parts.index("layers") + 1]
    if not layer.isdigit():
        return None
    return int(layer), module, parts[-2][-1]


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """The tensors of a safetensors file and their shapes, from its JSON header."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
    return {key: list(v["shape"]) for key, v in header.items() if key != "__metadata__"}


def parse_lora_adapters(value: str | dict | None) -> tuple[tuple[str, str], ...]:
    """`name=path,name=path` (TGI's LORA_ADAPTERS) or a mapping -> ((name, path), ...).
    A bare path is named after its directory, as TGI names it."""
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else [
        part.partition("=")[::2] if "=" in part else (Path(part).name, part)
        for part in (p.strip() for p in value.split(",")) if part]
    pairs = tuple((str(name).strip(), str(path).strip()) for name, path in items)
    names = [name for name, _ in pairs]
    for name, path in pairs:
        if not name or not path or ":" in name or "@" in name:
            raise ValueError(f"lora_adapters: {name}={path}: give each adapter as name=path, "
                             "a name without ':' or '@'")
    if len(set(names)) != len(names):
        raise ValueError(f"lora_adapters: a name is given twice: {names}")
    return pairs

