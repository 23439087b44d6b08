from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from shards.demo_model import write_demo_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return str(write_demo_model(tmp_path_factory.mktemp("llama"), "tiny", "llama"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return str(write_demo_model(tmp_path_factory.mktemp("qwen2"), "tiny", "qwen2"))


@pytest.fixture(scope="session")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)
