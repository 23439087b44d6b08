"""The greedy LM head screen (shards/cpu/greedy_screen.py): the float32 head's argmax from
its Q8_0 copy and a few rows multiplied again, on rows built to nearly tie."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from shards.cpu import greedy_screen
from shards.cpu import kernels as cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.quant_lanes_supported(),
                                reason="raygen's lanes are not built here")


def near_ties(n: int = 1024, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows come in pairs 0.1% apart (their Q8_0 copies mostly equal), and
    hidden states that point at pairs."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n // 2, k, generator=g)
    twin = base + torch.randn(n // 2, k, generator=g) * 1e-3 * base.abs()
    weight = torch.stack([base, twin], dim=1).reshape(n, k).contiguous()
    picks = torch.randint(0, n, (64,), generator=g)
    x = weight[picks] * 4 + torch.randn(64, k, generator=g) * 0.05
    return weight, x


def test_the_screen_draws_the_float32_argmax_where_q8_0_alone_does_not():
    weight, x = near_ties()
    screen = greedy_screen.GreedyScreen(weight, kernels)
    exact = (x @ weight.T).argmax(dim=1).tolist()
    rows = [screen.argmax(x[i:i + 1])[0] for i in range(len(x))]
    assert rows == exact
    # More rows at once (up to what a step takes) give the same.
    assert screen.argmax(x[:3]) == exact[:3]
    # The rows multiplied again decide: the Q8_0 products alone miss some of these.
    alone = screen.screened(x).argmax(dim=1).tolist()
    assert sum(a != e for a, e in zip(alone, exact, strict=True)) >= 5
    # And a few rows, not the vocabulary, are multiplied again.
    assert max(len(c) for c in screen.candidates(x)) <= 16


def test_a_bfloat16_head_is_screened_for_its_own_argmax():
    """The argmax of the weights rounded to bfloat16 (what a bfloat16 model's head
    multiplies), not of the float32 ones: the twins of `near_ties` round to equal or
    neighbouring bfloat16 rows, where the two argmaxes part."""
    weight, x = near_ties(seed=3)
    screen = greedy_screen.GreedyScreen(weight, kernels, bfloat16=True)
    rounded = weight.bfloat16().float()
    want = (x @ rounded.T).argmax(dim=1).tolist()
    assert [screen.argmax(x[i:i + 1])[0] for i in range(len(x))] == want
    assert want != (x @ weight.T).argmax(dim=1).tolist()


def test_random_hidden_states_agree_with_the_float32_head():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 96, generator=g) * 0.05
    x = torch.randn(200, 96, generator=g) * 3
    screen = greedy_screen.GreedyScreen(weight, kernels)
    assert [screen.argmax(x[i:i + 1])[0] for i in range(len(x))] == \
        (x @ weight.T).argmax(dim=1).tolist()


def test_the_screen_is_kept_only_where_it_can_run_and_pays(monkeypatch):
    weight = torch.randn(1024, 64)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=weight, matmul=lambda x: x @ weight.T))
    monkeypatch.setattr(greedy_screen, "SCREEN_MAX_RATIO", math.inf)
    assert isinstance(greedy_screen.build(model, kernels, 1), greedy_screen.GreedyScreen)
    for args in ((model, kernels, 2), (model, None, 1)):  # two ranks; no kernels
        assert greedy_screen.build(*args) is None
    for other in (weight.bfloat16(), weight[:1020], weight[:, :48], torch.empty(0)):
        assert greedy_screen.build(SimpleNamespace(lm_head=SimpleNamespace(
            weight=other, matmul=model.lm_head.matmul)), kernels, 1) is None
    # A GGUF file's Q8_0 head, oneDNN's bfloat16 product (x rounded), a bfloat16 head that
    # raygen's kernels multiply in no step: none.
    for route in ({"quant_type": 2}, {"packed_dtype": torch.bfloat16},
                  {"quant_type": 3, "quant_rows": 0, "packed_dtype": torch.bfloat16}):
        head = SimpleNamespace(weight=weight, matmul=model.lm_head.matmul, **route)
        assert greedy_screen.build(SimpleNamespace(lm_head=head), kernels, 1) is None
    # A bfloat16 head in raygen's kernels for steps of up to 2 rows: screened there.
    head = SimpleNamespace(weight=weight, matmul=model.lm_head.matmul, quant_type=3,
                           quant_rows=2, packed_dtype=torch.bfloat16)
    screen = greedy_screen.build(SimpleNamespace(lm_head=head), kernels, 1)
    assert (screen.bfloat16, screen.max_rows) == (True, 2)
    monkeypatch.setattr(greedy_screen, "SCREEN_MAX_RATIO", 0.0)  # never pays
    assert greedy_screen.build(model, kernels, 1) is None


def test_a_head_of_q8_0_values_is_screened_to_one_row():
    """Where the weights are Q8_0 values already (a GGUF file's Q8_0 head, widened), the
    copy is exact: no bound but the sums' rounding, one candidate a row."""
    g = torch.Generator().manual_seed(2)
    scale = (torch.rand(512, 2, 1, generator=g) * 0.01).half().float()
    q = torch.randint(-127, 128, (512, 2, 32), generator=g)
    q[..., 0] = 127  # each block's largest: its scale is d
    weight = (q * scale).reshape(512, 64)
    screen = greedy_screen.GreedyScreen(weight, kernels)
    assert screen.max_error == 0.0
    x = torch.randn(50, 64, generator=g)
    assert all(len(rows) <= 2 for rows in screen.candidates(x))
    assert screen.argmax(x) == (x @ weight.T).argmax(dim=1).tolist()


def test_greedy_requests_without_logprobs_take_the_screen_and_draw_the_same(monkeypatch,
                                                                             qwen2_dir):
    """A tied-embedding model (the demo qwen2) with the screen kept: the same greedy tokens
    with and without logprobs asked for, drafts included; NaN logprobs where none were."""
    from deployments.offline import LLM
    from engine.sampling_params import SamplingParams

    monkeypatch.setattr(greedy_screen, "SCREEN_MAX_RATIO", math.inf)
    llm = LLM(qwen2_dir, num_blocks=64, speculate=2)
    assert llm.runner.compute_path()["greedy_screen"] is True
    calls = []
    argmax = llm.runner.screen.argmax
    monkeypatch.setattr(llm.runner.screen, "argmax", lambda x: calls.append(len(x)) or argmax(x))
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33] * 3, list(range(40, 70)), [7] * 12]
    full = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fast = dataclasses.replace(full, logprobs=False)
    with_logprobs = llm.generate(prompts, full)
    assert not calls
    without = llm.generate(prompts, fast)
    assert calls
    assert [o.token_ids for o in without] == [o.token_ids for o in with_logprobs]
    assert max(calls) <= llm.runner.screen.max_rows  # bigger steps take the full head
    # A token the screen drew has no logprob (NaN); one from a bigger step has its own.
    pairs = [(a, b) for o, p in zip(without, with_logprobs, strict=True)
             for a, b in zip(o.logprobs, p.logprobs, strict=True)]
    assert any(math.isnan(a) for a, _ in pairs)
    assert all(math.isnan(a) or abs(a - b) < 1e-4 for a, b in pairs)
    assert not any(math.isnan(b) for _, b in pairs)
