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
from shards.checkpoints.loader import load_weights
from shards.cpu import greedy_screen
from shards.cpu.layouts import cpu_bf16_products, drop_gguf_blocks
from shards.cpu.plan import bind_torch_threads
from shards.model.attention import CpuPagedAttentionBackend, select_backend
from shards.model.config import ModelConfig
from shards.model.grammar import Grammars
from shards.model.layers import TPContext, use_cpu_kernels
from shards.model.llama import CausalLM, DecodeLoop
from shards.shard_config import ShardConfig
from shards.worker.adapters import RankAdapters
from shards.worker.batch import argmax_only, greedy_output, make_output, metadata, step_rows
from shards.worker.weight_plan import WeightPlan, bf16_block_kernel

logger = logging.getLogger(__name__)

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
        self._bound: list[int] = []  # native ids of torch's threads bound one per core
        if self.device.type == "cpu":
            self._set_threads(bind_threads)
        elif self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.checkpoint_dtype)
        self.weight_dtype = self.dtype
        self.bf16_products = cpu_bf16_products()
        if self._bf16_weights_beside_float32():
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
        self.weights = WeightPlan(self.model, config, self.backend, self.device, self.dtype,
                                  self.weight_dtype, self.bf16_products,
                                  lambda: self.profile_num_blocks(0) * self.block_bytes())
        drop_gguf_blocks(self.model)  # a path that multiplies by none of them
        # With raygen's CPU attention kernel come its norm, rotary and LoRA kernels (the
        # torch backend stays the pure-torch reference).
        kernels = self.backend.kernel if isinstance(self.backend, CpuPagedAttentionBackend) \
            else None
        if kernels is not None:
            use_cpu_kernels(self.model, kernels)
            self.model.model.decode_loop = DecodeLoop(self.model.model, kernels)
            logger.info("RMSNorm and rotary embedding: raygen's CPU kernels")
        # Greedy rows that want no logprobs: the LM head's argmax from a Q8_0 copy of it
        # (shards/cpu/greedy_screen.py), where it pays; one rank only (it samples).
        self.screen = greedy_screen.build(self.model, kernels, tp.world_size)
        self.adapters = RankAdapters(self.model, config.max_lora_rank, self.dtype, self.device,
                                     kernels, config.lora_adapters)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.seqs: dict[str, _Seq] = {}
        self._cut = threading.Event()  # cut_short's: rank 0 ends its multi-step early
        # Rank 0 samples, so it alone keeps the grammar matchers.
        self.grammars = Grammars(config.model, self.model_config.vocab_size) \
            if tp.rank == 0 else None

    def _set_threads(self, bind: bool) -> None:
        """As many torch threads as this thread's cores (or `cpu_threads`); with `bind`,
        each bound to one of them (cpu_plan.bind_torch_threads): this thread, which must be
        the one that runs the steps, and its OpenMP team."""
        every = sorted(os.sched_getaffinity(0))
        torch.set_num_threads(self.config.cpu_threads or len(every))
        if bind:
            self._bound = bind_torch_threads(every)
            if self._bound:
                logger.info("torch's %d threads bound one per core: cores %s",
                            len(self._bound), every[:len(self._bound)])

    def _bf16_weights_beside_float32(self) -> bool:
        """bfloat16 on a CPU with native bf16 products: the weights are multiplied in
        bfloat16 by oneDNN (fp32 accumulation, half of float32's bytes to stream), and the
        rest (activations, attention, the KV cache) stays float32, where raygen's CPU
        kernels run; a bfloat16 model in torch ran slower than float32 here
        (benchmarks/NOTES.md 56). Without native bf16 products (AVX2 CPUs: oneDNN refuses
        bf16 weights there), raygen's block kernel multiplies by the bfloat16 weights in the
        steps of few rows, and float32 copies of them serve the bigger ones (NOTES 63)."""
        return (self.device.type == "cpu" and self.dtype == torch.bfloat16
                and self.config.cpu_matmul != "torch"
                and (self.bf16_products or bf16_block_kernel(self.config.attention_backend)))

    def compute_path(self) -> dict:
        """How this rank computes (for /info and the logs): the device, the dtype the
        weights are multiplied in, the activations', the attention backend, and a GGUF
        file's blocks (linears by type, the steps that use them, x in float32 or int8), and
        the weight copy's layout."""
        return {
            "device": self.device.type,
            "weight_dtype": str(self.weight_dtype).removeprefix("torch."),
            "activation_dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "quant_blocks": self.weights.quant_blocks(),
            # A second copy of the weights for small steps, as timed at start-up ("rows in
            # lanes", "panels", "K x N", "float32, widened from bfloat16"), or None.
            "weight_copy": self.weights.weight_copy,
            # Greedy rows without logprobs take the LM head's argmax from its Q8_0 copy
            # (exact: shards/cpu/greedy_screen.py), where that paid at start-up.
            "greedy_screen": self.screen is not None,
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
        meta = metadata(self.backend, self.device, [], [(0, num_tokens, 0, list(range(blocks)))],
                        num_tokens)
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
                if not new:  # its first row was not kept: it failed (rank 0's errors)
                    left[request_id] = 0
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
        rows = step_rows(self.seqs, num_scheduled_tokens, draft_token_ids,
                         self.config.block_size)
        if not rows.input_ids:
            return None
        dev = self.device
        meta = metadata(self.backend, dev, rows.decodes, rows.prefills, len(rows.input_ids),
                        rows.slots)
        self.adapters.set_batch(rows.lora_runs, len(rows.decodes), dev)
        try:
            hidden = self.model(torch.tensor(rows.input_ids, dtype=torch.long, device=dev),
                                torch.tensor(rows.positions, dtype=torch.long, device=dev),
                                self.kv_caches, meta)
        finally:
            self.adapters.set_batch([], 0, dev)
        if (self.screen is not None and len(rows.logit_rows) <= self.screen.max_rows
                and argmax_only(rows.samples, rows.prompt_rows)):
            tokens = self.screen.argmax(hidden[torch.tensor(rows.logit_rows, device=dev)])
            output, kept = greedy_output([tokens[s.logit_row] for s in rows.samples],
                                         rows.samples)
            self._keep_sampled([s.request_id for s in rows.samples], kept)
            return output
        logits = None
        if rows.logit_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows.logit_rows, device=dev)])
        output, kept = None, None
        if self.tp.rank == 0:
            output, kept = make_output(logits, rows.samples, rows.prompt_rows, self.grammars,
                                       self.model_config.eos_token_ids)
        if rows.samples:
            self._keep_sampled([s.request_id for s in rows.samples], kept)
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
            self.adapters.change(name, path)
        for request_id in step.freed_request_ids:
            self.seqs.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.remove(request_id)
        for new in step.new_requests:
            self.seqs[new.request_id] = _Seq(list(new.token_ids), new.num_prompt_tokens,
                                             list(new.block_ids), new.num_computed_tokens,
                                             new.params, new.seed,
                                             self.adapters.slot(new.params.adapter))
            if self.grammars is not None and new.params.grammar is not None:
                self.grammars.add(new.request_id, new.params.grammar,
                                  new.token_ids[new.num_prompt_tokens:])
        for cached in step.cached_requests:
            seq = self.seqs[cached.request_id]
            seq.block_ids.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def stage_adapter(self, name: str, path: str) -> None:
        """Read a LoRA adapter ahead of the step that loads it (RankAdapters.stage)."""
        self.adapters.stage(name, path)

    # -- health --------------------------------------------------------------------
    def warmup(self, max_batch_prefill_tokens: int) -> int:
        t0 = time.perf_counter()
        num_blocks = self.profile_num_blocks(max_batch_prefill_tokens)
        self.allocate_kv_cache(num_blocks)
        logger.info("warmup took %.2fs", time.perf_counter() - t0)
        return num_blocks
