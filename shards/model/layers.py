"""Tensor-parallel building blocks. Each parameter knows how to load its own slice of a
checkpoint tensor (`weight_loader`), so a rank reads only what it keeps; collectives live
inside the layers, so the model reads as if it ran on one device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TPContext:
    rank: int = 0
    world_size: int = 1

    def shard(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's part of a dimension split evenly."""
        if size % self.world_size:
            raise ValueError(f"dimension {size} does not split over {self.world_size} ranks")
        part = size // self.world_size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x


def _read(loaded: Any, start: int | None = None, length: int | None = None,
          dim: int = 0) -> torch.Tensor:
    """Read a full tensor, or one slice of dim 0 or 1, from a tensor or a lazy
    safetensors slice (which reads only the bytes asked for)."""
    if start is None:
        return loaded[:] if not isinstance(loaded, torch.Tensor) else loaded
    if dim == 0:
        return loaded[start : start + length]
    return loaded[:, start : start + length]


def _copy(param: nn.Parameter, offset: int, tensor: torch.Tensor) -> None:
    param.data[offset : offset + tensor.shape[0]].copy_(tensor)


def _keep_blocks(param: nn.Parameter, offset: int, loaded: Any, rows: slice,
                 cols: slice = slice(None)) -> None:
    """Beside the float weights, the same rows as a GGUF file's quantization blocks where
    it holds a type raygen's kernels multiply by (`pack_quantized`)."""
    blocks = getattr(loaded, "blocks", None)
    data = blocks(rows, cols) if blocks is not None else None
    if data is not None:
        if not hasattr(param, "gguf_blocks"):
            param.gguf_blocks = {}
        param.gguf_blocks[offset] = (loaded.kernel_type, data)


