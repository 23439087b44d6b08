"""The greedy token of a float32 LM head from a quarter of its bytes, exactly.

A one-row step of a small float32 model reads its LM head as much as its layers: SmolLM2's
tied 49,152 x 576 embedding is 113 MB of the 540 MB a token reads. A greedy row whose
caller wants no logprobs (OpenAI's requests without `logprobs`, TGI's plain /generate)
needs only the argmax, so the screen multiplies a copy of the head in Q8_0 blocks
(llama.cpp's 8-bit blocks of 32 with an fp16 scale: 30 MB, raygen's lanes, x kept in
float32) and bounds each logit's distance from the float32 product:

    |screened_r - logit_r| <= E_r ||x||_1 + c ||x||_2 max(||w_r||, ||q_r||) = B_r

where E_r is row r's largest |w - d q| (measured when the copy is made: the blocks' own
rounding), and c = 1.01 x 2.01 gamma_n bounds both sides' float32 sums of n products
(gamma_n = n u / (1 - n u)). Every vocabulary row whose screened logit plus its bound
reaches the best of (screened - bound) may be the argmax; those rows (1-2 a step on
SmolLM2's F32 file, whose head holds Q8_0 values; 5-7 at the median, 90 at most, on that
head with noise added: benchmarks/NOTES.md 119) are multiplied again in float32 from the
head's own weights, and the best of them is the token. So the token is the float32
product's argmax, up to the order its sums are taken in, as with any of the head's
kernels (a tie within float32 rounding may go either way, as between oneDNN and raygen's
panels).

A bfloat16 model's head (57 MB) is screened the same way where raygen's kernels multiply
it by float32 x (steps of a few rows): the copy and the rows multiplied again are then of
the weights rounded to bfloat16, so the token is that product's argmax.

Kept only where it pays at start-up (`build`): a head whose N x K float32 weight the model
still holds (a tied embedding; not a GGUF file's blocks), one rank, raygen's lanes built,
and the screen's one-row product timed at most SCREEN_MAX_RATIO of the head's own."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shards.checkpoints.gguf_weights import BF16_KERNEL_TYPE, KERNEL_TYPES
from shards.cpu.layouts import F32_LANES_TYPE

logger = logging.getLogger(__name__)

Q8_0 = KERNEL_TYPES["Q8_0"]
BLOCK = 32  # Q8_0's block
# The screen is kept where its one-row product takes at most this share of the head's
# (SmolLM2's F32 head on an Intel Xeon: about a third; benchmarks/NOTES.md 119).
SCREEN_MAX_RATIO = 0.75
# Steps of more rows than this take the full head (from 4 rows the float32 head's product
# is no longer bound by its bytes: the screen gained nothing there).
SCREEN_MAX_ROWS = 3
# Past this many rows within the cheap reach (every row's bound at its largest), the
# candidates are cut to those within their own rows' bounds.
REFINE_ABOVE = 32


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N x K float32) as Q8_0 blocks by the `gguf` package's quantizer (llama.cpp's
    rounding, as `quantize=q8_0` makes them), one uint8 row of K / 32 blocks per output
    row; each row's largest |w - d q| and each row's norm, the larger of W's and the
    blocks' (float64, rounded up)."""
    import gguf

    qtype = gguf.GGMLQuantizationType.Q8_0
    raw = gguf.quants.quantize(weight.contiguous().numpy(), qtype)
    values = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    error = (weight.double() - values).abs().amax(dim=1)
    norms = torch.maximum(weight.double().norm(dim=1), values.norm(dim=1))
    up = 1 + 2.0**-20
    return torch.from_numpy(raw), (error * up).float(), (norms * up).float()


def sum_bound(n: int) -> float:
    """c above for sums of n products (with the blocks' scaling, n = K + K / 32 + 1)."""
    u = 2.0**-24
    return 1.01 * 2.01 * n * u / (1 - n * u)


