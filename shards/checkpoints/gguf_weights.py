"""A GGUF file's tensors under Hugging Face's names, read lazily: indexing one returns
the dequantized rows (or columns) asked for, as `safetensors`' slices do, so the loader
and the tensor-parallel layers read GGUF and safetensors checkpoints the same way: a rank
dequantizes its rows, or (row-split layers) only its columns' quantization blocks.

llama.cpp's converter stores a Llama's q and k projections with the rows of each head
interleaved for its rotary kernel; they are put back in Hugging Face's order here, as
transformers does when it loads a GGUF file. A slice of whole heads (what a rank keeps)
permutes within itself, so each rank still reads only its rows."""

from __future__ import annotations

import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from shards.checkpoints.resolve import CheckpointError

# GGUF name (llama.cpp's) -> Hugging Face name, for the Llama family (llama, qwen2).
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_SKIP = {"rope_freqs"}  # llama3's rope factors: computed from the config instead
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values of rows of quantization blocks. Q4_0, Q4_1 and Q8_0 (what llama.cpp's
    small models are made of) in torch's threaded elementwise ops, the same arithmetic as
    the `gguf` package's (each product and sum rounded to float32 as it goes: bit for bit
    its values, tests/shards/test_checkpoint.py) in a third of its time; the other types
    through that package."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    if qtype not in (kinds.Q4_0, kinds.Q4_1, kinds.Q8_0) or data.dtype != np.uint8:
        return gguf.quants.dequantize(data, qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    with warnings.catch_warnings():  # the file's memory map is read-only; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, block_bytes)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # (blocks, 1)
    if qtype == kinds.Q8_0:
        values = blocks[:, 2:].view(torch.int8).float() * scale
    else:  # 4-bit: the low nibbles are a block's first half, the high nibbles its second
        nibbles = blocks[:, 4 if qtype == kinds.Q4_1 else 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)
        if qtype == kinds.Q4_1:
            values = scale * q.float() + blocks[:, 2:4].contiguous().view(torch.float16).float()
        else:
            values = scale * (q.to(torch.int8) - 8).float()
    return values.numpy().reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block)


def hf_name(name: str) -> str | None:
    """Hugging Face's name for a GGUF tensor; None for one the model does not load."""
    if (match := _BLOCK_NAME.match(name)) is not None:
        layer, part, kind = match.groups()
        if part not in _BLOCK:
            raise CheckpointError(f"GGUF tensor {name} is not part of a Llama-family model")
        return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _SKIP:
        return None
    if base not in _GLOBAL:
        raise CheckpointError(f"GGUF tensor {name} is not part of a Llama-family model")
    return f"{_GLOBAL[base]}.{kind}"


