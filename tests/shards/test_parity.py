"""Greedy output equals transformers' generate token for token, in a continuous batch
where requests join and leave at different steps, under chunking, prefix hits and KV
pressure."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from shards import demo_model
from shards.cpu.layouts import set_quant_rows
from tests.reference import PARITY_LENGTHS, PARITY_NEW_TOKENS, hf_greedy, make_prompts


def run_staggered(llm: LLM, prompts: list[list[int]], new_tokens: list[int],
                  per_step: int = 2) -> tuple[dict[str, list[int]], int]:
    """Add `per_step` requests before each step; returns outputs and the largest batch."""
    pending = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in pending}
    finished: set[str] = set()
    max_running = 0
    while pending or llm.engine.has_unfinished_requests():
        for rid, prompt, n in pending[:per_step]:
            llm.engine.add_request(rid, prompt, SamplingParams(max_new_tokens=n))
        pending = pending[per_step:]
        for out in llm.engine.step():
            outputs[out.request_id].extend(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
        max_running = max(max_running, len(llm.engine.scheduler.running))
        llm.engine.scheduler.check_integrity()
    assert finished == set(outputs)
    return outputs, max_running


def references(model_dir, prompts, new_tokens):
    return {f"r{i}": hf_greedy(model_dir, p, n)
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))}


@pytest.fixture(scope="module")
def parity_prompts():
    return make_prompts(2048, PARITY_LENGTHS, seed=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_with_staggered_arrivals(arch, llama_dir, qwen2_dir,
                                                              parity_prompts):
    model_dir = llama_dir if arch == "llama" else qwen2_dir
    llm = LLM(model_dir, num_blocks=256)
    got, max_running = run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    assert max_running >= 4, "requests should overlap in the batch"
    assert got == references(model_dir, parity_prompts, PARITY_NEW_TOKENS)
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


class CheckedLoop:
    """The decode loop of `llm`'s model, each step's hidden states checked against the
    modules' own path on the same inputs (which writes the same K and V again)."""

    def __init__(self, llm: LLM):
        self.model = llm.runner.model.model
        self.loop = self.model.decode_loop
        assert self.loop is not None, "raygen's CPU kernels run decode steps in the loop"
        self.rows: list[int] = []
        self.model.decode_loop = self

    def __call__(self, input_ids, positions, kv_caches, meta):
        out = self.loop(input_ids, positions, kv_caches, meta)
        self.model.decode_loop = None
        try:
            modules = self.model(input_ids, positions, kv_caches, meta)
        finally:
            self.model.decode_loop = self
        assert torch.equal(out, modules)
        self.rows.append(len(input_ids))
        return out


@pytest.mark.parametrize(("arch", "kv_cache_dtype"),
                         [("llama", "auto"), ("qwen2", "auto"), ("llama", "float16")])
