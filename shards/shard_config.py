"""A shard rank's settings: plain data, importable without torch (the app builder reads
them; shards/model_runner.py acts on them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardConfig:
    model: str
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None  # fixed count; else sized from memory at warmup
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache on CPU
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    cpu_threads: int | None = None  # None: every core this process may use
    # Cores per node left to the serving plane (shards/cpu_plan.py); None: one where every
    # rank on the node still gets a core of its own.
    reserved_cpus: int | None = 0
    # CPU, one rank per node: its steps also use the reserved cores (shards/cpu_plan.py).
    borrow_reserved_cpus: bool = False
    # Whole cores each rank owns, claimed node-wide so that ranks of other groups on the
    # node get other cores (shards/cpu_plan.py); None: the node's shard cores are split
    # among this group's ranks on it.
    cores_per_rank: int | None = None
    # onednn | torch; auto: oneDNN on CPU (float32/bfloat16)
    cpu_matmul: str = "auto"
    # Testing only: each rank sleeps this long before a step that admits new requests, so
    # tests get steps of any length without long prompts.
    debug_prefill_delay_s: float = 0.0
