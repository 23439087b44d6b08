"""A Llama-family checkpoint's config.json, read into one typed record.

Covers Llama (1-3.x), Mistral and Qwen2 as transformers 4.x and 5.x write them
(5.x moved `rope_theta` / `rope_scaling` into `rope_parameters`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shards.checkpoints import resolve as checkpoint
from shards.checkpoints.resolve import CheckpointError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    checkpoint_dtype: str  # torch's name of the weights' dtype ("bfloat16"); no torch here
    eos_token_ids: frozenset[int]
    bos_token_id: int | None

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each attention and MLP projection, by transformers' names."""
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.hidden_size
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (self.intermediate_size, h), "up_proj": (self.intermediate_size, h),
                "down_proj": (h, self.intermediate_size)}

    @classmethod
    def from_pretrained(cls, model: str | Path) -> ModelConfig:
        """The config of the checkpoint `model` names (a Hugging Face directory or a
        GGUF file: shards/checkpoints/resolve.py); CheckpointError where it cannot be served."""
        model_dir = Path(checkpoint.model_dir(str(model)))
        try:
            raw = json.loads((model_dir / "config.json").read_text())
        except ValueError as exc:
            raise CheckpointError(f"model={model}: config.json is not valid JSON: {exc}") from exc
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(f"model={model}: model_type {model_type!r} is not "
                                  f"implemented; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                                     != "default" else None)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise CheckpointError(f"model={model}: rope scaling {rope_type!r} is not "
                                      "implemented")
            rope_scaling = (None if rope_type == "default"
                            else {**rope_scaling, "rope_type": rope_type})
        if raw.get("sliding_window") and raw.get("use_sliding_window", True) and (
                raw["sliding_window"] < raw.get("max_position_embeddings", 0)):
            logger.warning("sliding_window=%s is not applied: attention is global",
                           raw["sliding_window"])
        num_heads = raw["num_attention_heads"]
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            checkpoint_dtype=dtype_name,
            eos_token_ids=_eos_ids(model_dir, raw),
            bos_token_id=raw.get("bos_token_id"),
        )


def _eos_ids(model_dir: Path, raw: dict) -> frozenset[int]:
    """config.json's eos plus generation_config.json's (chat models list several)."""
    ids: set[int] = set()
    sources = [raw]
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return frozenset(ids)
