"""GGUF quantized weights multiplied as the file holds them (shards/cpu/csrc/quant_linear.cpp):
the product equals the dequantized weights' product up to float32 summation order, for
every type and row count, and a real Q4_1 file serves its one-row steps from its blocks."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE, KERNEL_TYPES
from shards.cpu import kernels as cpu_kernels
from shards.cpu.layouts import F32_LANES_TYPE

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.quant_supported(),
                                reason="raygen's CPU kernels are not built with AVX-512")


# Every tile's row counts (quant.h: with_tile): 1-2 rows of x, 3-4, and 5-8 (9 as 5 + 4, 20
# as 7 + 7 + 6).
@pytest.mark.parametrize("kind", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 20])
def test_products_equal_the_dequantized_weights(kind, rows):
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(rows)
    n, k = 40, 96  # output rows that are no multiple of a task's 16; three blocks a row
    weight = rng.standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k))
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    got = kernels.linear_quant(x, torch.from_numpy(blocks), KERNEL_TYPES[kind], n, bias)
    want = (x.double() @ dequantized.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, x @ weight.T)  # the quantization is in it, not the floats


lanes = pytest.mark.skipif(kernels is None or not kernels.quant_lanes_supported(),
                           reason="rows in lanes: kernels built for AVX2 with FMA and F16C")


@lanes
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "threads"), [(40, 1), (200, 2)])  # 3 tasks; 13 tasks, 2 ranges
# Each count of accumulators per row (2 rows: 4; 3-5 rows: 2; 7-8: 1; on AVX-512 builds
# 2-7 rows take x . q per block), and tiles of them (20 = 7 + 7 + 6; 57 = 7 x 8 + 1, a last
# tile of one row).
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 20, 57])
def test_products_in_lanes_equal_the_dequantized_weights(kind, n, threads, rows):
    """Products on the blocks laid out again with 8 output rows to a vector
    (shards/cpu/csrc/quant_lanes.cpp), on one thread and on two that claim ranges."""
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(n)
    k = 96
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k))
    packed = kernels.pack_quant_lanes(torch.from_numpy(blocks), KERNEL_TYPES[kind], k)
    assert packed.numel() == blocks.size  # the same bytes, in another order
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.linear_quant_lanes(x, packed, KERNEL_TYPES[kind], n, bias)
        # Each weight where the file has it: x = e_j reads column j of the weights.
        eye = torch.eye(k)
        columns = torch.cat([kernels.linear_quant_lanes(eye[j:j + rows], packed,
                                                        KERNEL_TYPES[kind], n, None).T
                             for j in range(0, k, rows)], dim=1)[:, :k]
    finally:
        torch.set_num_threads(saved)
    want = (x.double() @ dequantized.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(columns, dequantized, rtol=1e-6, atol=1e-6)


@lanes
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "threads"), [(48, 1), (96, 2)])  # a last task of one tile; 3
# Tiles of x of 5, 8, 16 and 10 + 10 rows; 65 rows in two chunks, 33 (11 + 11 + 11) and 32.
@pytest.mark.parametrize("rows", [5, 8, 16, 20, 65])
def test_many_row_block_products_are_exact_float32_sums(kind, n, threads, rows):
    """Steps of 5+ rows (on AMX tiles where the CPU has them, shards/cpu/csrc/quant_amx.cpp:
    x cut into three bfloat16 parts whose sum is x) as close to the dequantized weights'
    float64 product as float32 sums are; x holds an outlier, as SmolLM2's activations do,
    which x rounded to bfloat16 alone would carry into every output."""
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(rows)
    k = 160  # five blocks
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k)).double()
    packed = kernels.pack_quant_lanes(torch.from_numpy(blocks), KERNEL_TYPES[kind], k)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    x[rows // 2, 7] = 300.0
    x[:, 40] += 1e-3 * torch.arange(rows)  # parts below bfloat16's precision matter
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.linear_quant_lanes(x, packed, KERNEL_TYPES[kind], n, bias)
    finally:
        torch.set_num_threads(saved)
    want = x.double() @ dequantized.T + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=2e-4)
    rounded = x.bfloat16().double() @ dequantized.T + bias.double()
    assert (rounded - want).abs().max() > 100 * (got.double() - want).abs().max()


@lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "threads"), [(40, 1), (200, 2)])
# 2 rows: float32 x for bfloat16 weights; 5 and more: rounded to bfloat16 where the CPU
# has vdpbf16ps. 9 = 5 + 4 rows of x, 57 = 7 x 8 + 1 (a last tile of one row); 40 and 200
# output rows end in a task of one group of 8.
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 57])
def test_float_weights_in_lanes_equal_their_product(dtype, n, threads, rows):
    """float32 and bfloat16 weights laid out with 8 output rows to a vector (the copy that
    AVX2 CPUs' small float32 steps take, and the bfloat16 weights' one): the weights' own
    product up to summation order, every weight where the matrix has it. bfloat16 steps of
    `bf16_dot_min_rows` rows and more multiply x rounded to bfloat16, as oneDNN does."""
    kind = F32_LANES_TYPE if dtype == torch.float32 else BF16_KERNEL_TYPE
    generator = torch.Generator().manual_seed(n + rows)
    k = 96
    weight = torch.randn(n, k, generator=generator).to(dtype)
    packed = kernels.pack_quant_lanes(weight.view(torch.uint8), kind, k)
    assert packed.numel() == weight.numel() * weight.element_size()
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.linear_quant_lanes(x, packed, kind, n, bias)
        eye = torch.eye(k)
        columns = torch.cat([kernels.linear_quant_lanes(eye[j:j + rows], packed, kind, n, None).T
                             for j in range(0, k, rows)], dim=1)[:, :k]
    finally:
        torch.set_num_threads(saved)
    dot_rows = kernels.bf16_dot_min_rows()
    rounded = dtype == torch.bfloat16 and 0 < dot_rows <= rows
    xs = x.to(torch.bfloat16).float() if rounded else x
    want = (xs.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(columns, weight.float())


@lanes
def test_rows_in_lanes_refuse_what_they_cannot_lay_out():
    blocks = torch.from_numpy(gguf.quants.quantize(np.ones((12, 64), np.float32),
                                                   gguf.GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="12 rows are not whole groups of 8"):
        kernels.pack_quant_lanes(blocks, KERNEL_TYPES["Q4_1"], 64)
    with pytest.raises(RuntimeError, match="BF16 \\(3\\) and F32 \\(4\\) only, not type 5"):
        kernels.pack_quant_lanes(torch.zeros(8, 128, dtype=torch.uint8), 5, 64)
    with pytest.raises(RuntimeError, match="is not rows of 2 blocks"):  # 64 floats are 256 bytes
        kernels.pack_quant_lanes(torch.zeros(8, 128, dtype=torch.uint8), 4, 64)
    packed = kernels.pack_quant_lanes(blocks[:8].contiguous(), KERNEL_TYPES["Q4_1"], 64)
    with pytest.raises(RuntimeError, match="2-d float32 x"):
        kernels.linear_quant_lanes(torch.zeros(64), packed, KERNEL_TYPES["Q4_1"], 8, None)
    with pytest.raises(RuntimeError, match="are not 8 rows of 3 blocks"):
        kernels.linear_quant_lanes(torch.zeros(1, 96), packed, KERNEL_TYPES["Q4_1"], 8, None)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernel sees it: each block of 32 rounded to 255 levels of its max."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).view_as(x)


@pytest.mark.skipif(kernels is None or not kernels.quant_i8_supported(),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 20])
@pytest.mark.parametrize("k", [96, 128])  # an odd block count (3) and an even one (4)
def test_int8_products_equal_int8_rows_times_the_dequantized_weights(kind, rows, k):
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(rows + k)
    n = 40
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k))
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    got = kernels.linear_quant_i8(x, torch.from_numpy(blocks), KERNEL_TYPES[kind], n, bias)
    want = (int8_rows(x).double() @ dequantized.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    exact = (x.double() @ dequantized.double().T + bias.double()).float()
    error = (got - exact).abs().max().item()
    assert 0 < error < 0.02 * exact.abs().max().item()  # x's rounding, and only that
    with pytest.raises(RuntimeError, match="takes Q4_0, Q4_1 or Q8_0"):
        kernels.linear_quant_i8(x, torch.from_numpy(blocks), 3, n, None)


@pytest.mark.parametrize("rows", [1, 2, 4, 9])
def test_bfloat16_weights_times_float32_rows_equal_the_widened_weights(rows):
    from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 64, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=generator)
    got = kernels.linear_quant(x, weight.view(torch.uint8), BF16_KERNEL_TYPE, 37, None)
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_blocks_are_refused_with_the_shapes():
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="is not 8 rows of 2 blocks"):
        kernels.linear_quant(x, torch.zeros(8, 30, dtype=torch.uint8), KERNEL_TYPES["Q4_1"], 8,
                             None)
    with pytest.raises(RuntimeError, match="not whole blocks"):
        kernels.linear_quant(torch.zeros(1, 40), torch.zeros(8, 40, dtype=torch.uint8), 1, 8,
                             None)


TEXT = ("Ray Serve runs a text-generation server as deployments: an ingress validates each "
        "request and a batcher runs the continuous-batching loop over a paged KV cache, "
        "while shard actors hold the weights. A GGUF file holds those weights in blocks of "
        "thirty-two, each with its own scale, so a decode step that reads every weight once "
        "reads a fifth of the bytes that float32 weights take. The server streams tokens "
        "over HTTP, and the Ray dashboard shows every actor and its metrics. ") * 3


def _score(llm, quant_rows: int) -> list[float]:
    """TEXT's first 256 tokens' prompt logprobs in steps of 4 tokens (chunked prefill), the
    steps of up to `quant_rows` rows through the file's blocks (0: the float32 weights)."""
    from engine.sampling_params import SamplingParams
    from shards.cpu.layouts import set_quant_rows

    set_quant_rows(llm.runner.model, quant_rows)
    ids = llm.tokenizer(TEXT).input_ids[:256]
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    return llm.generate([ids], params)[0].prompt_logprobs[1:]


