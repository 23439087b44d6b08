"""Offline API: the engine wired to an in-process shard, for batch jobs and tests.

    llm = LLM("models/demo-tiny")
    outputs = llm.generate(["Hello"], SamplingParams(max_new_tokens=32))
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from shards.checkpoint import load_tokenizer
from shards.model_runner import ModelRunner, ShardConfig


class LLM:
    def __init__(self, model: str, *, max_batch_prefill_tokens: int = 4096,
                 max_batch_total_tokens: int | None = None, max_batch_size: int | None = None,
                 waiting_served_ratio: float | None = None,
                 max_waiting_tokens: int | None = None,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory: int = 1 << 30,
                 dtype: str = "auto", device: str = "auto", attention_backend: str = "auto",
                 cpu_threads: int | None = None, cpu_matmul: str = "auto"):
        self.runner = ModelRunner(ShardConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, attention_backend=attention_backend,
            cpu_threads=cpu_threads, cpu_matmul=cpu_matmul))
        num_blocks = self.runner.profile_num_blocks(max_batch_prefill_tokens)
        if max_batch_total_tokens is not None:
            num_blocks = min(num_blocks, -(-max_batch_total_tokens // block_size))
        self.runner.allocate_kv_cache(num_blocks)
        mc = self.runner.model_config
        self.tokenizer = load_tokenizer(model)
        scheduler_config = SchedulerConfig(
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_total_tokens=max_batch_total_tokens, max_batch_size=max_batch_size,
            waiting_served_ratio=waiting_served_ratio, max_waiting_tokens=max_waiting_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len or mc.max_position_embeddings)
        cache_config = CacheConfig(block_size, num_blocks, enable_prefix_caching)
        self.engine = LLMEngine(scheduler_config, cache_config, self.tokenizer,
                                mc.eos_token_ids, self.runner)
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
            self._async = AsyncEngine(self.engine, lambda s: asyncio.to_thread(self.runner.step, s))
        async for output in self._async.generate(f"stream-{next(self._ids)}", self.encode(prompt),
                                                 params or SamplingParams()):
            yield output
