"""The compiled forward on CPU: torch.compile (inductor) of each layer's dense parts.

Inductor with freezing prepacks the weights for oneDNN and fuses the norms and the MLP's
activation; attention stays eager (its paged metadata is Python). Shapes are dynamic in
the token count, so one graph per part serves every batch and prefill size from 2 tokens
up and serving never recompiles; a single token (a batch-1 decode step) runs eager,
because MKL's matrix-vector product beat the prepacked one there (benchmarks/NOTES.md).
Compiled at warm-up. Tensor parallel ranks (whose row-parallel layers all-reduce) and
CUDA stay eager."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)


class _EagerAtOneRow(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.eager = module
        self.compiled = torch.compile(module, dynamic=True)

    def forward(self, x, *args):
        return self.eager(x, *args) if x.shape[0] == 1 else self.compiled(x, *args)


def compile_layers(model: nn.Module) -> None:
    """Wrap each decoder layer's norms, projections and MLP (model: shards.model.CausalLM)."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.freezing = True  # weights as constants: prepacked for oneDNN
    inductor.cpp.weight_prepack = True
    # One graph per wrapped module instance (its weights are constants in it).
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 1024)
    dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit, 8192)
    for layer in model.model.layers:
        layer.input_layernorm = _EagerAtOneRow(layer.input_layernorm)
        layer.post_attention_layernorm = _EagerAtOneRow(layer.post_attention_layernorm)
        layer.self_attn.qkv_proj = _EagerAtOneRow(layer.self_attn.qkv_proj)
        layer.self_attn.o_proj = _EagerAtOneRow(layer.self_attn.o_proj)
        layer.mlp = _EagerAtOneRow(layer.mlp)


def warm_up(forward, sizes: tuple[int, ...] = (16, 3)) -> float:
    """Run `forward(num_tokens)` at a few sizes so every graph compiles now, not in a
    serving step; returns the seconds it took."""
    t0 = time.perf_counter()
    for n in sizes:
        logger.info("compiling the forward (torch.compile, inductor): %d tokens...", n)
        forward(n)
    seconds = time.perf_counter() - t0
    logger.info("compiled forward ready in %.1f s", seconds)
    return seconds