@pytest.fixture(scope="module")
def q4_1_float32():
    """SmolLM2's Q4_1 file with float32 products, and its scores through the float32
    weights: the reference of both kinds of products."""
    from deployments.offline import LLM
    from tests.reference import smollm2_gguf

    llm = LLM(str(smollm2_gguf()), num_blocks=64, max_batch_prefill_tokens=4,
              quant_products="float32")
    return llm, _score(llm, 0)


# Teacher-forced on TEXT, blocks against the dequantized float32 weights, on SmolLM2's Q4_1
# file (benchmarks/NOTES.md 56, 58): x in float32, mean |difference| 7.5e-6 and max 5.9e-5;
# x rounded to int8 blocks (llama.cpp's arithmetic), mean 0.044 and max 0.44.
@pytest.mark.parametrize(("products", "mean_bound", "max_bound"),
                         [("float32", 1e-4, 1e-3), ("int8", 0.1, 1.0)])
def test_a_real_q4_1_file_scores_real_text_as_its_dequantized_weights_do(products, mean_bound,
                                                                         max_bound,
                                                                         q4_1_float32):
    """Prompt logprobs of a fixed text through the file's blocks and through the float32
    weights (the same in both: the blocks alone take x in int8)."""
    from deployments.offline import LLM
    from tests.reference import smollm2_gguf

    if products == "int8" and not kernels.quant_i8_supported():
        pytest.skip("no AVX-512 VNNI on this CPU")
    llm, reference = q4_1_float32
    if products != "float32":
        llm = LLM(str(smollm2_gguf()), num_blocks=64, max_batch_prefill_tokens=4,
                  quant_products=products)
    assert llm.runner.weights.quant_int8 == (products == "int8")
    scored = _score(llm, 4)
    diffs = [abs(a - b) for a, b in zip(reference, scored, strict=True)]
    assert len(diffs) == 255 and reference != scored  # the blocks ran
    mean = sum(diffs) / len(diffs)
    assert mean < mean_bound and max(diffs) < max_bound, (mean, max(diffs))


