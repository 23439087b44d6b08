"""Builder arguments: every knob by name, typed and checked before any cluster starts.

`serve run deployments.app:build_app model=DIR tensor_parallel_size=2` passes strings;
pydantic converts them and rejects bad values with a clear message. The same names are
the keys of `args:` in serve_config.yaml."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import CacheConfig, SchedulerConfig
from shards.checkpoints.adapters import parse_lora_adapters
from shards.shard_config import ShardConfig

DEMO_MODEL = "models/demo-tiny"


def default(config_class: type, name: str):
    """A component config's default: each default is written once, in the component's
    dataclass, and the builder args (and the offline LLM through them) take it from there."""
    return next(f.default for f in dataclasses.fields(config_class) if f.name == name)


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(DEMO_MODEL, description="Hugging Face model directory")
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = default(ShardConfig, "dtype")
    quant_products: Literal["int8", "float32"] = Field(
        default(ShardConfig, "quant_products"), description="a GGUF file's Q4_0, Q4_1 and "
        "Q8_0 weights on CPU: `float32` multiplies them by the activations as they are (the "
        "dequantized weights' product, exact to rounding); `int8` by the activations rounded "
        "to int8 blocks in integers, as llama.cpp does: faster, and its answers move as "
        "llama.cpp's do (needs AVX-512 VNNI or AVX2, else float32)")
    quantize: Literal["q8_0"] | None = Field(
        None, description="TGI's --quantize, on CPU: `q8_0` quantizes a float checkpoint's "
        "linears at load into 8-bit blocks of 32 (llama.cpp's Q8_0), multiplied as a GGUF "
        "file's are (quant_products); float32 only, not with a GGUF file (it is quantized)")
    # Engine (TGI's names).
    max_batch_prefill_tokens: int = Field(
        default(SchedulerConfig, "max_batch_prefill_tokens"), ge=1)
    max_batch_total_tokens: int | None = Field(None, ge=1)
    max_batch_size: int | None = Field(None, ge=1)
    # None: TGI v3's policy (admit at every step with chunked prefill, else 0.3 and 20).
    waiting_served_ratio: float | None = Field(None, ge=0)
    max_waiting_tokens: int | None = Field(None, ge=0)
    enable_chunked_prefill: bool = default(SchedulerConfig, "enable_chunked_prefill")
    speculate: int = Field(
        default(SchedulerConfig, "speculate"), ge=0, le=16, description="TGI's --speculate: "
        "up to this many draft tokens per decoding request, looked up in its own prompt and "
        "output and checked in the same step (output unchanged; faster where answers copy "
        "their input: edits, summaries, code, RAG). 0: off")
    num_scheduler_steps: int = Field(
        default(SchedulerConfig, "num_scheduler_steps"), ge=1, le=64, description="vLLM's "
        "multi-step decoding: while no request waits to join, the shards run up to this many "
        "decode steps per message and their tokens stream out together, so the serving "
        "plane's cost per message is paid once for them (a request arriving cuts them short "
        "after one step). 1: every token on its own, the most even stream")
    prompt_lookup_min: int = Field(default(SchedulerConfig, "prompt_lookup_min"), ge=1)
    prompt_lookup_max: int = Field(default(SchedulerConfig, "prompt_lookup_max"), ge=1)
    lora_adapters: str | dict[str, str] | None = Field(
        None, description="LoRA adapters (PEFT directories) to serve beside the base model: "
        "`name=path,name=path` as TGI's LORA_ADAPTERS, or a mapping in a config file. A "
        "request picks one by TGI's `adapter_id` or OpenAI's `model` (`name` or `base:name`)")
    max_loras: int = Field(default(SchedulerConfig, "max_loras"), ge=1, description="most "
                           "adapters whose requests run in one step (vLLM's name)")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters loaded at run time a replica keeps (vLLM's name): "
        "past it the least recently used idle one is dropped, to be loaded again when asked "
        "for; unset: all")
    max_lora_rank: int = Field(default(ShardConfig, "max_lora_rank"), ge=1,
                               description="an adapter of a larger rank is refused at start")
    enable_prefix_caching: bool = default(CacheConfig, "enable_prefix_caching")
    block_size: int = Field(default(CacheConfig, "block_size"), ge=1)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory: int = Field(default(ShardConfig, "kv_cache_memory"), ge=1 << 20,
                                 description="bytes of KV cache (CPU)")
    kv_cache_dtype: Literal["auto", "float16"] = Field(
        default(ShardConfig, "kv_cache_dtype"), description="vLLM's --kv-cache-dtype: "
        "`float16` keeps K and V in half the bytes (twice the tokens in kv_cache_memory, and "
        "half of what a decode step reads on CPU, as llama.cpp's default f16 cache); outputs "
        "move by float16's rounding, so greedy answers may differ from transformers'. On "
        "CUDA only with dtype=float16")
    gpu_memory_utilization: float = Field(
        default(ShardConfig, "gpu_memory_utilization"), gt=0, le=1)
    attention_backend: Literal["auto", "torch", "flash", "cpu"] = "auto"
    cpu_threads: int | None = Field(None, ge=1)
    reserved_cpus: int | None = Field(
        None, ge=0, description="cores per node the shards leave to the serving plane "
        "(ingress, batcher, Ray); the shards split the others, each rank pinned to its "
        "own slice. Unset: on CPU, one core where every rank on the node still gets one of "
        "its own (as vLLM's CPU server reserves one), else none; on GPUs none")
    serve_throughput_mode: bool = Field(
        True, description="`serve run deployments.app:build_app ...` starts its fresh Ray "
        "instance in Serve's throughput mode (HAProxy on the HTTP port). Set false to see "
        "the replicas' logs on the console and serve HTTP through Serve's proxy actor "
        "(where HAProxy cannot run, or to debug a replica); no effect under a config file")
    # Server limits (TGI's names and defaults).
    max_concurrent_requests: int = Field(128, ge=1)
    max_input_tokens: int | None = Field(None, ge=1)
    max_total_tokens: int | None = Field(None, ge=2)
    max_stop_sequences: int = Field(4, ge=0)
    max_best_of: int = Field(2, ge=1)
    max_top_n_tokens: int = Field(5, ge=0)
    max_n: int = Field(8, ge=1, description="largest OpenAI `n`")
    payload_limit: int = Field(2_000_000, ge=1024, description="bytes")
    grammar_check_timeout_s: float = Field(
        2.0, gt=0, description="a grammar (JSON schema, regex, tools) that takes longer to "
        "compile is refused (422/400) before it is queued")
    request_timeout: float | None = Field(None, gt=0, description="seconds per request")
    # Prefer the RAYGEN_API_KEY environment variable: Serve logs builder args at import.
    api_key: str | None = Field(None, repr=False)
    # Placement: logical CPUs reserved for the batcher replica and for each CPU shard.
    replica_cpus: float = Field(0.1, ge=0)
    shard_cpus: float = Field(
        0.1, gt=0, description="logical CPUs Ray reserves for each shard rank. 1 or more: "
        "a whole number of cores each rank pins to and owns on its node, claimed there so "
        "that ranks of other replicas on the node get other cores (GPU shards ask Ray for "
        "them beside their GPU); below 1, each replica splits the node's cores among its "
        "own ranks")

    @model_validator(mode="after")
    def _check_limits(self) -> AppArgs:
        if (self.max_input_tokens and self.max_total_tokens
                and self.max_input_tokens >= self.max_total_tokens):
            raise ValueError("max_input_tokens must be < max_total_tokens")
        if self.quantize is not None and (self.device != "cpu"
                                          or self.dtype not in ("auto", "float32")):
            raise ValueError(f"quantize={self.quantize} runs on CPU in float32; got "
                             f"device={self.device}, dtype={self.dtype}")
        if self.quantize is not None and self.model.endswith(".gguf"):
            raise ValueError(f"quantize={self.quantize}: model={self.model} is a GGUF file, "
                             "whose own blocks are multiplied as they are")
        parse_lora_adapters(self.lora_adapters)  # its own message names the entry
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.shard_cpus >= 1 and self.shard_cpus != int(self.shard_cpus):
            raise ValueError("shard_cpus of 1 or more is the whole number of cores each "
                             f"rank owns; got {self.shard_cpus}")
        return self

    @property
    def resolved_api_key(self) -> str | None:
        """The key from args, else from RAYGEN_API_KEY (the only env var raygen reads)."""
        return self.api_key or os.environ.get("RAYGEN_API_KEY") or None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").split("/")[-1]

    @property
    def admission(self) -> tuple[float, int]:
        """(waiting_served_ratio, max_waiting_tokens) in effect; (0, 0): every step."""
        return self.scheduler_config(1).admission

    @property
    def uses_compiled_graph(self) -> bool:
        """Ranks run their steps through a Ray Compiled Graph (shared-memory channels)
        where there are several; one rank takes actor calls (a graph at TP=1 measured
        slower on 2 cores: 89 against 56 ms a step, benchmarks/NOTES.md 51c)."""
        return self.tensor_parallel_size > 1

    @property
    def steps_in_flight(self) -> int:
        """2 (async scheduling: the next step is scheduled while one runs, +4% to +16%
        tok/s at concurrency 1 and 8 on 2 cores, benchmarks/NOTES.md 15, 29) unless a
        compiled graph runs the steps one after another anyway."""
        return 1 if self.uses_compiled_graph else 2

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            max_batch_size=self.max_batch_size,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len, speculate=self.speculate,
            prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
            num_scheduler_steps=self.num_scheduler_steps,
            max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras)

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching)

    def shard_config(self) -> ShardConfig:
        # "cuda" places shards on GPUs; inside a shard, tensors go where CUDA is usable
        # (a logical GPU on a machine without one falls back to CPU).
        return ShardConfig(
            model=self.model, dtype=self.dtype, device="auto" if self.device == "cuda" else "cpu",
            block_size=self.block_size,
            num_blocks=self.num_blocks, kv_cache_memory=self.kv_cache_memory,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            attention_backend=self.attention_backend, cpu_threads=self.cpu_threads,
            quant_products=self.quant_products, quantize=self.quantize,
            lora_adapters=self.adapters, max_lora_rank=self.max_lora_rank, **self.core_plan())

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """The LoRA adapters as (name, path) pairs, in the order they take slots."""
        return parse_lora_adapters(self.lora_adapters)

    @property
    def cores_per_rank(self) -> int | None:
        """Whole cores each rank owns on its node (shard_cpus >= 1), else None."""
        return int(self.shard_cpus) if self.shard_cpus >= 1 else None

    def core_plan(self) -> dict[str, int | bool | None]:
        """The shards' reserved_cpus, borrow_reserved_cpus and cores_per_rank
        (shards/cpu/plan.py); an unset reserved_cpus stays None on CPU, for each node to
        resolve."""
        cpu = self.device == "cpu"
        reserved = self.reserved_cpus if self.reserved_cpus is not None or cpu else 0
        # A rank alone on its node also runs its steps on the reserved cores, beside the
        # serving plane (shards/cpu/plan.py): that won on 2 cores (docs/performance.md).
        borrow = cpu and reserved != 0 and not self.cores_per_rank
        return {"reserved_cpus": reserved, "borrow_reserved_cpus": borrow,
                "cores_per_rank": self.cores_per_rank}

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """Bundle 0 holds the batcher replica, bundle i + 1 shard rank i (a GPU shard asks
        for CPUs only where it owns whole cores)."""
        shard = {"CPU": self.shard_cpus}
        if self.device == "cuda":
            shard = {"GPU": 1.0, **(shard if self.cores_per_rank else {})}
        return [{"CPU": max(self.replica_cpus, 0.01)}] + [dict(shard)] * self.tensor_parallel_size


def token_limits(args: AppArgs, max_position_embeddings: int) -> tuple[int, int]:
    """(max_input_tokens, max_total_tokens) as TGI derives them when unset."""
    max_total = args.max_total_tokens or max_position_embeddings
    max_total = min(max_total, max_position_embeddings)
    max_input = args.max_input_tokens or max_total - 1
    if not args.enable_chunked_prefill:
        max_input = min(max_input, args.max_batch_prefill_tokens)
    return min(max_input, max_total - 1), max_total


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's request limits with the model's context resolved (TGI's names)."""

    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int
    max_best_of: int
    max_top_n_tokens: int
    # The LoRA adapters a request may name: name -> (the id batchers know it by, path);
    # the ingress's live view (deployments/adapters.py).
    adapters: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # The model's end-of-sequence tokens (config.json's and generation_config.json's)
    eos_token_ids: frozenset[int] = frozenset()


def server_limits(args: AppArgs, max_position_embeddings: int,
                  adapters: Mapping[str, tuple[str, str]] | None = None,
                  eos_token_ids: frozenset[int] = frozenset()) -> Limits:
    max_input, max_total = token_limits(args, max_position_embeddings)
    if adapters is None:
        adapters = {name: (name, path) for name, path in args.adapters}
    return Limits(max_input, max_total, args.max_stop_sequences, args.max_best_of,
                  args.max_top_n_tokens, adapters, eos_token_ids)