def test_decode_steps_take_the_loop_bit_for_bit_as_the_modules(arch, kv_cache_dtype, llama_dir,
                                                                qwen2_dir, parity_prompts):
    """Decode-only steps skip the modules' dispatch (shards/model/llama.py DecodeLoop): the
    same kernels on the same tensors, so the same bits, Qwen2's q/k/v biases and a float16
    KV cache included; steps with a prefill keep the modules. (Equal to transformers: the
    test above, whose decode steps take the loop.)"""
    model_dir = llama_dir if arch == "llama" else qwen2_dir
    llm = LLM(model_dir, num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    checked = CheckedLoop(llm)
    run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    assert 1 in checked.rows and max(checked.rows) >= 4  # one row and a batch


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_stack_runs_the_layers_in_one_call_bit_for_bit(arch, tmp_path, monkeypatch,
                                                              parity_prompts):
    """Where every linear of a decode step goes through raygen's kernels (here q8_0 blocks
    made at load), the loop's layers run in one C++ call (DecodeStack): the same bits as
    the loop's Python, Qwen2's q/k/v biases included; a LoRA step stays in Python."""
    # The tiny preset's down projection (K = 176) is no whole number of blocks: on AVX-512
    # its batched steps take the panels, on AVX2 oneDNN, which the stack does not run. So
    # here a tiny model whose every linear takes blocks, given them for steps of up to 8
    # rows whatever this CPU's start-up timings chose.
    monkeypatch.setitem(demo_model.PRESETS, "tiny",
                        dataclasses.replace(demo_model.PRESETS["tiny"], intermediate_size=192))
    model_dir = str(demo_model.write_demo_model(tmp_path, "tiny", arch))
    llm = LLM(model_dir, num_blocks=256, quantize="q8_0")
    set_quant_rows(llm.runner.model, 8)
    model = llm.runner.model.model
    loop = model.decode_loop
    assert loop.native, "the kernels have DecodeStack and the model runs on one rank"
    stacked: list[int] = []

    def checked(input_ids, positions, kv_caches, meta):
        loop.native = False
        python = loop(input_ids, positions, kv_caches, meta)
        loop.native = True
        out = loop(input_ids, positions, kv_caches, meta)  # writes the same K and V again
        assert torch.equal(out, python)
        if loop._stacks.get(len(input_ids)) is not None:
            stacked.append(len(input_ids))
        return out

    model.decode_loop = checked
    run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    assert 1 in stacked and max(stacked) >= 4  # one row and a batch took the stack
    loop._lora = type("Batch", (), {"runs": [(1, 0, 1)]})()  # a step with an adapter's row
    assert loop._stack(1, llm.runner.kv_caches) is None


def test_chunked_prefill_matches(llama_dir, parity_prompts):
    llm = LLM(llama_dir, num_blocks=256, max_batch_prefill_tokens=48)
    got, _ = run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    assert got == references(llama_dir, parity_prompts, PARITY_NEW_TOKENS)


def test_without_chunking_matches(llama_dir, parity_prompts):
    llm = LLM(llama_dir, num_blocks=256, max_batch_prefill_tokens=256,
              enable_chunked_prefill=False)
    got, _ = run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS, per_step=4)
    assert got == references(llama_dir, parity_prompts, PARITY_NEW_TOKENS)


def test_prefix_cache_hits_match(llama_dir):
    shared = make_prompts(2048, [64], seed=7)[0]
    prompts = make_prompts(2048, [3, 10, 17, 40, 1, 25], seed=8, prefix=shared)
    new_tokens = [12, 20, 8, 16, 10, 5]
    llm = LLM(llama_dir, num_blocks=256)
    bm = llm.engine.scheduler.block_manager
    # The first request fills the cache; the rest arrive later and hit it.
    got, _ = run_staggered(llm, prompts, new_tokens, per_step=1)
    assert bm.prefix_hits >= 64 * (len(prompts) - 1)
    assert got == references(llama_dir, prompts, new_tokens)


def test_kv_pressure_preempts_and_still_matches(llama_dir):
    lengths = [5 + (7 * i) % 50 for i in range(32)]
    new_tokens = [10 + (5 * i) % 30 for i in range(32)]
    prompts = make_prompts(2048, lengths, seed=3)
    llm = LLM(llama_dir, num_blocks=24, block_size=8)  # 192 slots for 32 requests
    got, _ = run_staggered(llm, prompts, new_tokens, per_step=32)
    scheduler = llm.engine.scheduler
    assert scheduler.stats.num_preemptions > 0
    assert got == references(llama_dir, prompts, new_tokens)
    assert scheduler.block_manager.num_used_blocks == 0
    scheduler.check_integrity()


