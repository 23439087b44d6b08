"""Checkpoints as users hold them: a GGUF file served as given equals transformers' own
GGUF loading token for token, and every bad `model=` is one line naming the path and the
reason (the app builder's check, run before Ray starts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from deployments.app import check_model
from deployments.config import AppArgs
from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from shards.checkpoints.gguf_weights import check_tensor_types, dequantize, hf_name, iter_gguf
from shards.checkpoints.resolve import CheckpointError, find_gguf, model_dir
from shards.cpu.layouts import set_quant_rows
from tests.reference import smollm2_gguf, smollm2_transformers

SMOLLM2 = smollm2_gguf()


def test_gguf_greedy_equals_transformers_gguf_loading():
    """SmolLM2-135M-Instruct's Q4_1 file (Q8_0 embeddings, F32 norms): raygen dequantizes
    each tensor itself; transformers loads the same file with `gguf_file=`."""
    llm = LLM(str(SMOLLM2), num_blocks=128)
    # Steps of up to 8 rows multiply by the file's own blocks (whatever the start-up
    # timings chose): qkv, o, gate_up and down of 30 layers in Q4_1, the tied head in Q8_0.
    assert llm.runner.weights.quant_types == {"Q4_1": 120, "Q8_0": 1}
    set_quant_rows(llm.runner.model, 8)
    # The file's special tokens, not the converter's guess: grammars end on this EOS.
    assert llm.tokenizer.eos_token == "<|im_end|>"
    assert llm.tokenizer.eos_token_id in llm.runner.model_config.eos_token_ids
    # The file's add_bos_token (false): a text is its own tokens, as llama.cpp reads it (the
    # converter put <|im_start|> before every completion's prompt); and text decodes as
    # drawn, " ?" included (the converter tidied it to "?"; llama.cpp never does).
    text = "Is it Paris ? Yes ."
    ids = llm.tokenizer(text).input_ids
    assert ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert llm.tokenizer.decode(ids) == text
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    prompts = [chat, llm.tokenizer("def fibonacci(n):").input_ids]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=20))
    assert outputs[0].text.startswith("The capital of France is Paris")
    hf = smollm2_transformers()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=20)[0, len(prompt):].tolist()
        assert output.token_ids == expected


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_dequantize_bit_for_bit_as_the_gguf_package_does(qtype):
    """raygen's dequantization (torch) against the `gguf` package's (numpy), bit for bit:
    random blocks with an infinite and a zero scale, and the real file's tensors."""
    kind = gguf.GGMLQuantizationType[qtype]
    x = (np.random.default_rng(0).standard_normal((9, 320)) * 3).astype(np.float32)
    x[1] = 0.0
    blocks = gguf.quants.quantize(x, kind)
    blocks[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    cases = [blocks, blocks[2:5]]
    config = json.loads((Path(model_dir(str(SMOLLM2))) / "config.json").read_text())
    cases += [np.asarray(t.tensor.data[:40]) for _, t in iter_gguf(SMOLLM2, config)
              if t.tensor.tensor_type == kind][:2]
    for data in cases:
        with np.errstate(invalid="ignore"):  # the infinite scale times a zero: NaN in both
            ours, theirs = dequantize(data, kind), gguf.quants.dequantize(data, kind)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert len(cases) == 2 + {"Q4_0": 0, "Q4_1": 2, "Q8_0": 1}[qtype]  # the file's tensors


def test_a_rank_reads_its_heads_in_transformers_order():
    """Rows of whole heads, read alone, equal those rows of the whole tensor with
    llama.cpp's rotary interleaving undone (transformers' order)."""
    config = json.loads((Path(model_dir(str(SMOLLM2))) / "config.json").read_text())
    tensors = dict(iter_gguf(SMOLLM2, config))
    k = tensors["model.layers.3.self_attn.k_proj.weight"]
    whole = k[:]
    assert whole.shape == (3 * 64, 576)
    for start in (0, 64, 128):
        assert torch.equal(k[start:start + 64], whole[start:start + 64])
    assert torch.equal(k[:, 32:96], whole[:, 32:96])
    # A row-split layer's share: only its columns' blocks are dequantized (Q4_1 and Q8_0
    # blocks of 32); a range off the blocks is cut from the whole rows instead.
    down = tensors["model.layers.3.mlp.down_proj.weight"]
    embed = tensors["model.embed_tokens.weight"]
    for t, cols in ((down, slice(768, 1536)), (down, slice(5, 70)),
                    (embed, slice(64, 128)), (embed, slice(5, 70))):
        assert torch.equal(t[0:16, cols], t[0:16][:, cols])
    raw = gguf.quants.dequantize(k.tensor.data, k.tensor.tensor_type)
    head = raw[:64].reshape(32, 2, 576).swapaxes(0, 1).reshape(64, 576)  # undo interleave
    assert np.array_equal(whole[:64].numpy(), head)
    with pytest.raises(ValueError, match="split a head"):
        k[0:32]


def test_gguf_names_map_to_the_model_and_strangers_are_refused():
    assert hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(CheckpointError, match="blk.0.ssm_conv1d.weight"):
        hf_name("blk.0.ssm_conv1d.weight")


def write_gguf(path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 2 * size), np.uint8),
                      raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_arrays_are_stepped_over_to_the_same_tensors(tmp_path):
    """The weights' reader skips metadata arrays (strings, numbers, nested) instead of
    reading them: its tensors are where gguf's own reader finds them."""
    from shards.checkpoints.gguf_weights import _reader

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "", "bcd" * 50, "é"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_custom_alignment(64)
    writer.add_string("general.name", "x")
    for i, qtype in enumerate((gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.full((4, 2 * size), i + 1, np.uint8),
                          raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = _reader(tmp_path / "m.gguf"), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert ours.alignment == theirs.alignment == 64 and ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data)


def test_a_type_the_gguf_package_cannot_read_is_named_with_its_tensor(tmp_path):
    check_tensor_types(write_gguf(tmp_path / "ok.gguf", gguf.GGMLQuantizationType.Q4_K))
    bad = write_gguf(tmp_path / "bad.gguf", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight is Q8_1"):
        check_tensor_types(bad)
    with pytest.raises(CheckpointError, match="Q8_1"):
        check_model(AppArgs(model=str(bad)))


def test_bad_models_are_one_clear_line(tmp_path, llama_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    arch = shutil.copytree(llama_dir, tmp_path / "gpt2")
    (arch / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(llama_dir) / "config.json", bare)
    cases = {
        str(tmp_path / "missing"): "no such file or directory",
        str(tmp_path / "empty"): r"holds no checkpoint \(no config.json and no .gguf file\)",
        str(tmp_path / "two"): r"holds 2 .gguf files \(a.gguf, b.gguf\); name one",
        str(tmp_path / "notes.txt"): "not a .gguf file",
        str(tmp_path / "junk.gguf"): "not a readable GGUF file",
        str(arch): "model_type 'gpt2' is not implemented; supported: llama, mistral, qwen2",
        str(bare): "config.json but no .safetensors weights",
    }
    for model, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            check_model(AppArgs(model=model))
        assert "\n" not in str(info.value) and model in str(info.value)
    with pytest.raises(CheckpointError, match=r"tensor_parallel_size=3: the model's 4 "
                                              r"attention heads \(2 key/value heads\)"):
        check_model(AppArgs(model=llama_dir, tensor_parallel_size=3))
    check_model(AppArgs(model=llama_dir, tensor_parallel_size=2))


def test_a_folder_with_one_gguf_file_is_that_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / SMOLLM2.name).symlink_to(SMOLLM2)
    assert find_gguf(tmp_path / "m") == tmp_path / "m" / SMOLLM2.name
    assert find_gguf(SMOLLM2) == SMOLLM2
