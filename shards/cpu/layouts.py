"""The CPU layouts of a model's linear weights (`_Matmul`'s slots) and the timings that
choose among them (shards/worker/weight_plan.py decides): weights reordered for oneDNN, a
second copy for small steps (MKL's K x N, raygen's panels, or float32 rows in lanes), a
GGUF file's blocks for raygen's block kernel, bfloat16 weights widened to float32."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE, KERNEL_TYPES
from shards.model.layers import _Matmul

# oneDNN picks its weight layout for this many rows; 32 served every row count a step
# has (1 to a prefill's hundreds) as well as or better than the others measured.
ONEDNN_BATCH_HINT = 32
# Steps of up to this many rows may use the panel copy (`_Matmul`), where the start-up
# timings admit them (shards/worker/weight_plan.py): alone the panels took 0.69-0.97x
# oneDNN's time from 2 to 64 rows and tied it at 128-256 (benchmarks/NOTES.md 47-48).
PANEL_MAX_ROWS = 256


# The block types laid out with 8 output rows to a vector for the steps that use the blocks
# (shards/cpu/csrc/quant_lanes.cpp). SmolLM2's Q4_1 file on an AMD EPYC, its
# 120 layer products against the file's blocks: 0.60-0.64x the time at 1 row, 0.64-0.78x
# at 2-32; its Q8_0 LM head 0.65-0.88x at 1-6 rows, 0.96-1.05x at 8-16, 0.73-0.82x at 24
# and 32 (benchmarks/NOTES.md 81).
LANE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# Float weights in the same layout (`_Matmul.quant` of this type, or BF16_KERNEL_TYPE's): a
# vector of 8 output rows' weights at one position, one FMA per 8 weights. On an AMD EPYC
# (AVX2, where raygen's panels are not built) SmolLM2's 120 layer products at one row read
# 20-24 GB/s where oneDNN reads 11 and MKL's K x N copy about as much, and bfloat16 ones 17
# where the block kernel reads 12 (benchmarks/NOTES.md 83).
F32_LANES_TYPE = 4


def pack_quantized(model: nn.Module, kernels: Any, int8: bool = False) -> dict[str, int]:
    """Give every linear whose weight came whole from a GGUF file in a type the kernels
    read (`_keep_blocks`) those blocks, one uint8 row of blocks per output row, to multiply
    by (`_Matmul.quant`; no step uses them until `set_quant_rows`), by x rounded to int8
    blocks where `int8`; with float x the blocks laid out again with 8 output rows to a
    vector (`_Matmul.quant_lanes`, LANE_TYPES: the same bytes in another order), where the
    kernels have that layout and the rows come in whole groups of 8. Returns the count of
    linears by type."""
    counts: dict[str, int] = {}
    for module in model.modules():
        parts = getattr(getattr(module, "weight", None), "gguf_blocks", None)
        if not isinstance(module, _Matmul) or not parts:
            continue
        types = {kind for kind, _ in parts.values()}
        ordered = [parts[offset][1] for offset in sorted(parts)]
        if len(types) != 1 or sum(p.shape[0] for p in ordered) != module.weight_shape[0]:
            continue  # merged from tensors of several types, or not every row: float only
        kind = types.pop()
        module.quant = torch.from_numpy(np.concatenate(ordered))
        module.quant_type = KERNEL_TYPES[kind]
        module.quant_kernels = kernels
        module.quant_int8 = int8
        if (not int8 and kind in LANE_TYPES and module.weight_shape[0] % 8 == 0
                and kernels.quant_lanes_supported()):
            module.quant = kernels.pack_quant_lanes(module.quant, module.quant_type,
                                                    module.weight_shape[1])
            module.quant_lanes = True
        counts[kind] = counts.get(kind, 0) + 1
    drop_gguf_blocks(model)
    return counts


def pack_float_lanes(model: nn.Module, kernels: Any) -> int:
    """Give every float32 linear a copy of its weight laid out with 8 output rows to a
    vector (`_Matmul.quant`, F32_LANES_TYPE), for the small steps that the start-up timings
    give it (`set_quant_rows`); before `pack_for_onednn`, which frees the weights. A weight
    that a GGUF file's blocks will serve, or whose rows are not whole groups of 8 and blocks
    of 32, gets none. Returns the bytes laid out."""
    laid_out = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if (not isinstance(m, _Matmul) or weight is None or weight.dtype != torch.float32
                or weight.dim() != 2 or weight.shape[0] % 8 or weight.shape[1] % 32
                or hasattr(weight, "gguf_blocks")):
            continue
        m.quant = kernels.pack_quant_lanes(weight.detach().contiguous().view(torch.uint8),
                                           F32_LANES_TYPE, weight.shape[1])
        m.quant_type, m.quant_kernels, m.quant_lanes = F32_LANES_TYPE, kernels, True
        m.weight_shape = tuple(weight.shape)
        laid_out += m.quant.numel()
    return laid_out


def drop_unused_float_lanes(model: nn.Module) -> int:
    """Free the float32 lanes (`pack_float_lanes`) that no step uses. Returns the bytes."""
    freed = 0
    for m in quantized(model):
        if m.quant_type == F32_LANES_TYPE and m.quant_rows < 1:
            freed += m.quant.numel()
            m.quant, m.quant_type, m.quant_kernels, m.quant_lanes = None, -1, None, False
    return freed


def quantize_linears(model: nn.Module, kind: str = "Q8_0") -> int:
    """Quantize every linear's float weight into `kind` blocks (the `gguf` package's own
    quantizer: llama.cpp's rounding), kept beside it as a GGUF file's would be
    (`_keep_blocks`), for `pack_quantized`. A weight whose rows are no whole blocks stays
    float. Returns the linears quantized."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, _Matmul) or weight is None or weight.dim() != 2
                or weight.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0]
                or hasattr(weight, "gguf_blocks")):  # a GGUF file's own blocks stay
            continue
        blocks = gguf.quants.quantize(weight.detach().float().contiguous().numpy(), qtype)
        weight.gguf_blocks = {0: (kind, blocks)}
        count += 1
    return count


