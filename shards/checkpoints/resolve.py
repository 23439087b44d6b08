"""What `model=` names, made into a directory every loader reads the same way.

A Hugging Face directory (config.json, tokenizer files, safetensors) is used as it is. A
GGUF file (or a directory holding exactly one, and no config.json) is served as given:
its config, tokenizer and chat template are converted once per node by transformers' GGUF
support into a directory under the cache (`~/.cache/raygen/gguf`, `$RAYGEN_GGUF_CACHE`),
which links back to the file; the weights stay in the file and each rank dequantizes
(the `gguf` package) only the rows it keeps, to the serving dtype. Converting the
tokenizer costs about 10 s here, and an ingress, a batcher and a grammar checker each
load it, so it is done once rather than at every start.

Anything wrong with the checkpoint raises CheckpointError with one line naming the path
and the reason; the app builder checks before Ray starts (deployments/app.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_LINK = "model.gguf"  # in a converted directory: the file its weights are read from
# Part of the cache key: a directory converted by older code (before the file's own special
# tokens won, 2; before its add_bos_token and raw decoding, 3) is converted again rather
# than served with what that code got wrong.
CONVERSION_VERSION = 3


class CheckpointError(ValueError):
    """A model path that cannot be served, said in one line."""


def gguf_cache_root() -> Path:
    return Path(os.environ.get("RAYGEN_GGUF_CACHE", "~/.cache/raygen/gguf")).expanduser()


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a file, or a directory with exactly one and no
    config.json); None for a Hugging Face directory. Raises CheckpointError for a path
    that is neither."""
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"model={model}: no such file or directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"model={model}: not a .gguf file; give a GGUF file or a "
                                  "Hugging Face model directory")
        return path
    if (path / "config.json").exists():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise CheckpointError(f"model={model}: holds {len(ggufs)} .gguf files ({names}); "
                              "name one of them")
    raise CheckpointError(f"model={model}: holds no checkpoint (no config.json and no "
                          ".gguf file)")


@functools.cache
def model_dir(model: str) -> str:
    """The directory to read config, tokenizer and weights from: `model` itself, or the
    converted directory of its GGUF file (made here the first time on this node)."""
    gguf_path = find_gguf(model)
    if gguf_path is None:
        return str(Path(model).expanduser())
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    identity = f"{CONVERSION_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    out = gguf_cache_root() / f"{gguf_path.stem}-{key[:12]}"
    if not (out / GGUF_LINK).exists():
        _convert(gguf_path, out)
    return str(out)


def load_tokenizer(model: str, without_torch: bool = False):
    """`model`'s tokenizer. `without_torch`, for a process that never runs the model (the
    ingress and batcher replicas): transformers is then imported with torch turned off,
    which saves the 3-4 s of a core that importing torch costs at each replica start.
    Honoured only where neither is imported yet, and after a GGUF file's conversion,
    which needs both (it runs here first when this node has not converted the file)."""
    directory = model_dir(model)
    if without_torch and "transformers" not in sys.modules and "torch" not in sys.modules:
        os.environ["USE_TORCH"] = "0"
        # Its advice that no framework was found: a tokenizer needs none.
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def gguf_file(directory: str | Path) -> Path | None:
    """The GGUF file a converted directory reads its weights from, else None."""
    link = Path(directory) / GGUF_LINK
    return link if link.exists() else None


def _convert(gguf_path: Path, out: Path) -> None:
    """Config, generation config and tokenizer of a GGUF file, written next to a link to
    it. Written in a temporary directory and renamed, so that processes converting the
    same file at once (an ingress and a batcher starting together) never see half of it."""
    from transformers import AutoConfig, AutoTokenizer

    from shards.checkpoints.gguf_weights import check_tensor_types, tokenizer_flags

    check_tensor_types(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # Given the config, the tokenizer does not read it from the file again: each read
        # parses every field of the file, its vocabulary included (5-6 s for SmolLM2's).
        # `legacy` as transformers defaults it for a Llama tokenizer, said so that it does not
        # log a warning about the default (which asks GGUF users to ignore it).
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, config=config,
                                                  legacy=True)
    except Exception as exc:  # transformers names what it cannot read
        raise CheckpointError(f"model={gguf_path}: transformers cannot read its config or "
                              f"tokenizer: {str(exc).splitlines()[0][:300]}") from exc
    # transformers' converter can name the wrong special tokens (SmolLM2's file says eos 2,
    # <|im_end|>, and the converted tokenizer said <|im_start|>): the file's ids win, since
    # grammars end on the tokenizer's EOS and generation stops on the config's.
    for role in ("bos", "eos"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # Its converter also adds a BOS to every text whatever the file says (SmolLM2's says
    # no: a completion's prompt got <|im_start|> first, which llama.cpp and the original
    # tokenizer never add), and tidies spaces before punctuation when decoding, which
    # llama.cpp never does. The file's flags win, and text decodes as it was drawn.
    for name, value in tokenizer_flags(gguf_path).items():
        if hasattr(tokenizer, name):
            setattr(tokenizer, name, value)
    tokenizer.clean_up_tokenization_spaces = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id")
                      if getattr(config, k, None) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation))
        (tmp / GGUF_LINK).symlink_to(gguf_path)
        if out.exists() and not (out / GGUF_LINK).exists():  # left half-made by a crash
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its directory is the same
            if not (out / GGUF_LINK).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    return files
