"""The demo checkpoint: deterministic, and loadable offline by transformers as a user
would load any Hugging Face model directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shards.demo_model import IM_END_ID, PRESETS, model_config, train_tokenizer, write_demo_model


def test_same_arguments_same_bytes(llama_dir, tmp_path):
    # Through the command line, as the README runs it.
    subprocess.run([sys.executable, "-m", "shards.demo_model", str(tmp_path), "--preset", "tiny"],
                   check=True, capture_output=True)
    ours = {p.name: p.read_bytes() for p in Path(llama_dir).iterdir()}
    again = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(ours) >= {"config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json", "generation_config.json"}
    assert ours == again


def test_other_seed_other_weights(llama_dir, tmp_path):
    write_demo_model(tmp_path, "tiny", "llama", seed=1)
    assert (tmp_path / "model.safetensors").read_bytes() != (
        Path(llama_dir) / "model.safetensors").read_bytes()


def test_transformers_loads_it(llama_dir, qwen2_dir):
    for model_dir, cls in ((llama_dir, "LlamaForCausalLM"), (qwen2_dir, "Qwen2ForCausalLM")):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        assert type(model).__name__ == cls
        tok = AutoTokenizer.from_pretrained(model_dir)
        assert tok.is_fast  # PreTrainedTokenizerFast (transformers 4), TokenizersBackend (5)
        assert json.loads((Path(model_dir) / "tokenizer_config.json").read_text())[
            "tokenizer_class"] == "PreTrainedTokenizerFast"
        ids = tok("Hello world").input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    qwen = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()


def test_chat_template_and_generation_config(tokenizer, llama_dir):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((Path(llama_dir) / "generation_config.json").read_text())
    assert IM_END_ID in gen["eos_token_id"] and tokenizer.eos_token_id in gen["eos_token_id"]


def test_small_preset_size():
    spec = PRESETS["small"]
    config = model_config(spec, "llama", spec.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(config))
    num_params = sum(p.numel() for p in model.parameters())
    assert 80e6 < num_params < 120e6
    # The trained vocabulary really reaches the preset's size (the corpus has the merges).
    assert train_tokenizer(spec).get_vocab_size() == spec.vocab_size >= 8192


def _hf_config(config: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items()
                          if k not in ("architectures", "model_type")})
