"""Attention backends agree. The flash backend needs CUDA and a flash kernel; the torch
backend is checked on CPU against dense attention computed from scratch, and raygen's CPU
decode kernel against the torch backend."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shards.model.attention import (
    AttentionMetadata,
    CpuPagedAttentionBackend,
    PrefillSeq,
    TorchAttentionBackend,
    select_backend,
    write_kv,
)
from shards.worker.batch import metadata


def dense_reference(q, k, v, scale):
    """Causal attention over a whole sequence, GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_torch_backend_mixed_batch_matches_dense():
    check_mixed_batch(TorchAttentionBackend())


def check_mixed_batch(backend, via_runner_metadata: bool = False):
    """The batch's attention equals dense attention per sequence. With
    `via_runner_metadata`, its metadata is the runner's (shards/worker/batch.py), which may
    give the backend prefill chunks as decode rows."""
    torch.manual_seed(0)
    H, KVH, D, BS, NB = 4, 2, 16, 4, 32
    k_cache, v_cache = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
    # Sequence A: 10 tokens, the last one a decode; B: 13 tokens, a chunk of 6 after a
    # cached prefix of 7; C: 5 tokens, a fresh prefill. Blocks deliberately scattered.
    lens = {"A": 10, "B": 13, "C": 5}
    blocks = {"A": [5, 1, 9], "B": [2, 7, 30, 11], "C": [20, 3]}
    full = {s: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))
            for s, n in lens.items()}

    def slots(s, positions):
        return [blocks[s][p // BS] * BS + p % BS for p in positions]

    # Earlier steps wrote the prefixes into the cache.
    for s, computed in (("A", 9), ("B", 7)):
        idx = torch.tensor(slots(s, range(computed)))
        k_cache.view(-1, KVH, D)[idx] = full[s][1][:computed]
        v_cache.view(-1, KVH, D)[idx] = full[s][2][:computed]
    parts = [("A", 9, 10), ("B", 7, 13), ("C", 0, 5)]  # decode first, as the runner orders
    q = torch.cat([full[s][0][a:b] for s, a, b in parts])
    k = torch.cat([full[s][1][a:b] for s, a, b in parts])
    v = torch.cat([full[s][2][a:b] for s, a, b in parts])
    slot_mapping = [x for s, a, b in parts for x in slots(s, range(a, b))]
    if via_runner_metadata:
        meta = metadata(backend, torch.device("cpu"), [(10, blocks["A"])],
                        [(1, 7, 7, blocks["B"]), (7, 12, 0, blocks["C"])], 12, slot_mapping)
    else:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            num_decodes=1,
            decode_block_tables=torch.tensor([blocks["A"]]),
            decode_seq_lens=torch.tensor([10]),
            prefills=[PrefillSeq(1, 7, 7, torch.tensor(blocks["B"])),
                      PrefillSeq(7, 12, 0, torch.tensor(blocks["C"]))],
        )
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    row = 0
    for s, a, b in parts:
        ref = dense_reference(*full[s], D**-0.5)[a:b]
        assert torch.allclose(out[row : row + b - a], ref, atol=1e-5), s
        row += b - a


@pytest.mark.gpu
def test_flash_backend_matches_torch_backend_on_cuda(llama_dir):
    from shards.model.attention import _import_flash

    try:
        _import_flash()
    except ImportError as exc:
        pytest.skip(str(exc))
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams
    from tests.reference import make_prompts

    prompts = make_prompts(2048, [3, 40, 120, 17], seed=41)
    params = SamplingParams(max_new_tokens=16, top_n_tokens=1)
    outs = {}
    for backend in ("torch", "flash"):
        llm = LLM(llama_dir, device="cuda", dtype="float16", attention_backend=backend,
                  num_blocks=128, max_batch_prefill_tokens=64)
        assert llm.runner.backend.name == backend
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["flash"], strict=True):
        agree = sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
        assert agree >= len(a.token_ids) - 2  # fp16 near-ties may flip late tokens
        distance = F.pairwise_distance(torch.tensor(a.logprobs[:4]), torch.tensor(b.logprobs[:4]))
        assert distance < 0.05