class GreedyScreen:
    """With `bfloat16`, the head multiplies W rounded to bfloat16 (by float32 x): the
    argmax is that product's, the copy and the rows multiplied again are of those values."""

    def __init__(self, weight: torch.Tensor, kernels: Any, bfloat16: bool = False,
                 max_rows: int = SCREEN_MAX_ROWS):
        self.weight = weight  # the head's own float32 rows (shared, not copied)
        self.kernels = kernels
        self.bfloat16 = bfloat16
        self.num_rows, k = weight.shape
        raw, self.errors, self.norms = q8_0_blocks(weight.bfloat16().float() if bfloat16
                                                   else weight)
        self.blocks = kernels.pack_quant_lanes(raw, Q8_0, k)
        self.c = sum_bound(k + k // BLOCK + 1)
        self.max_error = float(self.errors.max())
        self.max_norm = float(self.norms.max())
        self.max_rows = max_rows

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def screened(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_quant_lanes(x, self.blocks, Q8_0, self.num_rows, None)

    def candidates(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per row of x, the vocabulary rows that may hold the float32 argmax. A row r can
        beat the best screened row b only if a_r + B_r >= a_b - B_b, so every such r has
        a_r >= a_b - 2 max B (three passes over the screened logits); past REFINE_ABOVE of
        those, the ones with a_r + B_r >= max(a - B) over them (the row that maximizes
        a - B is among them)."""
        screened = self.screened(x)
        xd = x.double()
        x1, x2 = xd.abs().sum(dim=1).tolist(), xd.norm(dim=1).tolist()
        best = screened.max(dim=1).values.tolist()
        found = []
        for i, row in enumerate(screened):
            reach = 2.02 * (self.max_error * x1[i] + self.c * self.max_norm * x2[i])
            rows = (row >= best[i] - reach).nonzero().squeeze(1)
            if len(rows) > REFINE_ABOVE:
                a = row[rows]
                bound = (self.errors[rows] * x1[i] + self.norms[rows] * (self.c * x2[i])) * 1.01
                rows = rows[a + bound >= (a - bound).max()]
            found.append(rows)
        return found

    def argmax(self, x: torch.Tensor) -> list[int]:
        """The float32 head's greedy token for each row of x (hidden states, float32)."""
        tokens = []
        for row, rows in zip(x, self.candidates(x), strict=True):
            weights = self.weight[rows]
            exact = torch.mv(weights.bfloat16().float() if self.bfloat16 else weights, row)
            tokens.append(int(rows[int(exact.argmax())]))
        return tokens


def build(model: torch.nn.Module, kernels: Any, world_size: int) -> GreedyScreen | None:
    """The screen for this model's LM head where it can be made and its one-row product
    pays against the head's route (timed here), else None."""
    head = model.lm_head
    weight = head.weight
    # The head multiplies this float32 weight itself, or (a bfloat16 model) the weight
    # rounded to bfloat16 by float32 x in raygen's kernels: steps of up to quant_rows rows
    # (past them oneDNN rounds x too), below the lanes' bf16_dot_min_rows. Not a GGUF
    # file's blocks (as few bytes as the copy's).
    quant_type = getattr(head, "quant_type", -1)
    max_rows, bfloat16 = SCREEN_MAX_ROWS, quant_type == BF16_KERNEL_TYPE
    if bfloat16 and kernels is not None:
        dot = kernels.bf16_dot_min_rows()
        max_rows = min(max_rows, getattr(head, "quant_rows", 0), dot - 1 if dot else max_rows)
    elif (getattr(head, "packed_dtype", None) is not None
          or quant_type not in (-1, F32_LANES_TYPE)):
        return None
    if (kernels is None or world_size != 1 or max_rows < 1 or weight.dtype != torch.float32
            or weight.dim() != 2 or weight.numel() == 0 or weight.shape[0] % 8
            or weight.shape[1] % BLOCK or not kernels.quant_lanes_supported()):
        return None
    screen = GreedyScreen(weight.detach(), kernels, bfloat16, max_rows)
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0))
    times = [float("inf"), float("inf")]
    for _ in range(4):  # alternating, best of each (the first warms both up)
        for i, product in enumerate((head.matmul, screen.screened)):
            t0 = time.perf_counter()
            product(x)
            times[i] = min(times[i], time.perf_counter() - t0)
    pays = times[1] <= SCREEN_MAX_RATIO * times[0]
    logger.info("greedy LM head screen (Q8_0 copy of the %s head, %.0f MiB, steps of up to %d "
                "rows): one row %.2f ms against the head's %.2f ms: %s",
                "bfloat16" if bfloat16 else "float32", screen.nbytes / 2**20, max_rows,
                times[1] * 1e3, times[0] * 1e3, "kept" if pays else "not kept")
    return screen if pays else None