def drop_gguf_blocks(model: nn.Module) -> None:
    """Free the blocks `_keep_blocks` put beside the weights (what no linear took)."""
    for param in model.parameters():
        if hasattr(param, "gguf_blocks"):
            del param.gguf_blocks


def quantized(model: nn.Module) -> list[_Matmul]:
    return [m for m in model.modules() if isinstance(m, _Matmul) and m.quant is not None]


def quant_groups(model: nn.Module) -> dict[str, list[_Matmul]]:
    """The linears that have quantization blocks, by kind: weight shape (N x K) and block
    type, so that one group is the same product in every layer (its timing holds for all)."""
    names = {code: name for name, code in {**KERNEL_TYPES, "BF16": BF16_KERNEL_TYPE,
                                            "F32": F32_LANES_TYPE}.items()}
    groups: dict[str, list[_Matmul]] = {}
    for m in quantized(model):
        kind = names.get(m.quant_type, str(m.quant_type))
        groups.setdefault(f"{m.weight_shape[0]}x{m.weight_shape[1]} {kind}", []).append(m)
    return groups


def time_quant_products(linears: list[_Matmul], rows: int,
                        rounds: int = 3) -> tuple[float, float]:
    """Seconds for `rows` rows through `linears` (ones with quantization blocks): (how the
    step multiplies without them, the blocks), each the best of `rounds` passes."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, m.weight_shape[1], generator=generator) for m in linears]

    def without() -> None:
        for m, x in zip(linears, inputs, strict=True):
            saved, m.quant_rows = m.quant_rows, 0
            m.matmul(x)
            m.quant_rows = saved

    def blocks() -> None:
        for m, x in zip(linears, inputs, strict=True):
            m.quant_product(x)

    return _best_of(rounds, without, blocks)


def widen_bf16_weights(model: nn.Module) -> int:
    """Where oneDNN multiplies bfloat16 slower than float32 (it does on CPUs whose bf16 it
    emulates): each bfloat16 weight packed again as float32 (the same values, widened) for
    the steps the block kernel does not serve, and the bfloat16 packing freed. Returns the
    bytes packed."""
    packed = 0
    for m in model.modules():
        if isinstance(m, _Matmul) and m.packed_dtype is not None and m.quant is not None:
            wide = m.quant.view(torch.bfloat16).float()
            m.packed = torch.ops.mkldnn._reorder_linear_weight(wide, ONEDNN_BATCH_HINT)
            m.packed_dtype = None
            packed += wide.numel() * wide.element_size()
    return packed


def pack_bf16_lanes(model: nn.Module) -> int:
    """Lay out the bfloat16 weights that the block kernel multiplies (`pack_for_onednn`'s
    `block_kernels`) with 8 output rows to a vector, where the kernels have that layout and
    the rows come in whole groups of 8; after `time_bf16_products` and
    `widen_bf16_weights`, which read them as N x K. Returns the count laid out."""
    count = 0
    for m in quantized(model):
        if (m.quant_type == BF16_KERNEL_TYPE and not m.quant_lanes
                and m.weight_shape[0] % 8 == 0 and m.quant_kernels.quant_lanes_supported()):
            m.quant = m.quant_kernels.pack_quant_lanes(m.quant, BF16_KERNEL_TYPE,
                                                       m.weight_shape[1])
            m.quant_lanes = True
            count += 1
    return count


def time_bf16_products(model: nn.Module, rows: int, rounds: int = 2) -> tuple[float, float]:
    """Seconds for `rows` rows through every bfloat16 linear: (oneDNN in bfloat16, oneDNN in
    float32 on the widened weights), each the best of `rounds`; the widened weights are
    made for the timing and dropped."""
    linears = [m for m in model.modules()
               if isinstance(m, _Matmul) and m.packed_dtype is not None and m.quant is not None]
    generator = torch.Generator().manual_seed(0)
    best = [0.0, 0.0]
    for m in linears:
        x = torch.randn(rows, m.weight_shape[1], generator=generator)
        wide = torch.ops.mkldnn._reorder_linear_weight(m.quant.view(torch.bfloat16).float(),
                                                       ONEDNN_BATCH_HINT)
        for i, (inputs, weight) in enumerate(((x.to(m.packed_dtype), m.packed), (x, wide))):
            seconds = float("inf")
            for n in range(rounds + 1):  # the first warms up
                t0 = time.perf_counter()
                torch.ops.mkldnn._linear_pointwise(inputs, weight, None, "none", [], "")
                if n:
                    seconds = min(seconds, time.perf_counter() - t0)
            best[i] += seconds
    return best[0], best[1]


def set_quant_rows(model: nn.Module, up_to: int) -> None:
    """Steps of up to `up_to` rows multiply by the quantization blocks (0: none; the blocks
    stay, a fifth of the float32 weights' memory for Q4_1)."""
    for m in quantized(model):
        m.quant_rows = up_to


def cpu_bf16_products() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (avx512_bf16, AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can multiply by the weights: float32, or bfloat16 where the CPU has
    native bf16 products (elsewhere its reorder refuses them: AVX2 CPUs)."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_products())))


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight that a _Matmul multiplies by (what a second copy would take)."""
    return sum(m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, _Matmul))


def _copied(model: nn.Module) -> list[_Matmul]:
    return [m for m in model.modules() if isinstance(m, _Matmul) and m.packed is not None
            and (m.transposed is not None or m.panels is not None)]


def _best_of(rounds: int, first, second) -> tuple[float, float]:
    """Seconds of each of two ways to run the same products, the best of `rounds` passes,
    the two alternating after one pass each to warm up."""
    best = [float("inf"), float("inf")]
    for n in range(rounds + 1):
        for i, products in enumerate((first, second)):
            t0 = time.perf_counter()
            products()
            if n:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def drop_copies_under_blocks(model: nn.Module) -> int:
    """Free the copies that a linear's quantization blocks leave no step to serve: the
    blocks come first (`_Matmul.matmul`), so a K x N copy (one-row steps only) goes where
    the blocks serve one-row steps, and panels where the blocks serve every row count the
    panels do. Returns the bytes freed."""
    freed = 0
    for m in _copied(model):
        if m.quant is None or m.quant_rows < 1:
            continue
        if m.transposed is not None:
            freed += m.transposed.numel() * m.transposed.element_size()
            m.transposed = None
        if m.panels is not None and m.quant_rows >= m.panel_rows[1]:
            freed += m.panels.numel() * m.panels.element_size()
            m.panels = m.panel_kernels = None
    return freed


def time_copy_products(model: nn.Module, rows: int = 1,
                       rounds: int = 3) -> tuple[float, float]:
    """Seconds for `rows` rows through every linear that has a copy of its weight:
    (oneDNN on the reordered weight, the copy: its panels, else MKL on K x N), each the
    best of `rounds` passes, the two alternating after one pass each to warm up."""
    linears = _copied(model)
    generator = torch.Generator().manual_seed(0)  # the process's own stream stays untouched
    inputs = [torch.randn(rows, m.weight_shape[1], generator=generator,
                          dtype=torch.float32 if m.transposed is None else m.transposed.dtype)
              for m in linears]

    def onednn() -> None:
        for m, x in zip(linears, inputs, strict=True):
            torch.ops.mkldnn._linear_pointwise(x, m.packed, None, "none", [], "")

    def copy() -> None:
        for m, x in zip(linears, inputs, strict=True):
            if m.panels is not None:
                m.panel_kernels.linear_panels(x, m.panels, m.weight_shape[0], None)
            else:
                torch.mm(x, m.transposed)

    return _best_of(rounds, onednn, copy)


def set_copy_rows(model: nn.Module, one_row: bool, up_to: int) -> tuple[int, int] | None:
    """Which steps the copies serve: one-row ones (`one_row`), and with panels those of 2
    to `up_to` rows (none where `up_to` is 1). A copy left serving none is freed. Returns
    the panels' rows (from, to), None where no panels serve."""
    rows = (1 if one_row else 2, up_to)
    kept = None
    for m in _copied(model):
        if m.panels is not None and rows[0] <= rows[1]:
            m.panel_rows = kept = rows
        elif m.panels is not None:
            m.panels = m.panel_kernels = None
        elif not one_row:
            m.transposed = None
    return kept


def pack_for_onednn(model: nn.Module, batch_hint: int = ONEDNN_BATCH_HINT,
                    one_row_copy: bool = False, panel_kernels: Any = None,
                    weight_dtype: torch.dtype | None = None, block_kernels: Any = None,
                    bf16_products: bool = True) -> int:
    """Reorder every linear weight into oneDNN's blocked layout; a weight that nothing
    else shares (the embedding, when tied) is then freed, so memory stays one copy, or two
    with `one_row_copy` (each weight also kept K x N for one-row products, or as panels
    with `panel_kernels` for float32 weights; `_Matmul`). With `weight_dtype` (bfloat16
    for a float32 model) the packed weights take that type, and no copy is made; with
    `block_kernels` too, each bfloat16 weight also serves raygen's block kernel
    (`_Matmul.quant`, the same tensor viewed as bytes, or laid out again with 8 output rows
    to a vector where the kernels have that layout; `set_quant_rows` turns it on).
    Without `bf16_products` (a CPU whose oneDNN refuses bfloat16 weights) oneDNN gets the
    bfloat16 values widened to float32. Returns the bytes packed."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if not isinstance(module, _Matmul):
            continue
        weight = module.weight
        source = weight.detach() if weight_dtype is None else weight.detach().to(weight_dtype)
        wide = weight_dtype is not None and not bf16_products
        module.packed = torch.ops.mkldnn._reorder_linear_weight(
            source.float() if wide else source, batch_hint)
        module.packed_dtype = None if wide else weight_dtype
        module.weight_shape = tuple(weight.shape)
        if (block_kernels is not None and weight_dtype == torch.bfloat16
                and weight.shape[1] % 32 == 0):
            module.quant = source.contiguous().view(torch.uint8)
            module.quant_type, module.quant_kernels = BF16_KERNEL_TYPE, block_kernels
        one_row_copy = one_row_copy and weight_dtype is None
        if one_row_copy and panel_kernels is not None and weight.dtype == torch.float32:
            module.panels = panel_kernels.pack_panels(weight.detach())
            module.panel_kernels = panel_kernels
            module.panel_rows = (1, PANEL_MAX_ROWS)
        elif one_row_copy:
            module.transposed = weight.detach().t().contiguous()
        packed += source.numel() * (4 if wide else source.element_size())
        if uses[id(weight)] == 1:
            weight.data = weight.data.new_empty(0)
    return packed