def test_a_real_q4_1_file_scores_real_text_in_steps_of_16_as_its_dequantized_weights_do():
    """The same in steps of 16 tokens, whose products (the LM head's too) run on AMX tiles
    where the CPU has them (x cut into three exact bfloat16 parts): on an AMX Xeon mean
    |difference| 4.0e-6 and max 3.1e-5, against 4.2e-6 and 2.8e-5 in steps of 4 through the
    vector tiles (NOTES.md 114)."""
    from deployments.offline import LLM
    from tests.reference import smollm2_gguf

    llm = LLM(str(smollm2_gguf()), num_blocks=64, max_batch_prefill_tokens=16)
    assert llm.runner.weights.quant_rows >= 16 or not kernels.amx_usable()
    reference, scored = _score(llm, 0), _score(llm, 16)
    diffs = [abs(a - b) for a, b in zip(reference, scored, strict=True)]
    assert len(diffs) == 255 and reference != scored  # the blocks ran
    assert sum(diffs) / len(diffs) < 1e-4 and max(diffs) < 1e-3, (sum(diffs) / len(diffs),
                                                                   max(diffs))


# kv_cache_dtype=float16 against float32 KV, teacher-forced on TEXT's first 160 tokens
# (benchmarks/NOTES.md 72): in steps of 4 (prefill chunks, attending to the cache through
# the torch path) mean |difference| 6.0e-4 and max 4.4e-3; in steps of one token (decodes,
# through the CPU kernel, which test_attention_backends checks against the torch path on
# the same float16 cache) 7.5e-4 and 4.7e-3.
def test_a_float16_kv_cache_scores_real_text_near_a_float32_one():
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams
    from tests.reference import smollm2_gguf

    scored = {}
    for kv in ("auto", "float16"):
        llm = LLM(str(smollm2_gguf()), num_blocks=16, max_batch_prefill_tokens=4,
                  kv_cache_dtype=kv)
        assert llm.runner.kv_caches[0][0].dtype == getattr(torch, kv.replace("auto", "float32"))
        assert llm.runner.compute_path()["kv_cache_dtype"] == kv.replace("auto", "float32")
        ids = llm.tokenizer(TEXT).input_ids[:96]
        params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
        scored[kv] = llm.generate([ids], params)[0].prompt_logprobs[1:]
    diffs = [abs(a - b) for a, b in zip(scored["auto"], scored["float16"], strict=True)]
    assert len(diffs) == 95 and scored["auto"] != scored["float16"]  # the rounding shows
    mean = sum(diffs) / len(diffs)
    assert mean < 3e-3 and max(diffs) < 2e-2, (mean, max(diffs))


