"""Attention over a paged KV cache, one interface with several implementations.

Cache layout per layer: k and v each `[num_blocks, block_size, num_kv_heads, head_dim]`,
the layout flash kernels take with a block table. A batch mixes decodes (one query token)
and prefill chunks (many, possibly after a cached prefix); the runner puts decodes first.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    start: int  # query rows [start, end) in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor  # the blocks covering context_len + (end - start) tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes]
    prefills: list[PrefillSeq]
    # Varlen view of the whole batch, for flash kernels (None on the torch backend).
    cu_seqlens_q: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


class AttentionBackend:
    name = "base"
    needs_varlen_metadata = False
    # A prefill chunk whose context (cached tokens and its own) is at most this long is
    # given to the backend as decode rows, one a token, each attending up to its position
    # (shards/worker/batch.py `metadata`); 0: never.
    prefill_as_decodes_max_tokens = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens; returns [T, H, D]."""
        raise NotImplementedError


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """cache[block_ids] as [*block_ids.shape, block_size, KVH, D] in `dtype` (a float16
    cache is widened to the activations'). `index_select` on the flattened ids, not
    advanced indexing: the same bytes, 3-4x faster on CPU (the indexing kernel walks every
    element through a generic iterator; this copies whole rows)."""
    rows = cache.index_select(0, block_ids.flatten()).to(dtype)
    return rows.view(*block_ids.shape, *cache.shape[1:])


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., KVH, L, D] -> [..., H, L, D] for grouped-query attention."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


class TorchAttentionBackend(AttentionBackend):
    """The reference: plain torch, any device. Decodes in one batched SDPA over gathered
    blocks; each prefill chunk in its own SDPA (a first chunk exactly as transformers
    computes it, from the fresh k and v)."""

    name = "torch"
    write_kv = staticmethod(write_kv)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_heads = q.shape[1]
        n = meta.num_decodes
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta, scale, num_heads)
        for seq in meta.prefills:
            qs = q[seq.start : seq.end].transpose(0, 1)  # [H, n, D]
            if seq.context_len == 0:
                ks, vs = k[seq.start : seq.end], v[seq.start : seq.end]
                mask, causal = None, True
            else:
                seq_len = seq.context_len + seq.end - seq.start
                ks = gather_blocks(k_cache, seq.block_ids, q.dtype).flatten(0, 1)[:seq_len]
                vs = gather_blocks(v_cache, seq.block_ids, q.dtype).flatten(0, 1)[:seq_len]
                mask = torch.ones(seq.end - seq.start, seq_len, dtype=torch.bool,
                                  device=q.device).tril(diagonal=seq.context_len)
                causal = False
            ks = _expand_kv(ks.transpose(0, 1), num_heads)
            vs = _expand_kv(vs.transpose(0, 1), num_heads)
            # With a batch dimension: on CPU, 3-D inputs take SDPA's math path (scores
            # materialised, masks applied op by op); 4-D ones its flash kernel, 2.5-3x
            # faster for a 128- to 512-token chunk (benchmarks/NOTES.md 20).
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                               is_causal=causal, scale=scale)[0]
            out[seq.start : seq.end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, num_heads):
        tables = meta.decode_block_tables
        batch, num_kv_heads = tables.shape[0], k_cache.shape[2]
        # [B, blocks, block_size, KVH, D] -> [B, KVH, L, D]
        ks = gather_blocks(k_cache, tables, q.dtype).flatten(1, 2).transpose(1, 2)
        vs = gather_blocks(v_cache, tables, q.dtype).flatten(1, 2).transpose(1, 2)
        positions = torch.arange(ks.shape[2], device=q.device)
        mask = (positions[None, :] < meta.decode_seq_lens[:, None]).view(batch, 1, 1, -1)
        # GQA without copying K/V: the query heads of one kv head become that head's
        # "query positions" (a single decode token has no causal order among them).
        o = F.scaled_dot_product_attention(q.view(batch, num_kv_heads, -1, q.shape[-1]), ks, vs,
                                           attn_mask=mask, scale=scale)
        return o.reshape(batch, num_heads, -1)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """CPU, float32: decodes through raygen's kernel (shards/cpu/csrc/paged_attention.cpp),
    which reads K and V in place through the block table, with neither the gather nor
    the padding to the longest sequence that the torch path pays (at batch 30 with
    contexts of 40-280 tokens: a decode step 56 -> 38 ms, benchmarks/NOTES.md 19).
    Prefill chunks with up to 512 tokens of context come as decode rows too: on SmolLM2's
    heads the kernel took 0.13x the torch path's time for a 4-token prompt, 0.22x for 16
    tokens after 32 cached, 0.67x for 160 and 0.85x for 512, and lost from 768 on (and
    for 64 rows after 2,000 cached: benchmarks/NOTES.md 101); longer chunks go through the
    torch path."""

    name = "cpu"
    prefill_as_decodes_max_tokens = 512

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # One call for both caches: 1.0 us at one row and 3.9 at 32, where the two
        # index_copy_ took 7.6 and 24 us (benchmarks/NOTES.md 50).
        self.kernel.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta, scale, num_heads):
        return self.kernel.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_seq_lens, scale)


class FlashAttentionBackend(AttentionBackend):
    """CUDA: one varlen kernel call over the whole mixed batch, reading K/V straight from
    the paged cache through the block table (vllm-flash-attn, else flash-attn)."""

    name = "flash"
    needs_varlen_metadata = True

    def __init__(self, block_size: int) -> None:
        self.module_name, self.fn = _import_flash()
        # flash-attn's paged path wants pages of 256 tokens; vllm-flash-attn's, 16.
        page = 256 if self.module_name == "flash_attn" else 16
        if block_size % page:
            raise ImportError(
                f"{self.module_name} needs block_size % {page} == 0, got {block_size}")

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kwargs = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                      softmax_scale=scale, causal=True, block_table=meta.block_tables)
        if self.module_name == "vllm_flash_attn":
            kwargs["seqused_k"] = meta.seq_lens
        else:
            kwargs["cu_seqlens_k"] = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self.fn(**kwargs)


def _import_flash():
    for module_name in ("vllm_flash_attn", "flash_attn"):
        try:
            module = importlib.import_module(module_name)
            return module_name, module.flash_attn_varlen_func
        except ImportError:
            continue
    raise ImportError("neither vllm-flash-attn nor flash-attn is installed")


def _cpu_backend(device: torch.device, dtype: torch.dtype) -> CpuPagedAttentionBackend:
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"the cpu attention backend runs float32 on CPU, not {dtype} on "
                         f"{device.type}")
    from shards.cpu import kernels as cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None:
        raise ImportError(f"the CPU attention kernel did not build: {cpu_kernels.load_error()}")
    return CpuPagedAttentionBackend(kernel)


def select_backend(name: str, device: torch.device, dtype: torch.dtype,
                   block_size: int = 16) -> AttentionBackend:
    """'auto': flash on CUDA with fp16/bf16 when a kernel imports; raygen's CPU kernel on
    CPU in float32 when it builds; torch otherwise."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash":
        return FlashAttentionBackend(block_size)
    if name == "cpu":
        return _cpu_backend(device, dtype)
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}")
    if device.type == "cpu" and dtype == torch.float32:
        try:
            return _cpu_backend(device, dtype)
        except ImportError:  # cpu_kernels logged why
            return TorchAttentionBackend()
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            return FlashAttentionBackend(block_size)
        except ImportError as exc:
            logger.warning("flash attention unavailable (%s); using the torch backend", exc)
    return TorchAttentionBackend()
