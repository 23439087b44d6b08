"""Load a Hugging Face safetensors checkpoint (one file or sharded with an index) into a
model, each rank reading only the slices it keeps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn

from shards.checkpoints.gguf_weights import iter_gguf
from shards.checkpoints.resolve import checkpoint_files, gguf_file
from shards.checkpoints.resolve import model_dir as resolve_model_dir

# checkpoint name part -> (merged module part, index within the merged parameter)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs; a slice reads from disk only when indexed."""
    if (gguf_path := gguf_file(model_dir)) is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        yield from iter_gguf(gguf_path, config)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, checkpoint: str | Path) -> None:
    """Every parameter of `model` from the checkpoint `checkpoint` names (a Hugging Face
    directory, or a GGUF file: shards/checkpoints/resolve.py)."""
    model_dir = resolve_model_dir(str(checkpoint))
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir):
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and tied:
            continue
        target, index = name, 0
        for part, (merged, merged_index) in _MERGED.items():
            if f".{part}." in name:
                target, index = name.replace(f".{part}.", f".{merged}."), merged_index
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} matches no parameter")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor[:])
        else:
            loader(param, tensor, index)
        loaded.add(target)
    if tied:
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights for {sorted(missing)}")