def test_a_float_checkpoint_quantized_at_load_scores_near_its_float_weights(llama_dir):
    """`quantize=q8_0`: every linear of a safetensors checkpoint in Q8_0 blocks (the gguf
    package's quantizer), multiplied by the block kernel; teacher-forced logprobs of a
    random prompt near the float weights'. Measured: demo-small mean 0.016, max 0.066;
    SmolLM2 as float32 safetensors mean 0.027, max 0.19, and 25.2 -> 14.5 ms a token
    in-process (benchmarks/NOTES.md 59)."""
    from deployments.config import AppArgs
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams
    from shards.cpu.layouts import set_quant_rows
    from tests.reference import make_prompts

    scored = {}
    for quantize in (None, "q8_0"):
        llm = LLM(llama_dir, num_blocks=64, max_batch_prefill_tokens=4, quantize=quantize)
        if quantize:
            blocks = llm.runner.compute_path()["quant_blocks"]
            assert set(blocks["types"]) == {"Q8_0"} and blocks["types"]["Q8_0"] >= 3
            set_quant_rows(llm.runner.model, 4)  # whatever the timings chose
        ids = make_prompts(llm.runner.model_config.vocab_size, [120], seed=9)[0]
        scored[quantize] = llm.generate([ids], SamplingParams(
            max_new_tokens=1, prompt_logprobs=True))[0].prompt_logprobs[1:]
    diffs = [abs(a - b) for a, b in zip(scored[None], scored["q8_0"], strict=True)]
    assert scored[None] != scored["q8_0"]  # the blocks ran
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.3, (sum(diffs) / len(diffs),
                                                                  max(diffs))
    for bad, message in (({"dtype": "bfloat16"}, "runs on CPU in float32"),
                         ({"device": "cuda"}, "runs on CPU in float32"),
                         ({"model": "x.gguf"}, "is a GGUF file")):
        with pytest.raises(ValueError, match=message):
            AppArgs(**{"model": llama_dir, "quantize": "q8_0", **bad})


def test_each_kind_of_linear_keeps_its_blocks_up_to_its_own_timed_rows(llama_dir, monkeypatch,
                                                                       tmp_path):
    """The start-up timing runs per kind of linear (weight shape and block type): each keeps
    its blocks for the steps of up to the most rows where they were at least as fast as the
    float path, and `quant_rows` (every linear's) is the least of those. Here the timings
    are set: blocks lose from 12 rows on for the attention's output projection (the one
    square weight), from 4 for the rest."""
    from deployments.offline import LLM
    from shards.cpu import timings as startup_timings
    from shards.model.layers import _Matmul
    from shards.worker import weight_plan

    def timed(linears, rows, rounds=3):
        n, k = linears[0].weight_shape
        return 1.0, (1.5 if rows >= (12 if n == k else 4) else 1.0)  # (float path, blocks)

    monkeypatch.setattr(weight_plan, "time_quant_products", timed)
    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)  # none kept before
    runner = LLM(llama_dir, num_blocks=64, quantize="q8_0").runner
    by_kind = runner.compute_path()["quant_blocks"]["steps_up_to_rows_by_linear"]
    assert len(by_kind) >= 3 and all(kind.endswith(" Q8_0") for kind in by_kind)
    assert sorted(set(by_kind.values())) == [1, 8] and runner.weights.quant_rows == 1
    for name, m in runner.model.named_modules():
        if isinstance(m, _Matmul) and m.quant is not None:
            assert m.quant_rows == (8 if name.endswith("o_proj") else 1), name
            assert by_kind[f"{m.weight_shape[0]}x{m.weight_shape[1]} Q8_0"] == m.quant_rows


