"""The shard on CUDA (skipped without it): greedy output against transformers on the same
GPU, the KV cache sized from the GPU's free memory, seeded sampling reproducible. The
flash backend's own check is in test_attention_backends.py."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.reference import PARITY_LENGTHS, PARITY_NEW_TOKENS, make_prompts

pytestmark = pytest.mark.gpu


def hf_greedy_on(model_dir: str, dtype: torch.dtype, prompt_ids: list[int], n: int):
    """transformers' greedy tokens on the GPU, and the log-probability of each."""
    model = _hf(model_dir, dtype)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device="cuda"), max_new_tokens=n,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt_ids), device="cuda"))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


_models: dict = {}


def _hf(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype)
    if key not in _models:
        _models[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    return _models[key]


def _llm(model_dir, dtype, **kw):
    from deployments.offline import LLM

    # A prefill budget smaller than the longest prompt: chunked prefill runs on the GPU too.
    # A small share of the card: a tiny model would get millions of blocks from the default.
    return LLM(model_dir, device="cuda", dtype=dtype, max_batch_prefill_tokens=64,
               gpu_memory_utilization=0.02, **kw)


def test_float32_greedy_equals_transformers_on_the_gpu(llama_dir):
    llm = _llm(llama_dir, "float32")
    assert llm.runner.device.type == "cuda"
    prompts = make_prompts(llm.runner.model_config.vocab_size, PARITY_LENGTHS, seed=3)
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n) for n in PARITY_NEW_TOKENS])
    for prompt, n, out in zip(prompts, PARITY_NEW_TOKENS, outs, strict=True):
        assert out.token_ids == hf_greedy_on(llama_dir, torch.float32, prompt, n)[0], len(prompt)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_follows_transformers_in_the_same_dtype(llama_dir, dtype):
    llm = _llm(llama_dir, dtype)
    assert llm.runner.dtype == getattr(torch, dtype)
    prompts = make_prompts(llm.runner.model_config.vocab_size, [5, 40, 150], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=16, top_n_tokens=1))
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_logprobs = hf_greedy_on(llama_dir, getattr(torch, dtype), prompt, 16)
        # Half-precision near-ties may flip a late token (and every one after it); the first
        # ones agree, and so do their log-probabilities.
        assert out.token_ids[:4] == ref[:4]
        torch.testing.assert_close(torch.tensor(out.logprobs[:4]), torch.tensor(ref_logprobs[:4]),
                                   rtol=0, atol=0.05)


def test_kv_cache_is_sized_from_free_gpu_memory(llama_dir):
    from deployments.offline import LLM

    share = 0.05  # a tiny model: the default 0.9 would make tens of millions of blocks
    llm = LLM(llama_dir, device="cuda", dtype="float16", gpu_memory_utilization=share)
    runner = llm.runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    others = total - torch.cuda.mem_get_info(runner.device)[0] - torch.cuda.memory_allocated()
    cache = runner.num_blocks * runner.block_bytes()
    # The share of the card, less what others hold, the weights and the activations' peak.
    assert 0.5 * (share * total - others) < cache <= share * total
    assert torch.cuda.memory_allocated(runner.device) <= share * total


def test_seeded_sampling_repeats_on_the_gpu(llama_dir):
    llm = _llm(llama_dir, "float32")
    prompts = make_prompts(llm.runner.model_config.vocab_size, [7, 30], seed=5)

    def sample(seed):
        params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95,
                                seed=seed)
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_lora_mixed_batch_equals_peft_on_the_gpu(llama_dir, tmp_path_factory):
    """The CUDA path of LoRA (the masked product over every adapter, shards/model/lora.py)
    against transformers + peft on the same GPU, in one batch with the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.reference import write_adapters

    adapters = write_adapters(llama_dir, tmp_path_factory)
    llm = _llm(llama_dir, "float32", lora_adapters=adapters)
    prompts = make_prompts(llm.runner.model_config.vocab_size, [5, 17, 33, 9, 40, 70], seed=3)
    which = [None, "alpha", "beta", "gamma", "alpha", "beta"]
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=12, adapter=a) for a in which])
    for prompt, adapter, out in zip(prompts, which, outs, strict=True):
        if adapter is None:
            expected = hf_greedy_on(llama_dir, torch.float32, prompt, 12)[0]
        else:
            base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
            model = PeftModel.from_pretrained(base, adapters[adapter]).cuda().eval()
            with torch.inference_mode():
                ids = model.generate(input_ids=torch.tensor([prompt], device="cuda"),
                                     max_new_tokens=12, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), device="cuda"))
            expected = ids[0, len(prompt):].tolist()
        assert out.token_ids == expected, adapter
