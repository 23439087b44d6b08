"""One shard's work: the weights, the KV cache, and `step(StepInput) -> StepOutput`.

It keeps a mirror of each request's tokens and block table, updated from the step diffs
and from its own samples, so a decode step ships a few ints per request and its input
never waits for the batcher. Used in-process (offline engine, tests) and
inside the Ray shard actor."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.messages import StepDrafting, StepInput, StepOutput
from engine.sampling_params import SamplingParams
from engine.speculation import SpeculationState, draft_step
from shards.checkpoints.adapters import AdapterError
from shards.checkpoints.loader import load_weights
from shards.cpu import timings as startup_timings
from shards.cpu.plan import bind_torch_threads
from shards.model.attention import (
    AttentionMetadata,
    CpuPagedAttentionBackend,
    PrefillSeq,
    select_backend,
)
from shards.model.config import ModelConfig
from shards.model.grammar import Grammars
from shards.model.layers import (
    PANEL_MAX_ROWS,
    TPContext,
    _Matmul,
    cpu_bf16_products,
    drop_gguf_blocks,
    linear_weight_bytes,
    onednn_usable,
    pack_for_onednn,
    pack_quantized,
    quant_groups,
    quantize_linears,
    quantized,
    set_copy_rows,
    time_bf16_products,
    time_copy_products,
    time_quant_products,
    use_cpu_kernels,
    widen_bf16_weights,
)
from shards.model.llama import CausalLM
from shards.model.lora import LoRAAdapters, StagedAdapter, adapted_layers, read_adapter
from shards.model.sampler import SampleRow, sample
from shards.shard_config import ShardConfig

logger = logging.getLogger(__name__)

# Adapters read ahead (stage_adapter) whose loading step has not come yet: a few at most.
MAX_STAGED_ADAPTERS = 4


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
# blocks' lead ends between the powers of two.
QUANT_TIMED_ROWS = (1, 4, 8, 12, 16, 24, 32)
QUANT_MAX_RATIO = 1.0
# bfloat16 weights: steps bigger than the block kernel's go through float32 copies of them
# where oneDNN's float32 product takes at most this share of its bfloat16 one at 128 rows.
BF16_TIMED_ROWS = 128
BF16_WIDEN_RATIO = 0.8


def _shapes(model: torch.nn.Module) -> list[list[int]]:
    """Every weight a start-up timing multiplies by, as (N, K): what its seconds depend on."""
    return [list(m.weight_shape) for m in model.modules() if isinstance(m, _Matmul)]


@dataclass(slots=True)
class _Seq:
    """A rank's own copy of a request, made from its NewRequestData (a frozen message) and
    changed in place from then on: tokens appended as they are drawn, blocks as they are
    sent, its position as steps compute it."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    lora_slot: int = 0  # its LoRA adapter's slot, 0 for the base model
    # Its n-gram index and drafting record, for the drafts of multi-steps.
    speculation: SpeculationState | None = None


def resolve_device(name: str) -> torch.device:
    # Key on CUDA being usable, not on GPUs being declared: Ray may hand an actor a
    # logical GPU on a machine that has none.
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def bf16_block_kernel(attention_backend: str) -> bool:
    """Whether raygen's CPU kernels (which come with its attention backend) multiply by
    bfloat16 weights on this CPU (AVX-512, or AVX2 with FMA and F16C)."""
    if attention_backend not in ("auto", "cpu"):
        return False
    from shards.cpu import kernels

    module = kernels.load()
    return module is not None and module.quant_supported()


def resolve_kv_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the activations' (auto), or float16. On CPU the
    attention widens float16 to float32 as it reads; flash attention on CUDA reads the cache
    in the activations' type, so there float16 needs float16 activations."""
    if name == "auto":
        return dtype
    if name != "float16":
        raise ValueError(f"kv_cache_dtype must be auto or float16, not {name!r}")
    if device.type == "cuda" and dtype != torch.float16:
        raise ValueError(f"kv_cache_dtype=float16 on CUDA needs dtype=float16, not "
                         f"{str(dtype).removeprefix('torch.')}")
    return torch.float16