# -- raygen's CPU decode kernel (shards/cpu/csrc/paged_attention.cpp) -----------------------
@pytest.fixture(scope="module")
def cpu_kernel():
    from shards.cpu import kernels as cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a compiler is here but the kernel did not build: "
                        f"{cpu_kernels.load_error()}")
        pytest.skip(f"no C++ compiler: {cpu_kernels.load_error()}")
    return kernel


def _scattered_decode_batch(lens, num_heads, num_kv_heads, head_dim, block_size, index_dtype,
                            seed=0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 7
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(needed), dtype=index_dtype)  # padded with block 0
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = order[used : used + n]
        used += n
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
                             decode_block_tables=tables,
                             decode_seq_lens=torch.tensor(lens, dtype=index_dtype), prefills=[])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,index_dtype", [
    (12, 4, 64, torch.long),  # demo-small, tables as the runner makes them
    (8, 8, 128, torch.int32),  # no GQA, the other specialised head size
    (6, 2, 40, torch.long),  # a head size read at run time
])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])  # kv_cache_dtype
def test_cpu_kernel_decode_equals_the_torch_path(cpu_kernel, num_heads, num_kv_heads, head_dim,
                                                 index_dtype, cache_dtype):
    # Lengths: one token, exact multiples of the block, one past, staggered ones (every row
    # but the longest is padded on the torch path), and the longest prompt the default
    # limits allow (2047) plus its first sampled token. A float16 cache: both paths widen
    # the same stored values to float32.
    lens = [1, 16, 17, 31, 160, 283, 2, 64, 95, 2048]
    q, k_cache, v_cache, meta = _scattered_decode_batch(lens, num_heads, num_kv_heads, head_dim,
                                                        16, index_dtype)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    ref = TorchAttentionBackend._decode(q, k_cache, v_cache, meta, scale, num_heads)
    out = cpu_kernel.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_seq_lens, scale)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_rows_of_one_request_give_the_bits_they_give_alone(cpu_kernel, threads):
    """A request's row and its drafts (the same block table, one more token each) run as one
    task per kv head; each row's output is the same bits as that row decoded alone, as
    speculation's exactness needs, and a run cut short (a table that differs, a length that
    does not follow) is still right."""
    q, k_cache, v_cache, meta = _scattered_decode_batch([37, 33, 60, 100], 9, 3, 64, 16,
                                                        torch.long)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    # Rows: request 0 with 4 drafts, request 1 alone, request 2 with 1 draft, then request
    # 3's row twice at the same length (not a run: a draft is one token further).
    pick = [0, 0, 0, 0, 0, 1, 2, 2, 3, 3]
    extra = [0, 1, 2, 3, 4, 0, 0, 1, 0, 0]
    rows_tables = tables[pick]
    rows_lens = lens[pick] - 5 + torch.tensor(extra)
    rows_q = torch.randn(len(pick), 9, 64, generator=torch.Generator().manual_seed(1))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu_kernel.paged_decode(rows_q, k_cache, v_cache, rows_tables, rows_lens,
                                           0.125)
        alone = torch.cat([cpu_kernel.paged_decode(rows_q[i:i + 1], k_cache, v_cache,
                                                   rows_tables[i:i + 1], rows_lens[i:i + 1],
                                                   0.125) for i in range(len(pick))])
        # One request with its drafts alone in the step: its run is cut in two (3 kv heads
        # would leave a thread one task).
        one_request = cpu_kernel.paged_decode(rows_q[:5], k_cache, v_cache, rows_tables[:5],
                                              rows_lens[:5], 0.125)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(together, alone)
    assert torch.equal(one_request, alone[:5])
    rows_meta = dataclasses.replace(meta, decode_block_tables=rows_tables,
                                    decode_seq_lens=rows_lens, num_decodes=len(pick))
    ref = TorchAttentionBackend._decode(rows_q, k_cache, v_cache, rows_meta, 0.125, 9)
    assert torch.allclose(together, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_cpu_kernel_prompt_chunks_as_rows_equal_the_torch_path(cpu_kernel, threads, num_heads,
                                                               num_kv_heads):
    """Prompt chunks given as decode rows (one a token, each one further): runs of 32 rows
    and more go by tiles of queries against the run's keys copied once; they equal the
    torch path, beside shorter runs and plain decode rows, with and without cached tokens
    before the chunk, and with tiles of queries left partly empty (9 heads a kv head...)."""
    # Chunks: 40 tokens from the start, 75 after 300 cached, 31 (under the tiles' 32) and
    # 512 (the longest that comes as rows), with two decode rows between them.
    chunks = [(0, 40), (300, 75), (10, 31), (0, 512)]
    lens = [n + c for c, n in chunks] + [97, 5]
    q, k_cache, v_cache, meta = _scattered_decode_batch(lens, num_heads, num_kv_heads, 64, 16,
                                                        torch.long)
    tables = meta.decode_block_tables
    picks, row_lens = [], []
    for i, (cached, n) in enumerate(chunks):
        picks += [i] * n
        row_lens += [cached + j + 1 for j in range(n)]
    picks += [4, 5]
    row_lens += [97, 5]
    rows_tables = tables[picks]
    rows_lens = torch.tensor(row_lens)
    rows_q = torch.randn(len(picks), num_heads, 64, generator=torch.Generator().manual_seed(2))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernel.paged_decode(rows_q, k_cache, v_cache, rows_tables, rows_lens, 0.125)
    finally:
        torch.set_num_threads(saved)
    rows_meta = dataclasses.replace(meta, decode_block_tables=rows_tables,
                                    decode_seq_lens=rows_lens, num_decodes=len(picks))
    ref = TorchAttentionBackend._decode(rows_q, k_cache, v_cache, rows_meta, 0.125, num_heads)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()


def test_cpu_kernel_refuses_tables_it_would_read_past(cpu_kernel):
    q, k_cache, v_cache, meta = _scattered_decode_batch([20, 40], 4, 2, 16, 16, torch.long)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    with pytest.raises(RuntimeError, match="outside its block table"):
        cpu_kernel.paged_decode(q, k_cache, v_cache, tables, lens + 16, 0.25)
    with pytest.raises(RuntimeError, match="outside its block table"):
        cpu_kernel.paged_decode(q, k_cache, v_cache, tables, lens * 0, 0.25)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.paged_decode(q, k_cache, v_cache, bad, lens, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernel.paged_decode(q.double(), k_cache, v_cache, tables, lens, 0.25)


def test_cpu_backend_mixed_batch_matches_dense(cpu_kernel):
    """The whole backend (decode through the kernel, prefill chunks through torch) on the
    mixed batch of the torch backend's test."""

    check_mixed_batch(CpuPagedAttentionBackend(cpu_kernel))


def test_cpu_backend_takes_short_prefill_chunks_as_decode_rows(cpu_kernel):
    """The runner's metadata gives the CPU backend a chunk of at most 512 tokens of context
    (cached ones included) as one decode row a token, each attending up to its own
    position; the mixed batch still equals dense attention. Only chunks right after the
    decodes move, and only for a backend that takes them."""
    backend = CpuPagedAttentionBackend(cpu_kernel)
    check_mixed_batch(backend, via_runner_metadata=True)

    cpu, decodes = torch.device("cpu"), [(10, [5, 1, 9])]
    chunks = [(1, 7, 7, [2, 7, 30, 11]), (7, 12, 0, [20, 3]), (12, 612, 0, list(range(150)))]
    meta = metadata(backend, cpu, decodes, chunks, 612)
    assert meta.num_decodes == 12  # A's decode, B's 6 rows after 7 cached, C's 5
    assert meta.decode_seq_lens.tolist() == [10, 8, 9, 10, 11, 12, 13, 1, 2, 3, 4, 5]
    assert meta.decode_block_tables[1].tolist() == [2, 7, 30, 11]
    assert meta.decode_block_tables[7].tolist() == [20, 3, 0, 0]
    assert [(p.start, p.end) for p in meta.prefills] == [(12, 612)]  # 600 tokens: torch
    meta = metadata(backend, cpu, decodes, [chunks[2], (612, 617, 0, [20, 3])], 617)
    assert meta.num_decodes == 1 and len(meta.prefills) == 2  # behind a long one: stays
    meta = metadata(TorchAttentionBackend(), cpu, decodes, chunks[:2], 12)
    assert meta.num_decodes == 1 and len(meta.prefills) == 2


@pytest.mark.parametrize("rows", [1, 7, 33, 600])  # 600: the rows split across threads
def test_norm_kernel_matches_the_torch_norm(cpu_kernel, rows):
    """One pass gives what RMSNorm's seven torch ops give: the residual sum bit for bit,
    the normalized rows within an ulp or two (only the sum of squares adds in another
    order)."""
    from shards.model.layers import RMSNorm

    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5, torch.float32)
    norm.weight.data = torch.randn(96)
    x, residual = torch.randn(rows, 96) * 3, torch.randn(rows, 96)
    want, want_sum = norm(x, residual)
    want_alone, _ = norm(x)
    norm.kernels = cpu_kernel
    got, got_sum = norm(x, residual)
    got_alone, got_alone_sum = norm(x)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_alone, want_alone, rtol=1e-6, atol=1e-6)
    assert got_alone_sum is x  # as torch's path: no residual, x is the next one
    with pytest.raises(RuntimeError, match="residual of x's shape"):
        norm(x, residual[:, :48])


