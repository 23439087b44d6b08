"""The greedy token of a float32 LM head from half its bytes, exactly.

A one-row step of a small float32 model reads its LM head as much as its layers: SmolLM2's
tied 49,152 x 576 embedding is 113 MB of the 540 MB a token reads. A greedy row whose
caller wants no logprobs (OpenAI's requests without `logprobs`) needs only the argmax, so
the screen multiplies a bfloat16 copy of the head (57 MB, in raygen's bfloat16 lanes, x
kept in float32) and bounds each logit's distance from the float32 product:

    |x.w_bf16 computed - x.w computed| <= (2^-8 + 2.01 gamma_K) sum_i |x_i| |w_i|
                                       <= BOUND x ||x|| ||w||

(bfloat16's rounding moves each weight by at most 2^-8 of itself; gamma_K = K u / (1 - K u)
bounds each side's float32 sum of K products; Cauchy-Schwarz the rest; BOUND carries 1%
more for the float32 comparisons). Every vocabulary row whose screened logit plus its
bound reaches the best screened logit minus that one's bound may be the argmax; those
rows (usually 1-10) are multiplied again in float32 from the head's own weights, and the
best of them is the token. So the token is the float32 product's argmax, up to the order
its sums are taken in, as any of the head's kernels is (a tie within float32 rounding may
go either way, as between oneDNN and raygen's panels).

Kept only where it pays at start-up (`build`): a float32 head whose N x K weight the model
still holds (a tied embedding), one rank, raygen's bfloat16 lanes built, and the screen's
one-row product timed at most SCREEN_MAX_RATIO of the head's own."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE

logger = logging.getLogger(__name__)

# The screen is kept where its one-row product takes at most this share of the head's
# (about half the bytes: 0.50-0.66x on an Intel Xeon; benchmarks/NOTES.md 119).
SCREEN_MAX_RATIO = 0.75
# Steps of more rows than this take the full head (the lanes round x to bfloat16 from
# `bf16_dot_min_rows` rows on, and from 4 rows the float32 head's product is not
# bandwidth-bound: the screen gained nothing there).
SCREEN_MAX_ROWS = 3


def bound_factor(k: int) -> float:
    """BOUND above for a head of K columns."""
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    return 1.01 * (2.0**-8 + 2.01 * gamma)


class GreedyScreen:
    def __init__(self, weight: torch.Tensor, kernels: Any):
        self.weight = weight  # the head's own float32 rows (shared, not copied)
        self.kernels = kernels
        self.num_rows, k = weight.shape
        self.hi = kernels.pack_quant_lanes(weight.bfloat16().contiguous().view(torch.uint8),
                                           BF16_KERNEL_TYPE, k)
        # B ||w|| for the longest row; ||x|| (float32, within 1% of itself: bound_factor's
        # margin) multiplies it per step.
        self.max_norm = float(weight.double().norm(dim=1).max()) * bound_factor(k) * 1.01
        self.max_rows = SCREEN_MAX_ROWS
        if kernels.bf16_dot_min_rows():
            self.max_rows = min(self.max_rows, kernels.bf16_dot_min_rows() - 1)

    @property
    def nbytes(self) -> int:
        return self.hi.numel() * self.hi.element_size()

    def screened(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_quant_lanes(x, self.hi, BF16_KERNEL_TYPE, self.num_rows,
                                               None)

    def candidates(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per row of x, the vocabulary rows that may hold the float32 argmax: a row r
        can beat the best screened row b only if a_r + B_r >= a_b - B_b, so every such r
        has a_r >= a_b - 2 ||x|| max_w (B_w ||w||): a superset, found in three passes over
        the screened logits (the exact bounds per row took more time than they saved)."""
        screened = self.screened(x)
        best = screened.max(dim=1, keepdim=True).values
        reach = 2 * self.max_norm * x.norm(dim=1, keepdim=True)
        maybe = screened >= best - reach
        return [row.nonzero().squeeze(1) for row in maybe]

    def argmax(self, x: torch.Tensor) -> list[int]:
        """The float32 head's greedy token for each row of x (hidden states, float32)."""
        tokens = []
        for row, rows in zip(x, self.candidates(x), strict=True):
            exact = torch.mv(self.weight[rows], row)
            tokens.append(int(rows[int(exact.argmax())]))
        return tokens


def build(model: torch.nn.Module, kernels: Any, world_size: int) -> GreedyScreen | None:
    """The screen for this model's LM head where it can be made and its one-row product
    pays against the head's route (timed here), else None."""
    head = model.lm_head
    weight = head.weight
    if (kernels is None or world_size != 1 or weight.dtype != torch.float32
            or weight.dim() != 2 or weight.numel() == 0 or weight.shape[0] % 8
            or weight.shape[1] % 32 or not kernels.quant_lanes_supported()):
        return None
    screen = GreedyScreen(weight.detach(), kernels)
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0))
    times = [float("inf"), float("inf")]
    for _ in range(4):  # alternating, best of each (the first warms both up)
        for i, product in enumerate((head.matmul, screen.screened)):
            t0 = time.perf_counter()
            product(x)
            times[i] = min(times[i], time.perf_counter() - t0)
    pays = times[1] <= SCREEN_MAX_RATIO * times[0]
    logger.info("greedy LM head screen (bfloat16 copy, %.0f MiB): one row %.2f ms against "
                "the head's %.2f ms: %s", screen.nbytes / 2**20, times[1] * 1e3, times[0] * 1e3,
                "kept" if pays else "not kept")
    return screen if pays else None