def test_sharded_checkpoint_loads_the_same(llama_dir, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        shutil.copy(f"{llama_dir}/{name}", tmp_path / name)
    weights = load_file(f"{llama_dir}/model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = make_prompts(2048, [20], seed=5)[0]
    params = SamplingParams(max_new_tokens=12)
    assert (LLM(str(tmp_path), num_blocks=32).generate([prompt], params)[0].token_ids
            == LLM(llama_dir, num_blocks=32).generate([prompt], params)[0].token_ids)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches(scaling, llama_dir, tmp_path):
    import json
    import shutil

    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = scaling
    config["rope_theta"] = 500000.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = make_prompts(2048, [90, 7], seed=11)
    outs = LLM(str(tmp_path), num_blocks=64).generate(prompts, SamplingParams(max_new_tokens=10))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(str(tmp_path), prompt, 10)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cpu_matmul", ["onednn", "torch"])
def test_either_cpu_matmul_matches_transformers(cpu_matmul, arch, llama_dir, qwen2_dir,
                                               parity_prompts):
    # oneDNN on reordered weights (the CPU default) and torch's own matmul both give
    # transformers' tokens; with oneDNN every linear runs on its packed weight and the
    # plain copy is freed, except the embedding that qwen2's lm_head shares.
    model_dir = llama_dir if arch == "llama" else qwen2_dir
    llm = LLM(model_dir, num_blocks=256, cpu_matmul=cpu_matmul, device="cpu")
    model = llm.runner.model
    assert llm.runner.weights.matmul == cpu_matmul
    linears = [m for m in model.modules() if hasattr(m, "packed")]
    assert len(linears) == 4 * len(model.model.layers) + 1
    assert all((m.packed is not None) == (cpu_matmul == "onednn") for m in linears)
    tied = arch == "qwen2"
    assert (model.lm_head.weight.numel() > 0) == (tied or cpu_matmul == "torch")
    assert (model.model.layers[0].mlp.down_proj.weight.numel() > 0) == (cpu_matmul == "torch")
    got, _ = run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    assert got == references(model_dir, parity_prompts, PARITY_NEW_TOKENS)


@pytest.fixture
def keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # an in-process runner sized this process's threads


@pytest.fixture
def copy_pays(monkeypatch):
    """Whether the start-up timings find the weight copy faster, decided by the test (on
    the tiny test models either can win): for one-row steps, and (panels only) for steps
    of 2 to `up_to` rows, one of PANEL_TIMINGS' bounds (1: none)."""
    from shards.worker import weight_plan

    def force(one_row: bool, up_to: int = 1) -> list:
        timed = []
        most = {rows: most for rows, most, _ in weight_plan.PANEL_TIMINGS}
        monkeypatch.setattr(weight_plan, "one_row_copy_pays",
                            lambda onednn_s, copy_s: timed.append((onednn_s, copy_s)) or one_row)
        monkeypatch.setattr(weight_plan, "panels_pay",
                            lambda rows, onednn_s, panels_s: timed.append((onednn_s, panels_s))
                            or most[rows] <= up_to)
        return timed

    return force


@pytest.fixture
def kernel():
    from shards.cpu import kernels as cpu_kernels

    return cpu_kernels.load()


@pytest.fixture
def no_lanes(kernel, monkeypatch):
    """The copy made K x N or cut into panels, as on a CPU whose kernels have no rows in
    lanes (no AVX2 with FMA and F16C, or no compiler)."""
    if kernel is not None:
        monkeypatch.setattr(kernel, "quant_lanes_supported", lambda: False)


@pytest.fixture
def no_panels(kernel, monkeypatch, no_lanes):
    """The copy made K x N, as on a CPU without AVX-512 or AVX2, or without a compiler."""
    if kernel is not None:
        monkeypatch.setattr(kernel, "panels_supported", lambda: False)


@pytest.fixture
def lanes_kernel(kernel, monkeypatch):
    """The float32 copy laid out in lanes, as on an AVX2 CPU: kernels built for AVX-512 cut
    it into panels instead (faster there), which are turned off here."""
    if kernel is None or not kernel.quant_lanes_supported():
        pytest.skip("rows in lanes need raygen's CPU kernels built for AVX2 with FMA and F16C")
    monkeypatch.setattr(kernel, "panels_supported", lambda: False)
    return kernel


@pytest.fixture
def panel_kernel(kernel):
    if kernel is None or not kernel.panels_supported():
        pytest.skip("the panel copy needs raygen's CPU kernels built for AVX-512")
    return kernel


def run_counting(llm, prompts, kernel=None) -> tuple[dict, list[int], list[int]]:
    """The prompts' greedy tokens, and the row count of every `torch.mm` the run made (the
    K x N copy's products go through it; oneDNN's do not) and of every panel product."""
    import torch

    mm_calls, panel_calls = [], []
    # The Python loop: DecodeStack calls the same kernels from C++, out of these counters' sight.
    llm.runner.model.model.decode_loop.native = False
    mm = torch.mm
    panels = kernel.linear_panels if kernel is not None else None
    try:
        torch.mm = lambda a, b: mm_calls.append(a.shape[0]) or mm(a, b)
        if kernel is not None:
            kernel.linear_panels = (lambda x, *rest: panel_calls.append(x.shape[0])
                                    or panels(x, *rest))
        got, _ = run_staggered(llm, prompts, PARITY_NEW_TOKENS)
    finally:
        torch.mm = mm
        if kernel is not None:
            kernel.linear_panels = panels
    return got, mm_calls, panel_calls


@pytest.mark.parametrize(("arch", "threads"), [("llama", 1), ("qwen2", 1), ("llama", 2)])
def test_one_row_products_on_the_copy_match_transformers(arch, threads, llama_dir, qwen2_dir,
                                                         parity_prompts, keep_torch_threads,
                                                         copy_pays, no_panels):
    # Where the copy paid at start-up, one-token steps go through MKL on a K x N copy of
    # each weight (the lm head's own, where qwen2 ties it to the embedding), on one thread
    # or two; more rows through oneDNN.
    import torch

    from shards.model.layers import _Matmul

    model_dir = llama_dir if arch == "llama" else qwen2_dir
    timed = copy_pays(True)
    llm = LLM(model_dir, num_blocks=256, cpu_threads=threads, device="cpu")
    linears = [m for m in llm.runner.model.modules() if isinstance(m, _Matmul)]
    assert llm.runner.weights.one_row_weights and torch.get_num_threads() == threads
    assert llm.runner.weights.weight_copy == "K x N" and llm.runner.weights.panel_timings is None
    assert timed == [llm.runner.weights.one_row_timings] and min(timed[0]) > 0
    assert all(m.transposed is not None and m.packed is not None and m.panels is None
               for m in linears)
    got, calls, _ = run_counting(llm, parity_prompts)
    assert calls and set(calls) == {1}  # one-row products took the copy, and only they
    assert got == references(model_dir, parity_prompts, PARITY_NEW_TOKENS)
    explicit = LLM(model_dir, num_blocks=16, cpu_threads=threads, cpu_matmul="onednn",
                   device="cpu")
    assert not explicit.runner.weights.one_row_weights  # onednn: one copy of the weights, untimed
    plan = explicit.runner.weights
    assert plan.one_row_timings is None and plan.weight_copy is None
    assert all(m.transposed is None and m.panels is None
               for m in explicit.runner.model.modules() if isinstance(m, _Matmul))


# The parity prompts, two admitted per step, make steps of 1 to about 350 rows.
@pytest.mark.parametrize(("arch", "threads", "one_row", "up_to"), [
    ("llama", 1, True, 256), ("qwen2", 2, True, 256),  # every step of 1 to PANEL_MAX_ROWS
    ("llama", 2, False, 64),  # 2 to 64 (the 160-row timing failed); one row through oneDNN
    ("llama", 2, True, 1),  # one-row steps only (the 32-row timing failed)
])
def test_panel_products_match_transformers(arch, threads, one_row, up_to, llama_dir,
                                           qwen2_dir, parity_prompts, keep_torch_threads,
                                           copy_pays, panel_kernel):
    """With raygen's kernels built for AVX-512 the copy is cut into panels, and the steps
    whose row counts the timings chose go through them (the rest through oneDNN), with
    the same greedy tokens as transformers. A timing runs only where the one before it
    passed."""
    from shards.cpu.layouts import PANEL_MAX_ROWS
    from shards.model.layers import _Matmul
    from shards.worker.weight_plan import PANEL_TIMINGS

    assert PANEL_TIMINGS[-1][1] == PANEL_MAX_ROWS
    model_dir = llama_dir if arch == "llama" else qwen2_dir
    timed = copy_pays(one_row, up_to)
    llm = LLM(model_dir, num_blocks=256, cpu_threads=threads, device="cpu")
    runner = llm.runner
    rows = (1 if one_row else 2, up_to)
    assert runner.weights.weight_copy == "panels" and runner.weights.panel_rows == rows
    assert list(runner.weights.panel_timings) == ([32] if up_to == 1 else [32, 160])
    assert timed == [runner.weights.one_row_timings, *runner.weights.panel_timings.values()]
    assert min(min(t) for t in timed) > 0
    linears = [m for m in runner.model.modules() if isinstance(m, _Matmul)]
    assert all(m.panels is not None and m.transposed is None and m.panel_rows == rows
               for m in linears)
    got, mm_calls, calls = run_counting(llm, parity_prompts, panel_kernel)
    assert not mm_calls and calls and rows[0] <= min(calls) and max(calls) <= rows[1]
    # Steps above the range that the timing before admits (32 rows, 64) took the panels.
    assert (1 in calls) == one_row and max(calls) > {1: 0, 64: 32, 256: 64}[up_to]
    assert got == references(model_dir, parity_prompts, PARITY_NEW_TOKENS)


def test_a_copy_that_does_not_pay_is_dropped(llama_dir, parity_prompts, keep_torch_threads,
                                             copy_pays, kernel, no_lanes):
    from shards.model.layers import _Matmul

    timed = copy_pays(False)
    llm = LLM(llama_dir, num_blocks=256, device="cpu")
    panels = kernel is not None and kernel.panels_supported()
    assert len(timed) == (2 if panels else 1) and not llm.runner.weights.one_row_weights
    assert llm.runner.weights.weight_copy is None and llm.runner.weights.panel_rows is None
    assert all(m.transposed is None and m.panels is None and m.packed is not None
               for m in llm.runner.model.modules() if isinstance(m, _Matmul))
    got, mm_calls, panel_calls = run_counting(llm, parity_prompts, kernel)
    assert not mm_calls and not panel_calls
    assert got == references(llama_dir, parity_prompts, PARITY_NEW_TOKENS)


def test_the_copy_is_kept_only_where_it_is_timed_faster(llama_dir, keep_torch_threads,
                                                        copy_pays, kernel, no_lanes):
    import math

    from shards.cpu.layouts import time_copy_products
    from shards.worker.model_runner import ModelRunner, ShardConfig
    from shards.worker.weight_plan import one_row_copy_pays, panels_pay

    assert one_row_copy_pays(1.0, 0.9) and not one_row_copy_pays(1.0, 0.91)
    assert panels_pay(32, 1.0, 1.0) and not panels_pay(32, 1.0, 1.01)
    assert panels_pay(160, 1.0, 1.2) and not panels_pay(160, 1.0, 1.21)
    copy_pays(True, 256)
    runner = ModelRunner(ShardConfig(model=llama_dir, num_blocks=16, device="cpu"))
    for rows in (1, 7):
        onednn_s, copy_s = time_copy_products(runner.model, rows, rounds=2)
        assert 0 < onednn_s < math.inf and 0 < copy_s < math.inf


def test_no_one_row_copy_where_it_would_not_leave_half_the_memory(llama_dir, monkeypatch,
                                                                  keep_torch_threads,
                                                                  copy_pays, no_lanes):
    """The copy and the KV cache to come must fit in half of MemAvailable: the cache that
    `num_blocks` fixes where set, else the `kv_cache_memory` budget. Runners are built
    without their KV cache here; one with a single copy still serves. (Each copy made
    here is timed as paying.)"""
    from shards.worker import weight_plan
    from shards.worker.model_runner import ModelRunner, ShardConfig
    from shards.worker.weight_plan import available_memory, one_row_copy_fits

    copy_pays(True)
    assert one_row_copy_fits(10, 40, 100) and not one_row_copy_fits(11, 40, 100)
    # MemAvailable read once: it moves between reads (a Ray test before this one may still
    # be freeing memory), and these bounds are one byte either side of its half.
    available = available_memory()
    monkeypatch.setattr(weight_plan, "available_memory", lambda: available)
    half = available // 2

    def one_row(**cache) -> bool:
        config = ShardConfig(model=llama_dir, cpu_threads=1, device="cpu", **cache)
        return ModelRunner(config).weights.one_row_weights

    block = ModelRunner(ShardConfig(model=llama_dir, device="cpu")).block_bytes()
    assert not one_row(kv_cache_memory=half + 1)  # the budget alone passes half
    assert not one_row(num_blocks=half // block + 1)
    assert one_row(num_blocks=16, kv_cache_memory=half + 1)  # num_blocks fixes a small cache
    assert one_row(kv_cache_memory=1 << 20)
    # Where memory is short, one thread runs one-token steps on the one reordered copy.
    monkeypatch.setattr(weight_plan, "available_memory", lambda: 1 << 20)
    llm = LLM(llama_dir, num_blocks=16, cpu_threads=1, device="cpu")
    assert not llm.runner.weights.one_row_weights
    prompt = make_prompts(2048, [9], seed=5)[0]
    got = llm.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    assert got == hf_greedy(llama_dir, prompt, 4)


# Steps of 1 to about 350 rows, as above; the lanes serve those of up to `up_to`.
@pytest.mark.parametrize(("arch", "threads", "up_to"), [
    ("llama", 1, 32), ("qwen2", 2, 32),  # qwen2: the projections' biases in the kernel
    ("llama", 2, 4),  # the 8-row timing lost: 5 rows and more through oneDNN
])
def test_float32_rows_in_lanes_match_transformers(arch, threads, up_to, llama_dir, qwen2_dir,
                                                  parity_prompts, keep_torch_threads,
                                                  monkeypatch, tmp_path, lanes_kernel):
    """On AVX2 CPUs the float32 copy is laid out with 8 output rows to a vector and timed
    per kind of linear as a GGUF file's blocks are; the steps it wins take it, with the
    same greedy tokens as transformers. A weight whose K is no whole blocks of 32 (the tiny
    model's down projection, K = 176) keeps oneDNN alone."""
    from shards.cpu import timings as startup_timings
    from shards.cpu.layouts import F32_LANES_TYPE
    from shards.model.layers import _Matmul
    from shards.worker import weight_plan

    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)  # none kept before
    monkeypatch.setattr(weight_plan, "time_quant_products",  # (oneDNN, lanes) seconds
                        lambda linears, rows, rounds=3: (1.0, 0.5 if rows <= up_to else 1.5))
    model_dir = llama_dir if arch == "llama" else qwen2_dir
    llm = LLM(model_dir, num_blocks=256, cpu_threads=threads, device="cpu")
    weights = llm.runner.weights
    assert (weights.weight_copy, weights.one_row_weights) == ("rows in lanes", True)
    assert weights.one_row_timings is None and set(weights.lane_rows_by_kind.values()) == {up_to}
    # Not a GGUF file's blocks: /info's quant_blocks stays empty, its weight copy names them.
    assert (weights.quant_types, weights.quant_rows, weights.quant_blocks()) == ({}, 0, None)
    assert llm.runner.compute_path()["weight_copy"] == "rows in lanes"
    linears = {name: m for name, m in llm.runner.model.named_modules() if isinstance(m, _Matmul)}
    for name, m in linears.items():
        lanes = m.weight_shape[1] % 32 == 0
        assert (m.quant_type == F32_LANES_TYPE and m.quant_lanes) == lanes, name
        assert m.quant_rows == (up_to if lanes else 0) and m.transposed is None, name
    assert len(weights.lane_rows_by_kind) == len({m.weight_shape for m in linears.values()
                                                  if m.quant is not None})
    assert not any(name.endswith("down_proj") for name, m in linears.items() if m.quant_lanes)
    calls = []
    llm.runner.model.model.decode_loop.native = False  # counted in Python, not in DecodeStack
    product = lanes_kernel.linear_quant_lanes
    monkeypatch.setattr(lanes_kernel, "linear_quant_lanes",
                        lambda x, *rest: calls.append(x.shape[0]) or product(x, *rest))
    got, _ = run_staggered(llm, parity_prompts, PARITY_NEW_TOKENS)
    # Steps of one row and of more took them, up to the timed bound (16 rows: above 12).
    assert calls and min(calls) == 1 and {4: 1, 32: 12}[up_to] < max(calls) <= up_to
    assert got == references(model_dir, parity_prompts, PARITY_NEW_TOKENS)


def test_float32_rows_in_lanes_that_lose_are_freed(llama_dir, keep_torch_threads, monkeypatch,
                                                   tmp_path, lanes_kernel):
    """Where oneDNN wins every kind's one-row timing the lanes are freed and no copy is
    named; where memory is short they are never made."""
    from shards.cpu import timings as startup_timings
    from shards.model.layers import _Matmul
    from shards.worker import weight_plan

    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)
    monkeypatch.setattr(weight_plan, "time_quant_products",
                        lambda linears, rows, rounds=3: (1.0, 1.5))
    for memory in (None, 1 << 20):
        if memory is not None:
            monkeypatch.setattr(weight_plan, "available_memory", lambda m=memory: m)
        weights = LLM(llama_dir, num_blocks=16, cpu_threads=1, device="cpu").runner.weights
        assert (weights.weight_copy, weights.one_row_weights) == (None, False)
        assert (weights.quant_types, weights.quant_rows, weights.quant_blocks()) == ({}, 0, None)
        assert weights.lane_rows_by_kind == {}
        assert all(m.quant is None and m.transposed is None
                   for m in weights.model.modules() if isinstance(m, _Matmul))
        assert bool(weights.quant_timings) == (memory is None)  # timed, or never made


def test_cpu_matmul_refuses_what_it_cannot_do(llama_dir):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        LLM(llama_dir, num_blocks=16, cpu_matmul="onednn", dtype="float16", device="cpu")
