"""A shard rank's settings: plain data, importable without torch (the app builder reads
them; shards/worker/model_runner.py acts on them)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class ShardConfig:
    model: str
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # fixed count; else sized from memory at warmup
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache on CPU
    # The KV cache's element type: auto (the activations'), or float16 (half the memory and
    # of what a decode step reads; outputs move by float16's rounding of K and V).
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    # A GGUF file's Q4_0, Q4_1 and Q8_0 blocks on CPU: multiplied by the activations as they
    # are (`float32`: the dequantized weights' product up to summation order), or by the
    # activations rounded to int8 blocks, in integers (`int8`, as llama.cpp does; where the
    # CPU has AVX-512 VNNI or AVX2): faster, less exact (benchmarks/NOTES.md 58, 66).
    quant_products: str = "float32"
    # A float checkpoint's linears quantized at load into Q8_0 blocks (None: not), which the
    # CPU's block kernel then multiplies by, as a GGUF file's own (quant_products applies).
    quantize: str | None = None
    cpu_threads: int | None = None  # None: every core this process may use
    # Cores per node left to the serving plane (shards/cpu/plan.py); None: one where every
    # rank on the node still gets a core of its own.
    reserved_cpus: int | None = 0
    # CPU, one rank per node: its steps also use the reserved cores (shards/cpu/plan.py).
    borrow_reserved_cpus: bool = False
    # Whole cores each rank owns, claimed node-wide so that ranks of other groups on the
    # node get other cores (shards/cpu/plan.py); None: the node's shard cores are split
    # among this group's ranks on it.
    cores_per_rank: int | None = None
    # Who multiplies by the weights on CPU: auto (oneDNN on reordered weights, plus a
    # second layout timed at start-up for the step sizes it makes faster), onednn, torch.
    # Not a server argument: auto won everywhere it was measured (docs/performance.md);
    # tests and benchmarks pick the others to check them.
    cpu_matmul: str = "auto"
    # LoRA adapters (name, PEFT directory), held in slots 1, 2, ... in this order, and the
    # largest rank one may have (shards/model/lora.py).
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 64