def resolve_dtype(name: str, device: torch.device, checkpoint: str) -> torch.dtype:
    if name == "auto":
        return getattr(torch, checkpoint) if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class ModelRunner:
    def __init__(self, config: ShardConfig, tp: TPContext = TPContext(),
                 bind_threads: bool = False):
        """`bind_threads`: on CPU, bind torch's threads one per core of this thread's
        affinity (a shard actor's torch thread, which runs all of the rank's torch work);
        in-process runners leave the caller's threads alone."""
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        self.one_row_weights = False  # a second copy of the weights for one-row products
        self.one_row_timings: tuple[float, float] | None = None  # (oneDNN, copy) seconds
        # The copy's layout ("panels" or "K x N", None without one); with panels, the rows
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
        self.bf16_timings: tuple[float, float] | None = None  # (bf16, widened) at 128 rows
        self.timings_read = {True: 0, False: 0}  # start-up timings read from disk, or timed
        # Torch's threads bound one per core (cpu_plan.bind_torch_threads): this thread,
        # which must be the one that runs the steps, and its OpenMP team.
        self._bound: list[int] = []  # native thread ids
        if self.device.type == "cpu":
            every = sorted(os.sched_getaffinity(0))
            torch.set_num_threads(config.cpu_threads or len(every))
            if bind_threads:
                self._bound = bind_torch_threads(every)
                if self._bound:
                    logger.info("torch's %d threads bound one per core: cores %s",
                                len(self._bound), every[:len(self._bound)])
        elif self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.checkpoint_dtype)
        # bfloat16 on a CPU with native bf16 products: the weights are multiplied in
        # bfloat16 by oneDNN (fp32 accumulation, half of float32's bytes to stream), and the
        # rest (activations, attention, the KV cache) stays float32, where raygen's CPU
        # kernels run; a bfloat16 model in torch ran slower than float32 here
        # (benchmarks/NOTES.md 56). Without native bf16 products (AVX2 CPUs: oneDNN refuses
        # bf16 weights there), raygen's block kernel multiplies by the bfloat16 weights in
        # the steps of few rows, and float32 copies of them serve the bigger ones (NOTES 63).
        self.weight_dtype = self.dtype
        self.bf16_products = cpu_bf16_products()
        if (self.device.type == "cpu" and self.dtype == torch.bfloat16
                and config.cpu_matmul != "torch"
                and (self.bf16_products or bf16_block_kernel(config.attention_backend))):
            self.dtype = torch.float32
            logger.info("bfloat16 weight products (%s, fp32 accumulation); activations, "
                        "attention and KV cache in float32",
                        "oneDNN" if self.bf16_products else
                        "raygen's block kernel, float32 copies for bigger steps")
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.device, self.dtype)
        self.backend = select_backend(config.attention_backend, self.device, self.dtype,
                                      config.block_size)
        logger.info("attention backend: %s", self.backend.name)
        with torch.device(self.device):
            self.model = CausalLM(self.model_config, tp, self.backend, self.dtype)
        load_weights(self.model, config.model)
        self.model.eval()
        self.matmul = self._pack_weights(config.cpu_matmul)
        if self.timings_read[True]:
            logger.info("start-up timings: %d read from an earlier start on this machine "
                        "(%s), %d timed", self.timings_read[True],
                        startup_timings.directory(), self.timings_read[False])
        drop_gguf_blocks(self.model)  # a path that multiplies by none of them
        # With raygen's CPU attention kernel come its norm and rotary kernels (the torch
        # backend stays the pure-torch reference).
        if isinstance(self.backend, CpuPagedAttentionBackend):
            use_cpu_kernels(self.model, self.backend.kernel)
            logger.info("RMSNorm and rotary embedding: raygen's CPU kernels")
        self.lora: LoRAAdapters | None = None
        # stage_adapter's, written on the shard actor's other thread, taken by steps
        self.staged_adapters: dict[tuple[str, str], StagedAdapter] = {}
        self._staged_lock = threading.Lock()
        if config.lora_adapters:
            self.lora = LoRAAdapters(self.model, config.max_lora_rank, self.dtype, self.device,
                                     self._lora_kernels())
            for slot, (name, path) in enumerate(config.lora_adapters, start=1):
                spec = self.lora.load(name, path, slot)
                logger.info("LoRA adapter %s: rank %d over %s (%s)", name, spec.rank,
                            ", ".join(spec.target_modules), path)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.seqs: dict[str, _Seq] = {}
        self._cut = threading.Event()  # cut_short's: rank 0 ends its multi-step early
        # Rank 0 samples, so it alone keeps the grammar matchers.
        self.grammars = Grammars(config.model, self.model_config.vocab_size) \
            if tp.rank == 0 else None

    def _pack_weights(self, choice: str) -> str:
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
            kernels = self.backend.kernel \
                if isinstance(self.backend, CpuPagedAttentionBackend) else None
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
                self._time_quantized()
            return "onednn"
        # One-row products (a batch-1 step) may be faster through MKL on a second, K x N
        # copy of the weights: it depends on the CPU and the threads (benchmarks/NOTES.md
        # 31, 45), so the copy is timed against oneDNN below and kept only where it pays.
        # It is made only where it and the KV cache take at most half of the memory still
        # available: the core plan is the serving app's default, and a model that loads
        # without the copy must not fail to because of it.
        self.one_row_weights = choice == "auto"
        if self.one_row_weights:
            copy = linear_weight_bytes(self.model)
            kv_cache = self.profile_num_blocks(0) * self.block_bytes()  # num_blocks, or the budget
            available = available_memory()
            if not one_row_copy_fits(copy, kv_cache, available):
                self.one_row_weights = False
                logger.info("no second copy of the weights: %.0f MB of weights and "
                            "%.0f MB of KV cache would pass half of the %.0f MB available",
                            copy / 2**20, kv_cache / 2**20, available / 2**20)
        # The copy is cut into panels where raygen's kernels multiply by them: the CPU
        # attention backend's module (float32), built for AVX-512.
        kernels = self.backend.kernel if isinstance(self.backend, CpuPagedAttentionBackend) \
            else None
        if kernels is not None and (self.dtype != torch.float32 or not kernels.panels_supported()):
            kernels = None
        t0 = time.perf_counter()
        size = pack_for_onednn(self.model, one_row_copy=self.one_row_weights,
                               panel_kernels=kernels)
        logger.info("weights reordered for oneDNN: %.0f MB in %.1f s", size / 2**20,
                    time.perf_counter() - t0)
        if self.one_row_weights:
            self._time_weight_copy(panels=kernels is not None)
        quant_kernels = self.backend.kernel \
            if isinstance(self.backend, CpuPagedAttentionBackend) else None
        if (choice == "auto" and self.dtype == torch.float32 and quant_kernels is not None
                and quant_kernels.quant_supported()):
            self.quant_int8 = (self.config.quant_products == "int8"
                               and quant_kernels.quant_i8_supported())
            self.quant_types = pack_quantized(self.model, quant_kernels, self.quant_int8)
            if self.quant_types:
                self._time_quantized()
        return "onednn"

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
            up_to = 0
            for rows in QUANT_TIMED_ROWS:
                float_s, blocks_s = timings[rows] = self._timed(
                    ("quant", kind, len(linears), rows, self.quant_int8),
                    time_quant_products, linears, rows)
                if blocks_s > QUANT_MAX_RATIO * float_s:
                    break
                up_to = rows
            for m in linears:
                m.quant_rows = up_to
            self.quant_rows_by_kind[kind] = up_to
            logger.info("raygen's block kernel, %d linears of %s (%s): %s: %s", len(linears),
                        kind, "x rounded to int8 blocks, products in integers"
                        if self.quant_int8 else "x in float32",
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

    def compute_path(self) -> dict:
        """How this rank computes (for /info and the logs): the device, the dtype the
        weights are multiplied in, the activations', the attention backend, and a GGUF
        file's blocks (linears by type, the steps that use them, x in float32 or int8)."""
        return {
            "device": self.device.type,
            "weight_dtype": str(self.weight_dtype).removeprefix("torch."),
            "activation_dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "quant_blocks": ({"types": self.quant_types, "steps_up_to_rows": self.quant_rows,
                              "steps_up_to_rows_by_linear": self.quant_rows_by_kind,
                              "x": "int8" if self.quant_int8 else "float32"}
                             if self.quant_types else None),
        }

    # -- KV cache ----------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.model.model.layers[0].self_attn.num_kv_heads

    def block_bytes(self) -> int:
        mc = self.model_config
        per_token = 2 * mc.num_layers * self.kv_heads * mc.head_dim * self.kv_dtype.itemsize
        return per_token * self.config.block_size

    def profile_num_blocks(self, max_batch_prefill_tokens: int) -> int:
        """How many blocks fit: a fixed count, a CPU budget, or on CUDA what is free after
        a forward at the largest prefill (activations peak there)."""
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type != "cuda":
            return max(1, self.config.kv_cache_memory // self.block_bytes())
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_forward(max_batch_prefill_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - peak - used_by_others
        return max(1, int(budget // self.block_bytes()))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.config.block_size, self.kv_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(mc.num_layers)
        ]
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens in %s (%.1f MiB per shard)", num_blocks,
                    self.config.block_size, str(self.kv_dtype).removeprefix("torch."),
                    num_blocks * self.block_bytes() / 2**20)

    def _dummy_forward(self, num_tokens: int) -> None:
        num_tokens = min(num_tokens, self.model_config.max_position_embeddings)
        blocks = -(-num_tokens // self.config.block_size)
        saved = self.kv_caches, self.num_blocks
        self.allocate_kv_cache(blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = self._metadata([], [(0, num_tokens, 0, list(range(blocks)))], positions, num_tokens)
        self.model(ids, positions, self.kv_caches, meta)
        self.kv_caches, self.num_blocks = saved

    # -- the step ------------------------------------------------------------------
    def step(self, step: StepInput) -> StepOutput | None:
        self._apply_diff(step)
        if step.num_steps > 1:
            return self._multi_step(step)
        self._cut.clear()  # a cut asked for before this step: this step takes it in
        return self._forward(step.num_scheduled_tokens, step.draft_token_ids)

    def cut_short(self) -> None:
        """Ask the multi-step running (or the next one) to stop after its current step: a
        request arrived that should not wait for the rest. Rank 0's decides for all ranks;
        called from another thread than the steps'."""
        self._cut.set()

    def _multi_step(self, step: StepInput) -> StepOutput | None:
        """Decode steps one after another, each fed the tokens the one before it drew; a
        request drops out once it has taken its scheduled tokens or drawn its
        end-of-sequence or a stop token (which every rank sees, rank 0 having broadcast
        it). With `step.drafting`, each step first drafts from the requests' own text
        (every rank the same drafts) and checks them beside their next tokens. Rows come
        back step after step."""
        left = dict(step.num_scheduled_tokens)  # tokens each request may still take
        drafting = step.drafting
        outputs: list[StepOutput] = []
        drafted: dict[str, list[int]] = {}  # request -> [draft tokens checked, kept]
        for i in range(step.num_steps):
            batch = {r: 1 for r, n in left.items() if n > 0}
            if not batch:
                break
            drafts = {}
            if drafting is not None:
                drafts = draft_step([(r, self._speculation(r, drafting), self.seqs[r].token_ids,
                                      left[r]) for r in batch],
                                    drafting.speculate, drafting.max_rows)
                for request_id, draft in drafts.items():
                    batch[request_id] += len(draft)
            known = {r: len(self.seqs[r].token_ids) for r in batch}
            output = self._forward(batch, drafts)
            if output is not None:
                outputs.append(output)
            for request_id in batch:
                seq = self.seqs[request_id]
                new = seq.token_ids[known[request_id]:]
                left[request_id] -= len(new)
                if any(self._ends(seq, token_id) for token_id in new):
                    left[request_id] = 0
                if request_id in drafts:
                    # Positions past the last kept draft are computed again.
                    seq.num_computed_tokens = len(seq.token_ids) - 1
                    seq.speculation.record(len(drafts[request_id]), len(new) - 1)
                    counts = drafted.setdefault(request_id, [0, 0])
                    counts[0] += len(drafts[request_id])
                    counts[1] += len(new) - 1
            if i + 1 < step.num_steps and self._cut_now():
                break
        if self.tp.rank != 0:
            return None
        return StepOutput([r for o in outputs for r in o.request_ids],
                          [t for o in outputs for t in o.token_ids],
                          [lp for o in outputs for lp in o.logprobs],
                          [top for o in outputs for top in o.top_logprobs],
                          errors={r: e for o in outputs for r, e in o.errors.items()},
                          drafted={r: tuple(counts) for r, counts in drafted.items()})

    def _speculation(self, request_id: str, drafting: StepDrafting) -> SpeculationState:
        """The request's n-gram index and drafting record on this rank, made at its first
        multi-step with drafting."""
        seq = self.seqs[request_id]
        if seq.speculation is None:
            seq.speculation = SpeculationState(drafting.min_n, drafting.max_n)
        return seq.speculation

    def _ends(self, seq: _Seq, token_id: int) -> bool:
        params = seq.params
        return (token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.model_config.eos_token_ids))

    def _cut_now(self) -> bool:
        """Whether rank 0 was asked to cut the multi-step short (then no longer asked);
        every rank gets its answer."""
        cut = self.tp.rank == 0 and self._cut.is_set()
        if cut:
            self._cut.clear()
        if self.tp.world_size > 1:
            flag = torch.tensor([int(cut)], dtype=torch.long, device=self.device)
            dist.broadcast(flag, src=0)
            cut = bool(flag.item())
        return cut

    def _forward(self, num_scheduled_tokens: dict[str, int],
                 draft_token_ids: dict[str, list[int]]) -> StepOutput | None:
        """One forward over the requests' scheduled tokens (each request's mirror says
        where they start), sampling where a request reaches its last token."""
        # Decodes first (drafting ones too): the attention backend handles them as one
        # batched call.
        order = sorted(num_scheduled_tokens, key=lambda r: (num_scheduled_tokens[r] != 1
                                                            and r not in draft_token_ids))
        lora_runs: list[tuple[int, int, int]] = []  # (adapter slot, first row, end row)
        input_ids, positions, slots = [], [], []
        decodes, prefills = [], []
        logit_rows: list[int] = []  # hidden rows that need logits
        samples: list[_Sample] = []
        prompt_rows: dict[str, tuple[int, list[int]]] = {}  # request -> (first row, targets)
        block_size = self.config.block_size
        for request_id in order:
            seq = self.seqs[request_id]
            n = num_scheduled_tokens[request_id]
            draft = draft_token_ids.get(request_id, [])
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row0 = len(input_ids)
            if seq.lora_slot:
                lora_runs.append((seq.lora_slot, row0, row0 + n))
            input_ids.extend(seq.token_ids[start:end - len(draft)])
            input_ids.extend(draft)
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if n == 1 or draft:
                # A decode; with drafts, each of its rows attends as a decode of its own
                # (the cache up to its position, its own new key included): one batched
                # call, where a chunk of its own cost a call per layer and request
                # (benchmarks/NOTES.md 69).
                decodes.extend((p + 1, seq.block_ids) for p in range(start, end))
            else:
                prefills.append((row0, row0 + n, start, seq.block_ids[: -(-end // block_size)]))
            if seq.params.prompt_logprobs and start < seq.num_prompt_tokens - 1:
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_rows[request_id] = (len(logit_rows),
                                           seq.token_ids[start + 1 : start + 1 + count])
                logit_rows.extend(range(row0, row0 + count))
            if end - len(draft) == len(seq.token_ids):
                # One row per token to draw: after the known tokens, then after each draft
                # (kept only while the drafts before it match what was drawn).
                for j in range(len(draft) + 1):
                    known = seq.token_ids + draft[:j] if j else seq.token_ids
                    row = SampleRow(seq.params, seq.seed, len(known) - seq.num_prompt_tokens,
                                    known, seq.num_prompt_tokens)
                    samples.append(_Sample(request_id, len(logit_rows), row,
                                           draft[j] if j < len(draft) else None))
                    logit_rows.append(row0 + n - 1 - len(draft) + j)
            seq.num_computed_tokens = end
        if not input_ids:
            return None
        dev = self.device
        positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
        meta = self._metadata(decodes, prefills, positions_t, len(input_ids), slots)
        if self.lora is not None:
            self.lora.batch.set(lora_runs, len(decodes), dev)
        try:
            hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                                positions_t, self.kv_caches, meta)
        finally:
            if self.lora is not None:
                self.lora.batch.set([], 0, dev)
        logits = None
        if logit_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        output, kept = None, None
        if self.tp.rank == 0:
            output, kept = _make_output(logits, samples, prompt_rows, self.grammars)
        if samples:
            self._keep_sampled([s.request_id for s in samples], kept)
        return output

    @property
    def thread_cores(self) -> list[list[int]]:
        """The cores each bound torch thread still running may run on, read from the
        kernel now."""
        cores = []
        for tid in self._bound:
            try:
                cores.append(sorted(os.sched_getaffinity(tid)))
            except OSError:  # that thread has ended (its actor is shutting down)
                pass
        return cores

    def _keep_sampled(self, request_ids: list[str], token_ids: list[int] | None) -> None:
        """Append this step's kept samples (-1: a row past a failed draft) to the mirror:
        the next step's input comes from here, not back from the batcher. Rank 0 sampled
        them; it broadcasts to the others (every rank knows how many rows there are)."""
        if self.tp.world_size > 1:
            tokens = (torch.tensor(token_ids, dtype=torch.long, device=self.device)
                      if token_ids is not None else
                      torch.empty(len(request_ids), dtype=torch.long, device=self.device))
            dist.broadcast(tokens, src=0)
            token_ids = tokens.tolist()
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            if token_id >= 0:
                self.seqs[request_id].token_ids.append(token_id)

    def _apply_diff(self, step: StepInput) -> None:
        for name, path in step.adapter_changes:
            self._change_adapter(name, path)
        for request_id in step.freed_request_ids:
            self.seqs.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.remove(request_id)
        for new in step.new_requests:
            self.seqs[new.request_id] = _Seq(list(new.token_ids), new.num_prompt_tokens,
                                             list(new.block_ids), new.num_computed_tokens,
                                             new.params, new.seed,
                                             self.lora_slot(new.params.adapter))
            if self.grammars is not None and new.params.grammar is not None:
                self.grammars.add(new.request_id, new.params.grammar,
                                  new.token_ids[new.num_prompt_tokens:])
        for cached in step.cached_requests:
            seq = self.seqs[cached.request_id]
            seq.block_ids.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def _change_adapter(self, name: str, path: str | None) -> None:
        """Load (`path`) or drop (None) a LoRA adapter, at the same step on every rank: the
        engine checked it can be served (shards/checkpoints/adapters.py) and that no
        request of a dropped one is left."""
        if path is None:
            with self._staged_lock:  # read ahead by a request that came too late
                for key in [k for k in self.staged_adapters if k[0] == name]:
                    del self.staged_adapters[key]
            if self.lora is not None and name in self.lora.slots:
                self.lora.unload(name)
                logger.info("LoRA adapter %s dropped", name)
            return
        if self.lora is None:
            self.lora = LoRAAdapters(self.model, self.config.max_lora_rank, self.dtype,
                                     self.device, self._lora_kernels())
        used = set(self.lora.slots.values())
        slot = next(s for s in range(1, len(used) + 2) if s not in used)
        t0 = time.perf_counter()
        with self._staged_lock:
            staged = self.staged_adapters.pop((name, path), None)
        spec = self.lora.load(name, path, slot, staged)
        logger.info("LoRA adapter %s: rank %d over %s (%s), loaded in %.2f s", name, spec.rank,
                    ", ".join(spec.target_modules), path, time.perf_counter() - t0)

    def stage_adapter(self, name: str, path: str) -> None:
        """Read the LoRA adapter at `path` and lay it out for this rank ahead of the step
        that loads it, which then only copies it into place: called beside the steps (the
        shard actor's other thread), since reading it inside a step stalled every stream
        for that long. A bad one is left for that step to refuse."""
        layers = self.lora.layers if self.lora is not None else adapted_layers(self.model)
        t0 = time.perf_counter()
        try:
            staged = read_adapter(self.model, layers, self.config.max_lora_rank, name, path,
                                  self.dtype, self.device)
        except AdapterError:
            return
        with self._staged_lock:
            while len(self.staged_adapters) >= MAX_STAGED_ADAPTERS:  # never loaded: oldest go
                self.staged_adapters.pop(next(iter(self.staged_adapters)))
            self.staged_adapters[(name, path)] = staged
        logger.info("LoRA adapter %s read ahead of its step in %.2f s", name,
                    time.perf_counter() - t0)

    def _lora_kernels(self):
        """The LoRA kernel comes with raygen's CPU attention kernel, like the norm and
        rotary ones (the torch backend stays the pure-torch reference)."""
        if isinstance(self.backend, CpuPagedAttentionBackend):
            return self.backend.kernel
        return None

    def lora_slot(self, adapter: str | None) -> int:
        if adapter is None:
            return 0
        if self.lora is None or adapter not in self.lora.slots:
            raise ValueError(f"LoRA adapter {adapter!r} is not loaded on this shard")
        return self.lora.slots[adapter]

    def _metadata(self, decodes, prefills, positions, num_tokens, slots=None) -> AttentionMetadata:
        dev = self.device
        if slots is None:
            slots = list(range(num_tokens))
        width = max((len(b) for _, b in decodes), default=0)
        tables = torch.tensor([b + [0] * (width - len(b)) for _, b in decodes] or [[0]],
                              dtype=torch.long, device=dev)[: len(decodes)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            decode_block_tables=tables,
            decode_seq_lens=torch.tensor([n for n, _ in decodes], dtype=torch.long, device=dev),
            prefills=[PrefillSeq(s, e, c, torch.tensor(b, dtype=torch.long, device=dev))
                      for s, e, c, b in prefills],
        )
        if self.backend.needs_varlen_metadata:
            _add_varlen(meta, decodes, prefills, dev)
        return meta

    # -- health --------------------------------------------------------------------
    def warmup(self, max_batch_prefill_tokens: int) -> int:
        t0 = time.perf_counter()
        num_blocks = self.profile_num_blocks(max_batch_prefill_tokens)
        self.allocate_kv_cache(num_blocks)
        logger.info("warmup took %.2fs", time.perf_counter() - t0)
        return num_blocks


@dataclass(frozen=True, slots=True)
class _Sample:
    """A row that draws a token: the request's next one, or the one after a draft
    (`draft`: the draft token at this row's position, which the drawn token must equal for
    the request's next row to count)."""

    request_id: str
    logit_row: int
    row: SampleRow
    draft: int | None = None


def _make_output(logits: torch.Tensor | None, samples: list[_Sample],
                 prompt_rows: dict[str, tuple[int, list[int]]],
                 grammars: Grammars | None) -> tuple[StepOutput, list[int]]:
    """Rank 0's output, and per sample row the token kept (-1: dropped, after a draft
    that differed from what was drawn)."""
    if logits is None:
        return StepOutput([], [], [], []), []
    errors: dict[str, str] = {}
    result = None
    kept: list[int] = []
    if samples:
        rows = logits[[s.logit_row for s in samples]]
        if grammars is not None:
            errors = grammars.mask(rows, [s.request_id for s in samples])
        result = sample(rows, [s.row for s in samples])
        # A drafting request keeps its rows up to the first draft that differs from what
        # was drawn there; what is drawn is what decoding without drafts would draw.
        failed: set[str] = set()
        for s, token in zip(samples, result.token_ids, strict=True):
            kept.append(-1 if s.request_id in failed else token)
            if s.draft is not None and token != s.draft:
                failed.add(s.request_id)
        if grammars is not None:
            errors |= grammars.advance([(s.request_id, token) for s, token
                                        in zip(samples, kept, strict=True)
                                        if token >= 0 and s.request_id not in errors])
    prompt_logprobs = {}
    if prompt_rows:
        logp = logits.float().log_softmax(dim=-1)
        for request_id, (first, targets) in prompt_rows.items():
            rows = torch.arange(first, first + len(targets), device=logits.device)
            target_ids = torch.tensor(targets, device=logits.device)
            prompt_logprobs[request_id] = logp[rows, target_ids].tolist()
    if result is None:
        return StepOutput([], [], [], [], prompt_logprobs), kept
    keep = [i for i, token in enumerate(kept) if token >= 0]
    return StepOutput([samples[i].request_id for i in keep], [kept[i] for i in keep],
                      [result.logprobs[i] for i in keep],
                      [result.top_logprobs[i] for i in keep], prompt_logprobs, errors), kept


def _add_varlen(meta: AttentionMetadata, decodes, prefills, dev) -> None:
    q_lens = [1] * len(decodes) + [e - s for s, e, _, _ in prefills]
    seq_lens = [n for n, _ in decodes] + [c + e - s for s, e, c, _ in prefills]
    tables = [b for _, b in decodes] + [b for _, _, _, b in prefills]
    width = max(len(b) for b in tables)
    meta.cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=dev)
    meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    meta.block_tables = torch.tensor([b + [0] * (width - len(b)) for b in tables],
                                     dtype=torch.int32, device=dev)
    meta.max_seqlen_q = max(q_lens)
    meta.max_seqlen_k = max(seq_lens)