def _reader(path: str | Path):
    import gguf

    class WeightsReader(gguf.GGUFReader):
        """gguf's reader, but its metadata arrays (the tokenizer's 49k tokens and 48k merges
        in SmolLM2: 5 s of numpy views a start, each rank's) are stepped over, not read;
        the weights need none of them (the tokenizer is converted from the file once)."""

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            order = ">" if self.byte_order == "S" else "<"
            return _array_size(self.data, orig_offs, order), [], [], [gguf.GGUFValueType.ARRAY]

    try:
        return WeightsReader(str(path))
    except Exception as exc:  # a truncated or foreign file: numpy and struct errors
        raise CheckpointError(f"model={path}: not a readable GGUF file "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc


# Bytes of each fixed-size GGUF value type (GGUFValueType: 8 is STRING, 9 is ARRAY).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _array_size(data, offset: int, order: str) -> int:
    """Bytes of the GGUF array value at `offset` (its item type, count and items)."""
    item_type, count = struct.unpack_from(order + "IQ", data, offset)
    end = offset + 12
    if item_type in _VALUE_SIZES:
        return end + count * _VALUE_SIZES[item_type] - offset
    if item_type == 8:  # strings: a u64 length before each
        length = struct.Struct(order + "Q")
        for _ in range(count):
            end += 8 + length.unpack_from(data, end)[0]
        return end - offset
    if item_type == 9:
        for _ in range(count):
            end += _array_size(data, end, order)
        return end - offset
    raise ValueError(f"unknown GGUF value type {item_type} at offset {offset}")


def check_tensor_types(path: str | Path) -> None:
    """Every tensor's type can be dequantized by the installed `gguf` package (checked on
    one block of zeros, without reading the weights), else CheckpointError naming the
    type and the first tensor that has it."""
    import gguf

    seen: dict[int, str | None] = {}
    for tensor in _reader(path).tensors:
        qtype = tensor.tensor_type
        if qtype not in seen:
            block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
            try:
                gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
                seen[qtype] = None
            except NotImplementedError:
                seen[qtype] = tensor.name
        if seen[qtype] is not None:
            raise CheckpointError(f"model={path}: tensor {seen[qtype]} is {qtype.name}, a "
                                  "type the installed gguf package cannot dequantize")


def tokenizer_flags(path: str | Path) -> dict[str, bool]:
    """The file's own word on what its tokenizer adds to a text (llama.cpp reads these):
    `add_bos_token` and `add_eos_token`, where the file says."""
    fields = _reader(path).fields
    flags = {}
    for name in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{name}")
        if field is not None and field.data:
            flags[name] = bool(field.parts[field.data[0]][0])
    return flags


# The quantization types whose blocks raygen's CPU kernels multiply by as they are
# (shards/cpu/csrc/quant_linear.cpp), by the kernels' codes.
KERNEL_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
BF16_KERNEL_TYPE = 3  # bfloat16 weights (shards/cpu/layouts.py: pack_for_onednn)


class GGUFSlice:
    """One tensor, dequantized on indexing: `t[:]`, `t[a:b]` (rows) or `t[:, a:b]`.
    `blocks(rows, cols)` gives the same part as the file holds it, for a type in
    KERNEL_TYPES."""

    def __init__(self, tensor, num_heads: int | None):
        self.tensor = tensor
        self.num_heads = num_heads  # set for a Llama's q and k: undo llama.cpp's order
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))

    @property
    def kernel_type(self) -> str | None:
        name = self.tensor.tensor_type.name
        return name if name in KERNEL_TYPES and len(self.shape) == 2 else None

    def blocks(self, rows: slice, cols: slice = slice(None)) -> np.ndarray | None:
        """Rows `rows` of the tensor's quantization blocks (uint8, a row of blocks per
        weight row) and of its columns `cols` where they fall on whole blocks; None where
        they do not, or the type is not one the kernels read."""
        import gguf

        if self.kernel_type is None:
            return None
        start, stop, _ = rows.indices(self.shape[0])
        first, last, _ = cols.indices(self.shape[1])
        block, block_bytes = gguf.GGML_QUANT_SIZES[self.tensor.tensor_type]
        if first % block or last % block:
            return None
        data = self.tensor.data[start:stop,
                                first // block * block_bytes:last // block * block_bytes]
        if self.num_heads is not None:
            data = self._undo_interleave(data, start, stop)
        return np.ascontiguousarray(data)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _read(self, rows: slice, cols: slice) -> np.ndarray:
        """Dequantize rows[start:stop] and, where the columns fall on whole quantization
        blocks (a row-split layer's share always does), only those columns' blocks."""
        import gguf

        start, stop, _ = rows.indices(self.shape[0])
        if len(self.shape) == 1:
            values = gguf.quants.dequantize(self.tensor.data, self.tensor.tensor_type)
            return values.reshape(-1)[rows]
        data = self.tensor.data[start:stop]
        first, last, _ = cols.indices(self.shape[1])
        block, block_bytes = gguf.GGML_QUANT_SIZES[self.tensor.tensor_type]
        width = self.shape[1]
        if (first, last) != (0, width) and first % block == 0 and (
                last % block == 0 or last == width):
            if data.dtype == np.uint8:  # quantized: rows of byte blocks
                data = data[:, first // block * block_bytes: -(-last // block) * block_bytes]
            else:  # F32, F16, BF16 arrays hold elements
                data = data[:, first:last]
            width, cols = last - first, slice(None)
        values = dequantize(data, self.tensor.tensor_type).reshape(stop - start, width)
        if self.num_heads is not None:
            values = self._undo_interleave(values, start, stop)
        return values[:, cols]

    def _undo_interleave(self, values: np.ndarray, start: int, stop: int) -> np.ndarray:
        if (stop - start) * self.num_heads % self.shape[0]:
            raise ValueError(f"rows {start}:{stop} of {self.tensor.name} split a head")
        heads = self.num_heads * (stop - start) // self.shape[0]
        half = (stop - start) // heads // 2
        return values.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(stop - start, -1)

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = (key, slice(None)) if not isinstance(key, tuple) else key
        return torch.from_numpy(np.array(self._read(rows, cols), dtype=np.float32))


def iter_gguf(path: str | Path, config: dict) -> Iterator[tuple[str, GGUFSlice]]:
    """(Hugging Face name, lazy slice) pairs of a GGUF file. `config` is the converted
    config.json (its head counts undo the q and k order of a Llama)."""
    reader = _reader(path)
    permuted = config.get("model_type") in ("llama", "mistral")
    heads = {"q_proj": config["num_attention_heads"],
             "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        proj = name.split(".")[-2]
        num_heads = heads.get(proj) if permuted and name.endswith(".weight") else None
        yield name, GGUFSlice(tensor, num_heads)