class _Matmul(nn.Module):
    """x W^T through torch (MKL on CPU), or through oneDNN on a weight reordered once
    for it (shards/cpu/layouts.py): measured on this project's AMD CPU machine, oneDNN's
    products run 2-3x faster than MKL's at every row count a step has (one row: 42-58
    vs 16 GB/s; benchmarks/NOTES.md). oneDNN is also what vLLM's CPU backend and
    inductor use. Same arithmetic, another summation order.

    One-row products may instead go through MKL on a K x N copy of the weight
    (`transposed`), kept where the shard measured it faster at start-up
    (`time_copy_products`): on one thread MKL streamed a weight past one row faster than
    oneDNN on that machine (a batch-1 step's linears 24-25 against 35-39 ms; NOTES 31), and
    on two bound threads of an Intel Xeon too (12 layers: 11.5 against 15.8 ms; NOTES 45).
    At two rows they tie, and from four oneDNN wins.

    Where raygen's CPU kernels are built with AVX-512, that copy is instead cut into
    64-column panels (`panels`, shards/cpu/csrc/panel_linear.cpp) that torch's threads claim
    one at a time, for steps of up to `panel_rows[1]` rows: oneDNN splits a product in
    fixed shares, so a thread that another process preempts holds the other up at the end
    of every product; here the other takes its share. Alone they take 0.69-0.97x
    oneDNN's time from 2 to 64 rows, tie it at 128-256 and tie MKL's copy at one row;
    beside a busy process 0.84-0.87x at 48-64 rows and 0.75-0.99x at 128-160 (NOTES
    46-48). Which row counts use them is timed at start-up too."""

    packed: torch.Tensor | None = None
    packed_dtype: torch.dtype | None = None  # set where `packed` is bfloat16 for float32 x
    transposed: torch.Tensor | None = None
    panels: torch.Tensor | None = None
    panel_kernels: Any = None  # shards.cpu.kernels' module, which multiplies by `panels`
    panel_rows: tuple[int, int] = (1, 0)  # the row counts (from, to) that use the panels
    weight_shape: tuple[int, int] = (0, 0)  # (N, K), kept when the weight itself is freed
    # The weight as a GGUF file's quantization blocks (`pack_quantized`), for steps of up
    # to `quant_rows` rows.
    quant: torch.Tensor | None = None
    quant_type: int = -1
    quant_rows: int = 0
    quant_kernels: Any = None  # shards.cpu.kernels' module, which multiplies by `quant`
    quant_int8: bool = False  # x rounded to int8 blocks, products in integers
    # `quant` laid out with 8 output rows to a vector (`pack_quant_lanes`), not as the file
    # holds its blocks.
    quant_lanes: bool = False
    # LoRA adapters of this linear (shards/model/lora.py), added to the rows that use them.
    lora: Any = None

    def quant_product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_lanes:
            return self.quant_kernels.linear_quant_lanes(x, self.quant, self.quant_type,
                                                         self.weight_shape[0], bias)
        kernel = self.quant_kernels.linear_quant_i8 if self.quant_int8 \
            else self.quant_kernels.linear_quant
        return kernel(x, self.quant, self.quant_type, self.weight_shape[0], bias)

    def native_route(self, rows: int) -> tuple[int, torch.Tensor, int] | None:
        """`matmul`'s route for a step of `rows` rows as raygen's DecodeStack names it
        (shards/cpu/csrc/ops.h): (route, the weight in its layout, GGUF block type), or
        None where the route is not one of its kernels'. Keep in step with `matmul`."""
        if self.quant is not None and rows <= self.quant_rows:
            route = 0 if self.quant_lanes else 2 if self.quant_int8 else 1
            return route, self.quant, self.quant_type
        if self.panels is not None and self.panel_rows[0] <= rows <= self.panel_rows[1]:
            return 3, self.panels, -1
        if self.transposed is not None and rows == 1:
            return 4, self.transposed, -1
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if self.quant is not None and rows <= self.quant_rows:
            return self.quant_product(x, bias)
        if self.panels is not None and self.panel_rows[0] <= rows <= self.panel_rows[1]:
            return self.panel_kernels.linear_panels(x, self.panels, self.weight_shape[0], bias)
        if self.transposed is not None and rows == 1:
            out = torch.mm(x, self.transposed)
            return out if bias is None else out.add_(bias)
        if self.packed is not None and self.packed_dtype is not None:  # bfloat16 weights
            out = torch.ops.mkldnn._linear_pointwise(x.to(self.packed_dtype), self.packed,
                                                     None, "none", [], "").float()
            return out if bias is None else out.add_(bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_Matmul):
    """y = x W^T + b with W's output rows split across ranks; no communication.
    `output_sizes` lists the checkpoint tensors merged into one (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes
        self.input_size = input_size
        self.local_sizes = [tp.shard(size)[1] for size in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes), dtype=dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def shard_range(self, index: int) -> tuple[int, int, int]:
        """(offset in this rank's param, start in the checkpoint tensor, length)."""
        offset = sum(self.local_sizes[:index])
        start, length = self.tp.shard(self.output_sizes[index])
        return offset, start, length

    def weight_loader(self, param: nn.Parameter, loaded: Any, index: int = 0) -> None:
        offset, start, length = self.shard_range(index)
        _copy(param, offset, _read(loaded, start, length))
        if param is self.weight:
            _keep_blocks(param, offset, loaded, slice(start, start + length))

    @property
    def part_sizes(self) -> list[int]:
        """The checkpoint tensors' output sizes, whole (before the split over ranks)."""
        return self.output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None or not self.lora.batch.runs else self.lora.apply(x, y)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads split across ranks; kv heads
    split too, or replicated when there are fewer kv heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPContext, dtype: torch.dtype):
        self.head_dim = head_dim
        self.num_local_heads = num_heads // tp.world_size
        self.num_local_kv_heads = max(1, num_kv_heads // tp.world_size)
        self.num_kv_heads = num_kv_heads
        nn.Module.__init__(self)
        self.tp = tp
        if num_heads % tp.world_size:
            raise ValueError(f"{num_heads} heads do not split over {tp.world_size} ranks")
        if num_kv_heads >= tp.world_size and num_kv_heads % tp.world_size:
            raise ValueError(f"{num_kv_heads} kv heads do not split over {tp.world_size} ranks")
        q, kv = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        self.local_sizes = [q, kv, kv]
        self.input_size = hidden_size
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim]
        self.weight = nn.Parameter(torch.empty(q + 2 * kv, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(q + 2 * kv, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def shard_range(self, index: int) -> tuple[int, int, int]:
        offset = sum(self.local_sizes[:index])
        length = self.local_sizes[index]
        if index == 0:
            return offset, self.tp.rank * length, length
        # Rank r uses kv head r * num_kv_heads // world_size when heads are replicated.
        kv_head = self.tp.rank * self.num_kv_heads // self.tp.world_size
        if self.num_kv_heads >= self.tp.world_size:
            kv_head = self.tp.rank * self.num_local_kv_heads
        return offset, kv_head * self.head_dim, length


class RowParallelLinear(_Matmul):
    """y = x W^T + b with W's input columns split across ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.start, local = tp.shard(input_size)
        self.local_input_size = local
        self.weight = nn.Parameter(torch.empty(output_size, local, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda param, loaded, index=0: param.data.copy_(_read(loaded))

    def weight_loader(self, param: nn.Parameter, loaded: Any, index: int = 0) -> None:
        param.data.copy_(_read(loaded, self.start, param.shape[1], dim=1))
        _keep_blocks(param, 0, loaded, slice(None), slice(self.start, self.start + param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.lora is not None and self.lora.batch.runs:
            y = self.lora.apply(x, y)  # this rank's share of the delta, summed with y's
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks; each looks up its own and the partial
    embeddings are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.part = -(-vocab_size // tp.world_size)  # last rank may hold padding rows
        self.start = tp.rank * self.part
        self.weight = nn.Parameter(torch.zeros(self.part, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, index: int = 0) -> None:
        length = max(0, min(self.part, self.vocab_size - self.start))
        _copy(param, 0, _read(loaded, self.start, length))
        if length == self.part:  # no padding rows: the blocks cover the whole parameter
            _keep_blocks(param, 0, loaded, slice(self.start, self.start + length))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.part)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, _Matmul):
    """Logits for this rank's vocabulary rows, gathered on rank 0 (which samples)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.matmul(hidden)
        if self.tp.world_size == 1:
            return logits
        parts = None
        if self.tp.rank == 0:
            parts = [torch.empty_like(logits) for _ in range(self.tp.world_size)]
        dist.gather(logits, parts, dst=0)
        if self.tp.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def use_cpu_kernels(model: nn.Module, kernels: Any) -> int:
    """Run the model's RMSNorms, rotary embeddings and MLP activations (silu(gate) * up)
    through raygen's CPU kernels (float32 on CPU; shards/cpu/csrc/layer_ops.cpp). Per call,
    eager torch took 16-27 us for a norm of 1-32 rows and 36-62 us for a rotation, the
    kernels 2-7 us; 512 rows 1.2 ms and 2.2 ms against 0.1 ms each (benchmarks/NOTES.md
    44); the activation, NOTES 50. Every module whose class declares a `kernels` slot
    takes them. Returns the modules switched."""
    switched = 0
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels
            switched += 1
    return switched


class RMSNorm(nn.Module):
    # raygen's CPU kernels (shards/cpu/kernels.py), set by `use_cpu_kernels`: the same
    # computation in one pass instead of seven ops.
    kernels: Any = None

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize x + residual; also return that sum, the next residual."""
        if self.kernels is not None:
            out, residual = self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return out, residual
        if residual is not None:
            x = x + residual
        residual = x
        # Same op order as transformers' LlamaRMSNorm: fp32 variance, then cast.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), residual


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half), cos/sin precomputed for every position."""

    kernels: Any = None  # as RMSNorm's

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def split_rotate(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of a fused qkv projection [tokens, (heads + 2 kv_heads) * head_dim],
        as [tokens, heads, head_dim], with q and k rotated."""
        if self.kernels is not None:  # one pass, q and k written rotated; v a view
            q, k = self.kernels.rotary_qk(qkv, positions, self.cos, self.sin, num_heads,
                                          num_kv_heads, head_dim)
            v = qkv[:, (num_heads + num_kv_heads) * head_dim:]
            return q, k, v.reshape(-1, num_kv_heads, head_dim)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self(positions, q.reshape(-1, num_heads, head_dim),
                    k.reshape(-1, num_kv_heads, head_dim))
        return q, k, v.reshape(-1, num_kv_heads, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # transformers computes the rotation in fp32 then casts back; same here.
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    rope_type = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {rope_type!r}")
