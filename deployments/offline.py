"""Offline API: the engine wired to an in-process shard, for batch jobs and tests.

    llm = LLM("models/demo-tiny")
    outputs = llm.generate(["Hello"], SamplingParams(max_new_tokens=32))
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Sequence

from deployments.config import AppArgs
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from shards.checkpoints.resolve import load_tokenizer
from shards.worker.model_runner import ModelRunner

# The builder args that mean something in one process: the engine's, the KV cache's and the
# model's. The server's limits, placement and HTTP settings do not apply here.
OFFLINE_ARGS = frozenset({
    "dtype", "max_batch_prefill_tokens", "max_batch_total_tokens", "max_batch_size",
    "waiting_served_ratio", "max_waiting_tokens", "enable_chunked_prefill",
    "enable_prefix_caching", "block_size", "num_blocks", "kv_cache_memory", "kv_cache_dtype",
    "gpu_memory_utilization", "attention_backend", "cpu_threads", "quant_products", "quantize",
    "speculate", "num_scheduler_steps", "prompt_lookup_min", "prompt_lookup_max",
    "lora_adapters", "max_loras", "max_lora_rank", "max_cpu_loras"})


class LLM:
    """`LLM(model, **args)`: `args` are the server's builder args of the same names
    (deployments/config.py, so the defaults are the server's); `device` is `auto` (CUDA
    where usable), `cpu` or `cuda`; `max_model_len` defaults to the model's context;
    `cpu_matmul` picks the CPU weight products (`auto`, `onednn`, `torch`) to compare them."""

    def __init__(self, model: str, *, device: str = "auto", max_model_len: int | None = None,
                 cpu_matmul: str = "auto", **args):
        unknown = set(args) - OFFLINE_ARGS
        if unknown:
            raise TypeError(f"LLM() got arguments that do not apply offline: {sorted(unknown)}")
        app_args = AppArgs(model=model, **args)
        self.runner = ModelRunner(dataclasses.replace(
            app_args.shard_config(), device=device, cpu_matmul=cpu_matmul))
        num_blocks = self.runner.profile_num_blocks(app_args.max_batch_prefill_tokens)
        if app_args.max_batch_total_tokens is not None:
            num_blocks = min(num_blocks,
                             -(-app_args.max_batch_total_tokens // app_args.block_size))
        self.runner.allocate_kv_cache(num_blocks)
        mc = self.runner.model_config
        self.tokenizer = load_tokenizer(model)
        self.engine = LLMEngine(app_args.scheduler_config(max_model_len
                                                          or mc.max_position_embeddings),
                                app_args.cache_config(num_blocks), self.tokenizer,
                                mc.eos_token_ids, self.runner,
                                frozenset(name for name, _ in app_args.adapters))
        self._ids = itertools.count()
        self._async: AsyncEngine | None = None

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer(prompt).input_ids

    def generate(self, prompts: Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        request_ids, prompt_ids = [], []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = f"offline-{next(self._ids)}"
            ids = self.encode(prompt)
            self.engine.add_request(request_id, ids, p)
            request_ids.append(request_id)
            prompt_ids.append(ids)
        collected: dict[str, list[RequestOutput]] = {r: [] for r in request_ids}
        unfinished = set(request_ids)
        while unfinished:
            for output in self.engine.step():
                if output.request_id in collected:  # the engine may serve others too
                    collected[output.request_id].append(output)
                    if output.finished:
                        unfinished.discard(output.request_id)
        return [CompletionOutput.collect(ids, collected[r])
                for r, ids in zip(request_ids, prompt_ids, strict=True)]

    async def stream(self, prompt: str | list[int],
                     params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as steps produce them; other streams share the batch."""
        if self._async is None:
            self._async = AsyncEngine(self.engine, lambda s: asyncio.to_thread(self.runner.step, s),
                                      interrupt=self.runner.cut_short)
        async for output in self._async.generate(f"stream-{next(self._ids)}", self.encode(prompt),
                                                 params or SamplingParams()):
            yield output