@pytest.fixture
def panel_kernel(cpu_kernel):
    if not cpu_kernel.panels_supported():
        pytest.skip("the panel products are built for AVX-512 CPUs only")
    return cpu_kernel


# Rows: one (its own loop), blocks of 2-6 and their mixes (7 = 4 + 3, 13 = 5 + 4 + 4,
# 33 = 6 x 3 + 5 x 3), 161 and 256 (PANEL_MAX_ROWS). Columns: whole panels and a part
# one (100); K: whole slices of 128 and a part one (300), one and two threads claiming
# panels.
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 33, 161, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(1280, 768), (100, 300)])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_products_equal_linear(panel_kernel, rows, out_features, in_features, threads):
    """x W^T + b on the panel layout equals F.linear up to float32 rounding (another
    summation order), with and without a bias, whichever thread claims which panel."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * out_features)
        w = torch.randn(out_features, in_features, generator=gen) * 0.05
        b = torch.randn(out_features, generator=gen)
        x = torch.randn(rows, in_features, generator=gen)
        panels = panel_kernel.pack_panels(w)
        assert panels.shape == (-(-out_features // 64), in_features, 64)
        for bias in (None, b):
            got = panel_kernel.linear_panels(x, panels, out_features, bias)
            want = torch.nn.functional.linear(x.double(), w.double(),
                                              None if bias is None else bias.double())
            assert got.shape == (rows, out_features) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        # A strided x (a slice of a wider tensor) is read as its values.
        wide = torch.randn(rows, in_features * 2, generator=gen)[:, ::2]
        torch.testing.assert_close(panel_kernel.linear_panels(wide, panels, out_features, None),
                                   torch.nn.functional.linear(wide, w), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(saved)


def test_panel_products_refuse_what_does_not_match(panel_kernel):
    w, x = torch.randn(100, 32), torch.randn(3, 32)
    panels = panel_kernel.pack_panels(w)
    with pytest.raises(RuntimeError, match="panels do not match"):
        panel_kernel.linear_panels(torch.randn(3, 33), panels, 100, None)
    with pytest.raises(RuntimeError, match="panels do not match"):
        panel_kernel.linear_panels(x, panels, 129, None)  # more columns than the panels hold
    with pytest.raises(RuntimeError, match="bias of 100"):
        panel_kernel.linear_panels(x, panels, 100, torch.randn(99))
    with pytest.raises(RuntimeError, match="2-d float32 x"):
        panel_kernel.linear_panels(x.double(), panels, 100, None)
    with pytest.raises(RuntimeError, match="float32 CPU weight"):
        panel_kernel.pack_panels(w.double())
    assert panel_kernel.linear_panels(x[:0], panels, 100, None).shape == (0, 100)
    shifted = torch.cat([torch.zeros(1), panels.flatten()])[1:].view(panels.shape)
    with pytest.raises(RuntimeError, match="64-byte boundary"):  # aligned loads would fault
        panel_kernel.linear_panels(x, shifted, 100, None)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (14, 2, 64), (4, 4, 16)])
def test_rotary_kernel_is_bit_exact(cpu_kernel, heads, kv_heads, head_dim):
    """q and k rotated by the kernel equal the torch path bit for bit (no fused
    multiply-adds), v is the same view, at every position up to the table's last and with
    a scaled table (llama3); qkv may be a view with a row stride of its own."""
    from shards.model.layers import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    for rope_scaling in (None, scaling):
        rotary = RotaryEmbedding(head_dim, 512, 10000.0, rope_scaling)
        width = (heads + 2 * kv_heads) * head_dim
        wide = torch.randn(40, width + 8)
        qkv = wide[:, 3:3 + width]  # rows not packed: stride width + 8
        positions = torch.tensor([0, 511] + torch.randint(0, 512, (38,)).tolist())
        want = rotary.split_rotate(positions, qkv, heads, kv_heads, head_dim)
        rotary.kernels = cpu_kernel
        got = rotary.split_rotate(positions, qkv, heads, kv_heads, head_dim)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert torch.equal(g, w)
        with pytest.raises(RuntimeError, match="outside the rotary table"):
            rotary.split_rotate(torch.full((40,), 512), qkv, heads, kv_heads, head_dim)
        with pytest.raises(RuntimeError, match="outside the rotary table"):
            rotary.split_rotate(torch.full((40,), -1), qkv, heads, kv_heads, head_dim)
        with pytest.raises(RuntimeError, match="float32"):
            rotary.split_rotate(positions, qkv.double(), heads, kv_heads, head_dim)
        with pytest.raises(RuntimeError, match="columns"):
            rotary.split_rotate(positions, qkv, heads + 1, kv_heads, head_dim)


@pytest.mark.parametrize("rows,width", [(1, 2304), (5, 17), (40, 96), (600, 64)])
def test_activation_kernel_is_silu_times_up_within_a_few_ulp(cpu_kernel, rows, width):
    """silu(gate) * up in one pass, against torch's two ops: its exponential is a
    polynomial of its own, so within a few ulp, not bit for bit; and where torch's overflows
    (silu of a large negative number is -0, of -inf NaN) so does it."""
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * width) * 6
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = cpu_kernel.silu_mul(gate_up)
    assert got.shape == (rows, width)
    ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    assert ulps.max() <= 8, ulps.max()
    edges = torch.tensor([-1000.0, -100.0, -87.5, 0.0, 1e-30, 100.0, float("inf"),
                          float("-inf"), float("nan"), 3.0])
    got = cpu_kernel.silu_mul(torch.cat([edges, torch.full_like(edges, 2.0)])[None])[0]
    want = F.silu(edges) * 2.0
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got[~want.isnan()], want[~want.isnan()], rtol=1e-6, atol=1e-30)
    with pytest.raises(RuntimeError, match="even width"):
        cpu_kernel.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernel.silu_mul(gate_up.double())


# A float16 cache (kv_cache_dtype=float16): rounded as torch's .half() rounds, in 8 lanes
# at a time and one at a time for a row's last 1-7 values (heads of 5).
@pytest.mark.parametrize(("cache_dtype", "heads", "head_dim"),
                         [(torch.float32, 4, 32), (torch.float16, 4, 32), (torch.float16, 3, 5)])
def test_kv_write_kernel_equals_index_copy(cpu_kernel, cache_dtype, heads, head_dim):
    """The new tokens' keys and values land in the same slots, bit for bit, as the torch
    path's index_copy_; a slot past the cache is refused, not written."""

    torch.manual_seed(0)
    want_k = torch.randn(6, 16, heads, head_dim).to(cache_dtype)
    want_v = torch.randn(6, 16, heads, head_dim).to(cache_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    k, v = torch.randn(9, heads, head_dim), torch.randn(9, heads, head_dim)
    slots = torch.randperm(96)[:9]
    write_kv(k, v, want_k, want_v, slots)
    cpu_kernel.write_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    for bad in (torch.tensor([96]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_kernel.write_kv(k[:1], v[:1], got_k, got_v, bad)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        cpu_kernel.write_kv(k, v, got_k, got_v, slots[:3])


def test_runner_uses_the_layer_kernels_with_the_cpu_backend_only(cpu_kernel, llama_dir):
    """The CPU attention backend brings the norm, rotary, activation and KV-write kernels;
    the torch backend stays pure torch (the reference the kernels are checked against)."""
    from shards.model.layers import RMSNorm, RotaryEmbedding
    from shards.model.llama import MLP
    from shards.worker.model_runner import ModelRunner, ShardConfig

    def kernels(backend):
        runner = ModelRunner(ShardConfig(model=llama_dir, device="cpu",
                                         attention_backend=backend))
        layers = [m.kernels for m in runner.model.modules()
                  if isinstance(m, (RMSNorm, RotaryEmbedding, MLP))]
        return layers, runner.backend.write_kv

    (on, on_write), (off, off_write) = kernels("cpu"), kernels("torch")
    assert len(on) == len(off) > 3
    assert all(k is cpu_kernel for k in on)
    assert all(k is None for k in off)
    assert on_write.__func__ is CpuPagedAttentionBackend.write_kv
    assert off_write is write_kv


def test_auto_backend_on_cpu(cpu_kernel):
    assert select_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
    assert select_backend("torch", torch.device("cpu"), torch.float32).name == "torch"
    with pytest.raises(ValueError, match="float32 on CPU"):
        select_backend("cpu", torch.device("cpu"), torch.bfloat16)


def test_a_kernel_that_does_not_build_leaves_the_torch_path(tmp_path, monkeypatch):
    """No compiler, or a build error: `auto` falls back to torch, `cpu` says why."""
    from shards.cpu import kernels as cpu_kernels

    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setenv("RAYGEN_KERNEL_CACHE", str(tmp_path / "cache"))
    assert cpu_kernels.load() is None
    assert cpu_kernels.load_error()
    assert select_backend("auto", torch.device("cpu"), torch.float32).name == "torch"
    with pytest.raises(ImportError, match="did not build"):
        select_backend("cpu", torch.device("cpu"), torch.float32)



def test_checkouts_of_the_same_sources_share_one_build(tmp_path, monkeypatch):
    """A clean clone reuses the build of the same sources (the commands name the build
    directory's copy, not the checkout's); a changed byte gets a build of its own; only the
    most recently used builds are kept."""
    from shards.cpu import kernels as cpu_kernels

    monkeypatch.setenv("RAYGEN_KERNEL_CACHE", str(tmp_path / "cache"))
    clones = [tmp_path / "a", tmp_path / "b"]
    dirs = []
    for csrc in clones:
        shutil.copytree(cpu_kernels.CSRC, csrc)
        monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
        dirs.append(cpu_kernels.build_dir())
    assert dirs[0] == dirs[1]
    header = clones[1] / "ops.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert cpu_kernels.build_dir() != dirs[0]

    monkeypatch.setattr(cpu_kernels, "CSRC", clones[0])
    dirs[0].mkdir(parents=True)
    staged = [Path(f) for f in cpu_kernels._staged_sources(dirs[0])]
    assert {f.parent for f in staged} == {dirs[0] / "src"}
    assert sorted(f.name for f in staged) == sorted(f.name for f in clones[0].glob("*.cpp"))
    assert (dirs[0] / "src" / "ops.h").read_bytes() == (clones[0] / "ops.h").read_bytes()

    old = [dirs[0].parent / f"cpu-kernels-old{i}" for i in range(5)]
    for i, d in enumerate(old):
        d.mkdir()
        os.utime(d, (i, i))
    cpu_kernels._prune(dirs[0], keep=3)
    assert sorted(dirs[0].parent.iterdir()) == sorted([dirs[0], old[4], old[3]])


def test_a_finished_build_is_imported_without_building(tmp_path, monkeypatch, cpu_kernel):
    """Another checkout's virtualenv finds the build of the same sources finished and
    imports it: torch's builder (and its ninja, which would compile again for other include
    paths) is not called."""
    import torch.utils.cpp_extension as extension

    from shards.cpu import kernels as cpu_kernels

    monkeypatch.setenv("RAYGEN_KERNEL_CACHE", str(tmp_path))
    built = cpu_kernels.build_dir()
    built.mkdir(parents=True)
    shutil.copy(cpu_kernel.__file__, built / f"{cpu_kernels.NAME}.so")
    (built / cpu_kernels.BUILT).touch()
    monkeypatch.setattr(extension, "load", lambda *a, **k: pytest.fail("built again"))
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    module = cpu_kernels.load()
    assert module is not None, cpu_kernels.load_error()
    # (Python keeps one extension module per name in a process, so this one answers with the
    # first one's functions; a new process, as a shard is, loads this file.)
    assert Path(module.__spec__.origin).parent == built
    x = torch.randn(4, 64)
    assert torch.equal(module.silu_mul(x), cpu_kernel.silu_mul(x))


def test_torch_backend_prefill_takes_sdpa_flash_kernel_on_cpu():
    """Prefill chunks reach SDPA's CPU flash kernel, not its math path (which materialises
    the scores and applies masks op by op: a 2,000-token prefill took 2.7x as long;
    benchmarks/NOTES.md 20). Both kinds of chunk: a fresh prompt (causal) and one after a
    cached prefix (masked); the decode row's call is counted too."""
    from torch.profiler import ProfilerActivity, profile

    class Profiled:
        def __init__(self, backend):
            self.backend, self.prof = backend, None

        def forward(self, *args):
            with profile(activities=[ProfilerActivity.CPU]) as self.prof:
                return self.backend.forward(*args)

    profiled = Profiled(TorchAttentionBackend())
    check_mixed_batch(profiled)
    counts = {e.key: e.count for e in profiled.prof.key_averages()}
    assert counts.get("aten::_scaled_dot_product_flash_attention_for_cpu", 0) == 3, counts
    assert "aten::bmm" not in counts, "an SDPA call took the math path"


def test_a_float16_kv_cache_is_refused_where_the_attention_cannot_read_it():
    from shards.worker.model_runner import resolve_kv_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", cpu, torch.float32) == torch.float32
    assert resolve_kv_dtype("float16", cpu, torch.float32) == torch.float16
    assert resolve_kv_dtype("float16", cuda, torch.float16) == torch.float16
    # flash attention reads the cache in the activations' dtype
    with pytest.raises(ValueError, match="kv_cache_dtype=float16 on CUDA needs dtype=float16"):
        resolve_kv_dtype("float16", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="auto or float16"):
        resolve_kv_dtype("bfloat16", cpu, torch.float32)