def test_a_one_request_step_with_four_drafts_takes_the_blocks_where_they_win_at_6_rows(
        monkeypatch, tmp_path):
    """A request with `speculate=4` checks its drafts in steps of 5 rows; start-up times the
    blocks at 6 rows, so where they win there (SmolLM2's Q8_0 LM head on a Zen 4 EPYC: 0.63x
    the float path at 6 rows, 1.03x at 8; benchmarks/NOTES.md 99) those steps take them.
    Here the timings are set: blocks win up to 6 rows and lose from 8, for every linear."""
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams
    from shards.cpu import timings as startup_timings
    from shards.model.layers import _Matmul
    from shards.worker import weight_plan
    from tests.reference import smollm2_gguf

    monkeypatch.setattr(weight_plan, "time_quant_products",  # (float path, blocks)
                        lambda linears, rows, rounds=3: (1.0, 0.5 if rows <= 6 else 1.5))
    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)  # none kept before
    llm = LLM(str(smollm2_gguf()), num_blocks=64, speculate=4)
    assert set(llm.runner.weights.quant_rows_by_kind.values()) == {6}
    rows = []
    product = _Matmul.quant_product
    monkeypatch.setattr(_Matmul, "quant_product",
                        lambda self, x, *rest: rows.append(x.shape[0]) or product(self, x, *rest))
    text = "one two three four five six seven eight nine ten"
    prompt = f"Repeat this text exactly.\n\nText: {text}\n\nRepeated text: {text}\n\n" \
             "Repeated text:"
    params = SamplingParams(max_new_tokens=24)
    drafted = llm.generate([prompt], params)[0].token_ids
    stats = llm.engine.scheduler.stats
    assert stats.num_accepted_tokens >= 4 and 5 in rows  # drafts kept, in 5-row steps
    llm.engine.scheduler.config = dataclasses.replace(llm.engine.scheduler.config, speculate=0)
    assert llm.generate([prompt], params)[0].token_ids == drafted


@pytest.mark.parametrize("square_blocks_lose", [True, False])
def test_a_weight_copy_that_the_blocks_leave_no_step_is_freed(llama_dir, monkeypatch, tmp_path,
                                                              square_blocks_lose):
    """The one-row weight copy (K x N) is timed before the blocks are; where the blocks then
    serve one-row steps, they come first and the copy would sit unused: it is freed, and
    /info no longer names a copy once none is left. Here the timings are set: the copy
    beats oneDNN at one row; the blocks win every row count, or all but the attention's
    output projection's (the one square weight), which then keeps its copy. The copy is
    K x N on every CPU here (kernels built for AVX-512 would cut it into panels, which
    serve steps of up to 256 rows: the blocks never leave those none)."""
    from deployments.offline import LLM
    from shards.cpu import timings as startup_timings
    from shards.model.layers import _Matmul
    from shards.worker import weight_plan

    def quant_timed(linears, rows, rounds=3):
        n, k = linears[0].weight_shape
        return 1.0, (1.5 if square_blocks_lose and n == k else 0.5)  # (float path, blocks)

    monkeypatch.setattr(startup_timings, "directory", lambda: tmp_path)  # none kept before
    monkeypatch.setattr(kernels, "panels_supported", lambda: False)
    monkeypatch.setattr(kernels, "quant_lanes_supported", lambda: False)
    monkeypatch.setattr(weight_plan, "time_copy_products",
                        lambda model, rows, rounds=3: (2.0, 1.0))  # (oneDNN, the copy)
    monkeypatch.setattr(weight_plan, "time_quant_products", quant_timed)
    weights = LLM(llama_dir, num_blocks=64, quantize="q8_0").runner.weights
    linears = [m for m in weights.model.modules() if isinstance(m, _Matmul)]
    with_blocks = [m for m in linears if m.quant is not None]
    assert len(with_blocks) >= 3 and weights.one_row_timings == (2.0, 1.0)
    for m in with_blocks:
        assert m.quant_rows == (0 if square_blocks_lose and m.weight_shape[0] ==
                                m.weight_shape[1] else weights.quant_rows_by_kind[
                                    f"{m.weight_shape[0]}x{m.weight_shape[1]} Q8_0"])
        assert (m.transposed is None) == (m.quant_rows >= 1)
    kept = any(m.transposed is not None for m in linears)
    assert kept == any(m.quant is None or m.quant_rows == 0 for m in linears)
    assert kept or not square_blocks_lose
    assert (weights.weight_copy, weights.one_row_weights) == (("K x N", True) if kept
                                                              else (None, False))
