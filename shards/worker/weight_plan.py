"""How a rank multiplies by its weights, chosen once at start-up: oneDNN on weights reordered
for it, or torch; and on CPU the layouts that beat oneDNN on this machine, each kept only
where a start-up timing says it pays (read back from an earlier start where one was kept,
shards/cpu/timings.py): a second copy of the weights for one-row steps (MKL on a K x N copy,
or raygen's panels), a GGUF file's quantization blocks multiplied as they are, bfloat16
weights in raygen's block kernel or widened to float32."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE
from shards.cpu import timings as startup_timings
from shards.cpu.layouts import (
    F32_LANES_TYPE,
    PANEL_MAX_ROWS,
    drop_copies_under_blocks,
    drop_unused_float_lanes,
    linear_weight_bytes,
    onednn_usable,
    pack_bf16_lanes,
    pack_float_lanes,
    pack_for_onednn,
    pack_quantized,
    quant_groups,
    quantize_linears,
    quantized,
    set_copy_rows,
    time_bf16_products,
    time_copy_products,
    time_quant_products,
    widen_bf16_weights,
)
from shards.model.attention import CpuPagedAttentionBackend
from shards.model.layers import _Matmul
from shards.shard_config import ShardConfig

logger = logging.getLogger(__name__)


def available_memory() -> int:
    """Bytes of memory the kernel says it can still give (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def one_row_copy_fits(copy_bytes: int, kv_cache_bytes: int, available_bytes: int) -> bool:
    """Whether a second copy of the weights (and the KV cache still to come) takes at most
    half of the memory available."""
    return copy_bytes + kv_cache_bytes <= available_bytes // 2


# A second copy of the weights is kept for one-row products only where it makes them at
# least this much faster.
ONE_ROW_COPY_MAX_RATIO = 0.9


def one_row_copy_pays(onednn_s: float, copy_s: float) -> bool:
    return copy_s <= ONE_ROW_COPY_MAX_RATIO * onednn_s


# Steps of 2 rows and more use the panel copy up to the most rows that the start-up
# timings admit, each timing run only where the one before it passed: (rows timed, the
# most rows of the steps it admits, the most panels / oneDNN time that passes).
# - At 32 rows alone the panels won by 14-20% on this Xeon, and beside the serving plane
#   by more (benchmarks/NOTES.md 46-47).
# - At 160 rows (a prefill-heavy step: a decode batch and a 128-token prompt) they tie
#   oneDNN alone (0.91-1.04x in-process; 0.96-1.13x timed at start-up, beside the rest
#   of the app starting), and win in the server, where the serving plane preempts a
#   thread: +8% output tok/s at 32 in both workloads (NOTES 48). A fifth's margin keeps
#   them where they tie, noise included, and drops them on a CPU where they lose.
PANEL_TIMINGS = ((32, 64, 1.0), (160, PANEL_MAX_ROWS, 1.2))


def panels_pay(rows: int, onednn_s: float, panels_s: float) -> bool:
    ratio = next(ratio for timed, _, ratio in PANEL_TIMINGS if timed == rows)
    return panels_s <= ratio * onednn_s


# Each kind of linear with a GGUF file's quantized weights multiplies by its blocks in the
# steps of up to the most rows timed here at start-up where they beat the float32 path,
# each timing run only where the one before it passed (benchmarks/NOTES.md 56). Timed
# alone they do worse than inside a step, where reading a fifth of the bytes leaves the
# caches to the rest of it: in steps of 10-14 rows of SmolLM2's Q4_1 file on an AMD EPYC,
# blocks for every linear took 0.79-0.93x the time that the float path for the linears
# whose timing said 0.9-1.0x did; so a tie is enough (NOTES.md 71). 12 and 24: the
# blocks' lead ends between the powers of two. 6: a one-request step with 4 drafts has 5
# rows, and the LM head's Q8_0 blocks win there but not at 8 (NOTES.md 99). 64-512: prompt
# chunks, where the blocks on AMX tiles beat the float32 panels (0.62-0.75x from 64 to 512
# rows on an AMX Xeon, NOTES.md 114); elsewhere the vector tiles lose by 32 and stop there.
QUANT_TIMED_ROWS = (1, 4, 6, 8, 12, 16, 24, 32, 64, 128, 512)
# Timings of up to this many rows are the best of 3 passes; bigger ones (tens to hundreds of
# ms each) are timed once: a first start on that Xeon took 7.2 s with timings to 32 rows,
# 11-12 s to 512 (3 s more as the best of 3).
QUANT_BEST_OF_3_ROWS = 32
QUANT_MAX_RATIO = 1.0
# bfloat16 weights in raygen's lanes, where oneDNN multiplies bfloat16 too, read the same
# bytes: they serve steps of up to this many rows at most. With vdpbf16ps they took
# 0.80-0.83x oneDNN's time at 8 rows alone and 1.0-1.09x at 12-16; served at 32 requests,
# with lanes that the timings gave steps of up to 16-24 rows raygen read 0.95-0.97x the
# tok/s it read without vdpbf16ps (three runs), and with the lanes capped at 8, 1.06x
# (benchmarks/NOTES.md 105).
BF16_MAX_ROWS = 8
# bfloat16 weights: steps bigger than the block kernel's go through float32 copies of them
# where oneDNN's float32 product takes at most this share of its bfloat16 one at 128 rows.
BF16_TIMED_ROWS = 128
BF16_WIDEN_RATIO = 0.8


def _shapes(model: torch.nn.Module) -> list[list[int]]:
    """Every weight a start-up timing multiplies by, as (N, K): what its seconds depend on."""
    return [list(m.weight_shape) for m in model.modules() if isinstance(m, _Matmul)]


def _products(linear: _Matmul) -> str:
    """How raygen's kernels multiply by `linear`'s blocks, for the log."""
    if linear.quant_int8:
        return "x rounded to int8 blocks, products in integers"
    if not linear.quant_lanes:
        return "x in float32"
    dot_rows = (linear.quant_kernels.bf16_dot_min_rows()
                if linear.quant_type == BF16_KERNEL_TYPE else 0)
    return ("x in float32" + (f", rounded to bfloat16 in steps of {dot_rows} rows or more"
                              if dot_rows else "") + ", 8 output rows to a vector"
            + (", bigger steps on AMX tiles" if amx_tiles(linear) else ""))


def amx_tiles(linear: _Matmul) -> bool:
    """Whether `linear`'s GGUF blocks in lanes multiply steps of several rows on AMX tiles
    (shards/cpu/csrc/quant_amx.cpp: built for a CPU with AMX-BF16, granted by the OS)."""
    return (linear.quant_lanes and linear.quant_type in (0, 1, 2)
            and hasattr(linear.quant_kernels, "amx_usable") and linear.quant_kernels.amx_usable())


def bf16_block_kernel(attention_backend: str) -> bool:
    """Whether raygen's CPU kernels (which come with its attention backend) multiply by
    bfloat16 weights on this CPU (AVX-512, or AVX2 with FMA and F16C)."""
    if attention_backend not in ("auto", "cpu"):
        return False
    from shards.cpu import kernels

    module = kernels.load()
    return module is not None and module.quant_supported()


class WeightPlan:
    """The choice, made on `model` as loaded (packing reorders, and may free, its float
    weights), and what it was made from: the timings, for the log, /info and the tests."""

    def __init__(self, model: torch.nn.Module, config: ShardConfig, backend,
                 device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                 bf16_products: bool, kv_cache_bytes: Callable[[], int]):
        """`dtype`: the activations'; `weight_dtype`: the weights' (bfloat16 weights
        multiplied beside float32 activations); `kv_cache_bytes`: what the KV cache will
        take, asked only where a second copy of the weights is considered."""
        self.model, self.config, self.device = model, config, device
        self.dtype, self.weight_dtype, self.bf16_products = dtype, weight_dtype, bf16_products
        self._kv_cache_bytes = kv_cache_bytes
        # raygen's CPU kernels come with its attention backend
        self.kernels = backend.kernel if isinstance(backend, CpuPagedAttentionBackend) else None
        self.one_row_weights = False  # a second copy of the weights for one-row products
        self.one_row_timings: tuple[float, float] | None = None  # (oneDNN, copy) seconds
        # The copy's layout ("panels", "K x N" or "rows in lanes", None without one; the
        # lanes are timed and used as the blocks below are); with panels, the rows
        # (from, to) of the steps they serve, and (oneDNN, panels) seconds by rows timed.
        self.weight_copy: str | None = None
        self.panel_rows: tuple[int, int] | None = None
        self.panel_timings: dict[int, tuple[float, float]] | None = None
        # A GGUF file's quantization blocks: each kind of linear (shape, block type) uses
        # them for the steps of up to `quant_rows_by_kind[kind]` rows, every linear for
        # those of up to `quant_rows`; by kind, (float path, blocks) seconds by rows timed.
        self.quant_rows = 0
        self.quant_rows_by_kind: dict[str, int] = {}
        self.quant_types: dict[str, int] = {}
        self.quant_int8 = False  # the blocks multiply x rounded to int8 (quant_products)
        self.quant_timings: dict[str, dict[int, tuple[float, float]]] = {}
        # float32 rows in lanes (the copy on AVX2): by kind of linear, the steps of up to
        # that many rows that use them; their timings are in `quant_timings`.
        self.lane_rows_by_kind: dict[str, int] = {}
        self.bf16_timings: tuple[float, float] | None = None  # (bf16, widened) at 128 rows
        self.timings_read = {True: 0, False: 0}  # start-up timings read from disk, or timed
        self.matmul = self._pack(config.cpu_matmul)
        if self.timings_read[True]:
            logger.info("start-up timings: %d read from an earlier start on this machine "
                        "(%s), %d timed", self.timings_read[True],
                        startup_timings.directory(), self.timings_read[False])

    def quant_blocks(self) -> dict | None:
        """A GGUF file's blocks as /info shows them: linears by type, the steps that use
        them, x in float32 or int8, and how many linears read them laid out with 8 output
        rows to a vector (`_Matmul.quant_lanes`)."""
        if not self.quant_types:
            return None
        lanes = [m for m in quantized(self.model)
                 if m.quant_lanes and m.quant_type != F32_LANES_TYPE]
        return {"types": self.quant_types, "steps_up_to_rows": self.quant_rows,
                "steps_up_to_rows_by_linear": self.quant_rows_by_kind,
                "x": "int8" if self.quant_int8 else "float32",
                "rows_in_lanes": len(lanes),
                "amx_tiles": any(map(amx_tiles, lanes))}

    def _pack(self, choice: str) -> str:
        """Which library multiplies by the weights (layers._Matmul): oneDNN on CPU, on
        weights reordered once here; torch otherwise (CUDA, or when asked)."""
        if choice not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_matmul must be auto, onednn or torch, not {choice!r}")
        usable = onednn_usable(self.device, self.dtype)
        if choice == "onednn" and not usable:
            raise ValueError(f"cpu_matmul=onednn needs a CPU shard with oneDNN in float32 or "
                             f"bfloat16, bfloat16 on a CPU with native bf16 products or "
                             f"raygen's kernels (here: {self.device.type}, {self.dtype})")
        if choice == "torch" or not usable:
            return "torch"
        if self.config.quantize is not None:  # before the packing, which frees the floats
            t0 = time.perf_counter()
            n = quantize_linears(self.model, self.config.quantize.upper())
            logger.info("quantize=%s: %d linears quantized at load in %.1f s",
                        self.config.quantize, n, time.perf_counter() - t0)
        if self.weight_dtype != self.dtype:  # bfloat16 weights: oneDNN, and few-row steps
            self._pack_bf16()
        else:
            self._pack_float(choice)
        return "onednn"

    def _pack_bf16(self) -> None:
        """bfloat16 weights beside float32 activations: oneDNN's bfloat16 products (or
        float32 ones on widened copies), raygen's block kernel for few-row steps."""
        kernels = self.kernels
        if kernels is not None and not kernels.quant_supported():
            kernels = None
        size = pack_for_onednn(self.model, weight_dtype=self.weight_dtype,
                               block_kernels=kernels, bf16_products=self.bf16_products)
        logger.info("weights reordered for oneDNN in %s: %.0f MB",
                    self.weight_dtype if self.bf16_products else torch.float32,
                    size / 2**20)
        self.quant_types = {"BF16": n} if (n := len(quantized(self.model))) else {}
        if self.quant_types and not self.bf16_products:
            self.weight_copy = "float32, widened from bfloat16"
            pack_bf16_lanes(self.model)
            self._time_quantized()
        elif self.quant_types:
            # Bigger steps: oneDNN in bfloat16, or in float32 on the widened weights
            # where that is faster (this Xeon emulates bf16: 2x slower at 128 rows).
            self.bf16_timings = self._timed(
                ("bf16", _shapes(self.model), BF16_TIMED_ROWS),
                time_bf16_products, self.model, BF16_TIMED_ROWS)
            if self.bf16_timings[1] < BF16_WIDEN_RATIO * self.bf16_timings[0]:
                widen_bf16_weights(self.model)
                self.weight_copy = "float32, widened from bfloat16"
            logger.info("%d rows: oneDNN bfloat16 %.2f ms, float32 %.2f ms: %s",
                        BF16_TIMED_ROWS, *(t * 1e3 for t in self.bf16_timings),
                        self.weight_copy or "bfloat16 kept")
            pack_bf16_lanes(self.model)
            self._time_quantized()

    def _pack_float(self, choice: str) -> None:
        """Weights in the activations' dtype: oneDNN, and where timed faster a second copy
        for one-row steps (and panels for bigger ones), a GGUF file's blocks."""
        # One-row products (a batch-1 step) may be faster through MKL on a second, K x N
        # copy of the weights: it depends on the CPU and the threads (benchmarks/NOTES.md
        # 31, 45), so the copy is timed against oneDNN below and kept only where it pays.
        # It is made only where it and the KV cache take at most half of the memory still
        # available: the core plan is the serving app's default, and a model that loads
        # without the copy must not fail to because of it.
        self.one_row_weights = choice == "auto"
        if self.one_row_weights:
            copy = linear_weight_bytes(self.model)
            kv_cache = self._kv_cache_bytes()  # num_blocks, or the budget
            available = available_memory()
            if not one_row_copy_fits(copy, kv_cache, available):
                self.one_row_weights = False
                logger.info("no second copy of the weights: %.0f MB of weights and "
                            "%.0f MB of KV cache would pass half of the %.0f MB available",
                            copy / 2**20, kv_cache / 2**20, available / 2**20)
        # The copy is cut into panels where raygen's kernels multiply by them: the CPU
        # attention backend's module (float32), built for AVX-512; built for AVX2, they
        # lay it out with 8 output rows to a vector instead, timed as the blocks are.
        kernels = self.kernels
        if kernels is not None and (self.dtype != torch.float32 or not kernels.panels_supported()):
            kernels = None
        lane_kernels = self.kernels if (
            self.one_row_weights and kernels is None and self.kernels is not None
            and self.dtype == torch.float32 and self.kernels.quant_lanes_supported()) else None
        t0 = time.perf_counter()
        lanes = pack_float_lanes(self.model, lane_kernels) if lane_kernels is not None else 0
        size = pack_for_onednn(self.model, one_row_copy=self.one_row_weights and not lanes,
                               panel_kernels=kernels)
        logger.info("weights reordered for oneDNN: %.0f MB%s in %.1f s", size / 2**20,
                    f", and {lanes / 2**20:.0f} MB laid out with 8 output rows to a vector"
                    if lanes else "", time.perf_counter() - t0)
        if self.one_row_weights and not lanes:
            self._time_weight_copy(panels=kernels is not None)
        quant_kernels = self.kernels
        if (choice == "auto" and self.dtype == torch.float32 and quant_kernels is not None
                and quant_kernels.quant_supported()):
            self.quant_int8 = (self.config.quant_products == "int8"
                               and quant_kernels.quant_i8_supported())
            self.quant_types = pack_quantized(self.model, quant_kernels, self.quant_int8)
        if self.quant_types or lanes:
            self._time_quantized()
        if self.quant_types:
            self._drop_copies_under_blocks()
        if lanes:
            self._keep_float_lanes()

    def _keep_float_lanes(self) -> None:
        """The float32 rows in lanes serve the steps the timings gave them (timed with a GGUF
        file's blocks, counted apart from them here); those that serve none are freed, and
        the copy is named where any are left: each serves one-row steps at least."""
        freed = drop_unused_float_lanes(self.model)
        floats = [kind for kind in self.quant_rows_by_kind if kind.endswith(" F32")]
        rows = {kind: self.quant_rows_by_kind.pop(kind) for kind in floats}
        self.lane_rows_by_kind = {kind: up_to for kind, up_to in rows.items() if up_to}
        self.quant_rows = min(self.quant_rows_by_kind.values(), default=0)
        self.one_row_weights = bool(self.lane_rows_by_kind)
        self.weight_copy = "rows in lanes" if self.one_row_weights else None
        if freed:
            logger.info("rows in lanes: %.0f MB freed where oneDNN was as fast", freed / 2**20)

    def _drop_copies_under_blocks(self) -> None:
        """The weight copy was kept for the steps it serves faster than oneDNN, timed before
        the blocks were: where the blocks serve those steps now, the copy goes."""
        freed = drop_copies_under_blocks(self.model)
        if not freed:
            return
        if not any(m.transposed is not None or m.panels is not None
                   for m in self.model.modules() if isinstance(m, _Matmul)):
            self.one_row_weights, self.weight_copy, self.panel_rows = False, None, None
        logger.info("weight copy: %.0f MB freed, the blocks serve its steps", freed / 2**20)

    def _timed(self, what: tuple, measure, *args, **kwargs) -> tuple[float, ...]:
        """`measure(*args, **kwargs)`'s seconds, timed at an earlier start on this machine
        or now (shards/cpu/timings.py); counted for the log."""
        seconds, read = startup_timings.timed(what, lambda: measure(*args, **kwargs))
        self.timings_read[read] += 1
        return seconds

    def _time_quantized(self) -> None:
        """Keep the quantization blocks (or the bfloat16 kernel) for the steps they make
        faster, timed here for each kind of linear (shape and block type): where their lead
        ends differs by kind (SmolLM2's Q4_1 file on an AMD EPYC, 16 rows: the attention
        and down projections' blocks took 0.7-0.8x the float path's time, the LM head's
        Q8_0 ones 1.2x; NOTES.md 71)."""
        for kind, linears in quant_groups(self.model).items():
            timings = self.quant_timings[kind] = {}
            capped = (linears[0].quant_type == BF16_KERNEL_TYPE
                      and linears[0].packed_dtype == torch.bfloat16)
            up_to = 0
            for rows in QUANT_TIMED_ROWS:
                if capped and rows > BF16_MAX_ROWS:
                    break
                float_s, blocks_s = timings[rows] = self._timed(
                    ("quant", kind, len(linears), rows, self.quant_int8),
                    time_quant_products, linears, rows,
                    rounds=3 if rows <= QUANT_BEST_OF_3_ROWS else 1)
                if blocks_s > QUANT_MAX_RATIO * float_s:
                    break
                up_to = rows
            for m in linears:
                m.quant_rows = up_to
            self.quant_rows_by_kind[kind] = up_to
            logger.info("raygen's block kernel, %d linears of %s (%s): %s: %s", len(linears),
                        kind, _products(linears[0]),
                        "; ".join(f"{rows} row(s) {a * 1e3:.2f} ms without, {b * 1e3:.2f} "
                                  f"ms with" for rows, (a, b) in timings.items()),
                        f"used for steps of 1-{up_to} rows" if up_to else "not used")
        self.quant_rows = min(self.quant_rows_by_kind.values(), default=0)

    def _time_weight_copy(self, panels: bool) -> None:
        """Keep the weight copy for the steps it makes faster, timed here on this rank's
        threads: one-row steps where it is a tenth faster than oneDNN, and with panels the
        steps of 2 rows and more up to the most that PANEL_TIMINGS admits."""
        self.weight_copy = "panels" if panels else "K x N"
        shapes = _shapes(self.model)
        onednn_s, copy_s = self._timed((self.weight_copy, str(self.weight_dtype), shapes, 1, 5),
                                       time_copy_products, self.model, 1, rounds=5)
        self.one_row_timings = (onednn_s, copy_s)
        self.one_row_weights = one_row_copy_pays(onednn_s, copy_s)
        up_to = 1
        if panels:
            self.panel_timings = {}
            for rows, most, _ in PANEL_TIMINGS:
                timed = self.panel_timings[rows] = self._timed(
                    ("panels", shapes, rows, 3),
                    time_copy_products, self.model, rows, rounds=3)
                if not panels_pay(rows, *timed):
                    break
                up_to = most
        self.panel_rows = set_copy_rows(self.model, self.one_row_weights, up_to)
        if not (self.one_row_weights or up_to > 1):
            self.weight_copy = None
        what = "panels" if panels else "MKL on a K x N copy"
        text = (f"one-row products on {torch.get_num_threads()} thread(s): oneDNN "
                f"{onednn_s * 1e3:.2f} ms, {what} {copy_s * 1e3:.2f} ms")
        for rows, (onednn_s, panels_s) in (self.panel_timings or {}).items():
            text += f"; {rows} rows: oneDNN {onednn_s * 1e3:.2f} ms, panels {panels_s * 1e3:.2f} ms"
        if self.weight_copy is None:
            text += ": copy dropped"
        elif panels:
            text += f": panels kept for steps of {self.panel_rows[0]}-{self.panel_rows[1]} rows"
        else:
            text += ": copy kept"
        logger.info(text)
