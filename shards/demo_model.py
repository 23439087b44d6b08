"""Write a deterministic random-weight Llama-family checkpoint in Hugging Face layout.

    python -m shards.demo_model OUT_DIR [--preset tiny|small] [--arch llama|qwen2]

The tokenizer is a byte-level BPE trained here on text generated from a seeded word
list (with accented, CJK and emoji text so detokenization is exercised), so nothing is
downloaded. Same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    corpus_words: int


PRESETS = {
    # A few MB: for tests.
    "tiny": Preset(2048, 64, 2, 4, 2, 176, 2048, 60_000),
    # About 100M parameters: for benchmarks.
    "small": Preset(8192, 768, 12, 12, 4, 2304, 4096, 400_000),
}

_SYLLABLES = [c + v for c in "bdfghklmnprstvwyz" for v in "aeiou"] + [
    v + c for v in "aeiou" for c in "lnrsx"]
_EXTRA_TEXT = [
    "café naïve façade über straße élève garçon señor",
    "東京 大阪 中文 日本語 한국어 漢字 你好 世界",
    "😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 🤖",
    "Ω λ π ∑ ∞ ≈ ≠ → ←",
]


def make_corpus(num_words: int, seed: int = 0) -> list[str]:
    """Seeded pseudo-language: a Zipf-like word list so BPE finds real merges."""
    rng = random.Random(seed)
    lexicon = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(20000)
    ]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines = []
    words = rng.choices(lexicon, weights=weights, k=num_words)
    for start in range(0, num_words, 12):
        line = " ".join(words[start : start + 12])
        lines.append(line.capitalize() + rng.choice([".", ",", "?", "!", ":"]))
        if start % 600 == 0:
            lines.append(rng.choice(_EXTRA_TEXT))
    return lines


def train_tokenizer(preset: Preset) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_corpus(preset.corpus_words), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def model_config(preset: Preset, arch: str, vocab_size: int) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": arch == "qwen2",
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
    return config


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Weights scaled by 1/sqrt(fan_in), so activations and logits stay near unit size:
    greedy outputs then vary with the prompt and top-1 margins dwarf float noise."""
    import torch  # here, not at the top: the batcher imports this module for ensure_demo_model

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    vocab = config["vocab_size"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        if config["attention_bias"]:
            for name, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                weights[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(
                    size * head_dim, generator=gen
                )
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    return {name: t.contiguous() for name, t in weights.items()}


def write_demo_model(out_dir: str | Path, preset: str = "tiny", arch: str = "llama",
                     seed: int = 0) -> Path:
    if preset not in PRESETS or arch not in ("llama", "qwen2"):
        raise ValueError(f"unknown preset {preset!r} or arch {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = PRESETS[preset]
    tokenizer = train_tokenizer(spec)
    config = model_config(spec, arch, tokenizer.get_vocab_size())

    from safetensors.torch import save_file

    save_file(random_weights(config, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        "do_sample": False,
    }
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    for name, payload in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
        ("special_tokens_map.json", special_tokens_map),
    ):
        (out / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return out


def ensure_demo_model(path: str | Path, preset: str = "tiny") -> Path:
    """Write the demo model at `path` unless it is there. Written aside and renamed, so
    processes racing to create it (ingress and batcher replicas) never see half a model."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    write_demo_model(tmp, preset)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race: its model is the same bytes
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_demo_model(args.out_dir, args.preset, args.arch, args.seed)
    print(f"wrote {args.preset} {args.arch} demo model to {out}")


if __name__ == "__main__":
    main()
