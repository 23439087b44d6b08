"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, tensor-parallel.

Module names follow transformers' (`model.layers.N.self_attn...`), except that q/k/v and
gate/up are merged into one matmul each; the loader maps checkpoint names onto them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shards.model.attention import AttentionBackend, AttentionMetadata
from shards.model.config import ModelConfig
from shards.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext, backend: AttentionBackend,
                 rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.attention_bias, tp, dtype)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        False, tp, dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.scale = config.head_dim**-0.5
        self.backend = backend
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotary.split_rotate(positions, self.qkv_proj(x), self.num_heads,
                                           self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    kernels: Any = None  # raygen's CPU kernels (shards/model/layers.py use_cpu_kernels)

    def __init__(self, config: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False, tp, dtype)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext, backend: AttentionBackend,
                 rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, tp, backend, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, tp, dtype)

    def forward(self, positions, x, residual, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext, backend: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp, backend, rotary, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.decode_loop: DecodeLoop | None = None  # set where raygen's CPU kernels run it

    def forward(self, input_ids, positions, kv_caches, meta):
        if self.decode_loop is not None and not meta.prefills:
            return self.decode_loop(input_ids, positions, kv_caches, meta)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]


class DecodeLoop:
    """A step whose rows are all decodes (or drafts, which attend as decodes) on CPU, through
    raygen's kernels in one flat loop: the calls the modules make, in their order, on the
    same tensors (so the same bits), without the modules' dispatch around them (nn.Module
    calls, the attention backend's path for mixed batches, the norm and rotary wrappers).
    Linears go through their own `forward`, which keeps LoRA, the all-reduce of a
    row-parallel product and its bias. One-row steps of SmolLM2's Q4_1 file took 0.80-0.87x
    the time (benchmarks/NOTES.md 80).

    Where the kernels have it, the layers run in one call (their `DecodeStack`, the same
    kernels in the same order): for a step on one rank with no LoRA rows, whose linears'
    routes at its row count are all raygen's kernels or a K x N copy (one stack per row
    count, built at its first step). Other steps take the loop below."""

    def __init__(self, model: DecoderModel, kernels: Any):
        attn = model.layers[0].self_attn
        self.kernels = kernels
        self.embed = model.embed_tokens
        self.norm, self.eps = model.norm.weight, model.norm.eps
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.cos, self.sin = attn.rotary.cos, attn.rotary.sin
        self.layers = [(layer.input_layernorm.weight, layer.self_attn.qkv_proj,
                        layer.self_attn.o_proj, layer.post_attention_layernorm.weight,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj) for layer in model.layers]
        self.native = hasattr(kernels, "DecodeStack") and attn.qkv_proj.tp.world_size == 1
        self._stacks: dict[int, Any] = {}  # rows -> the DecodeStack for them, or None
        self._stacks_kv: list[KVCache] | None = None  # the caches the stacks write
        self._lora: Any = False  # the adapters' shared LoRABatch, None without; False: unread

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        stack = self._stack(input_ids.shape[0], kv_caches) if self.native else None
        if stack is not None:
            return stack.run(self.embed(input_ids), positions, meta.slot_mapping,
                             meta.decode_block_tables, meta.decode_seq_lens)
        k, eps = self.kernels, self.eps
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        v_from = (heads + kv_heads) * head_dim
        x, residual = self.embed(input_ids), None
        for (norm_in, qkv_proj, o_proj, norm_post, gate_up_proj, down_proj), (k_cache, v_cache) \
                in zip(self.layers, kv_caches, strict=True):
            h, residual = k.add_rms_norm(x, residual, norm_in, eps)
            qkv = qkv_proj.forward(h)
            q, key = k.rotary_qk(qkv, positions, self.cos, self.sin, heads, kv_heads, head_dim)
            k.write_kv(key, qkv[:, v_from:].reshape(-1, kv_heads, head_dim), k_cache, v_cache,
                       meta.slot_mapping)
            out = k.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                 meta.decode_seq_lens, self.scale)
            h, residual = k.add_rms_norm(o_proj.forward(out.reshape(-1, heads * head_dim)),
                                         residual, norm_post, eps)
            x = down_proj.forward(k.silu_mul(gate_up_proj.forward(h)))
        return k.add_rms_norm(x, residual, self.norm, eps)[0]

    def _stack(self, rows: int, kv_caches: list[KVCache]) -> Any:
        if self._lora is False:  # adapters attach after this loop is made, before any step
            self._lora = next((linear.lora.batch for layer in self.layers
                               for linear in layer[1:3] + layer[4:]
                               if linear.lora is not None), None)
        if self._lora is not None and self._lora.runs:
            return None
        if kv_caches is not self._stacks_kv:  # caches allocated anew
            self._stacks, self._stacks_kv = {}, kv_caches
        if rows not in self._stacks:
            self._stacks[rows] = self._build(rows, kv_caches)
        return self._stacks[rows]

    def _build(self, rows: int, kv_caches: list[KVCache]) -> Any:
        stack = self.kernels.DecodeStack(self.heads, self.kv_heads, self.head_dim, self.scale,
                                         self.eps, self.cos, self.sin, self.norm)
        for (norm_in, qkv_proj, o_proj, norm_post, gate_up_proj, down_proj), (k_cache, v_cache) \
                in zip(self.layers, kv_caches, strict=True):
            linears = (qkv_proj, o_proj, gate_up_proj, down_proj)
            routes = [linear.native_route(rows) for linear in linears]
            # A row-parallel bias is added after the product (and its all-reduce), not in it.
            if None in routes or o_proj.bias is not None or down_proj.bias is not None:
                return None
            stack.add_layer(norm_in, norm_post, [r[0] for r in routes], [r[1] for r in routes],
                            [r[2] for r in routes], [linear.weight_shape[0] for linear in linears],
                            [qkv_proj.bias, None, gate_up_proj.bias, None], k_cache, v_cache)
        return stack


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPContext, backend: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp, backend, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0, None on the other ranks."""
        return self.lm_head(hidden)
