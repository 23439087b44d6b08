"""bfloat16 on CPU: the weight products in bfloat16 through oneDNN (fp32 accumulation),
everything else in float32, measured against the float32 model on real weights; on a CPU
without native bf16 products (AVX2), bfloat16 in torch throughout."""

from __future__ import annotations

import pytest
import torch

from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from shards.worker.model_runner import cpu_bf16_products
from shards.worker.weight_plan import BF16_MAX_ROWS
from tests.reference import make_prompts, smollm2_gguf
from tests.shards.test_quant import TEXT


@pytest.mark.skipif(not cpu_bf16_products(),
                    reason="oneDNN has no native bfloat16 products on this CPU")
def test_bfloat16_weights_score_real_text_close_to_float32():
    """Teacher-forced logprobs of a fixed text, and a greedy chat answer. Measured on
    SmolLM2-135M (the shipped Q4_1 file's weights) on an Intel Xeon: mean |difference|
    0.0057, max 0.065 over 255 tokens with the prompt's step in float32 on the widened
    weights (0.018 and 0.099 with it in oneDNN's bfloat16), the greedy answer and a
    48-token continuation the same (benchmarks/NOTES.md 56); the bounds leave 2-3x."""
    model = str(smollm2_gguf())
    scored, runners, answers = {}, {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model, num_blocks=64, dtype=dtype)
        runners[dtype] = llm.runner
        ids = llm.tokenizer(TEXT).input_ids[:256]
        scored[dtype] = llm.generate([ids], SamplingParams(max_new_tokens=1,
                                                           prompt_logprobs=True))[0]
        chat = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True)
        answers[dtype] = llm.generate([chat], SamplingParams(max_new_tokens=16))[0].text
    bf16 = runners["bfloat16"]
    assert (bf16.weight_dtype, bf16.dtype, bf16.backend.name) == (torch.bfloat16,
                                                                  torch.float32, "cpu")
    a, b = scored["float32"].prompt_logprobs[1:], scored["bfloat16"].prompt_logprobs[1:]
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / len(diffs)
    assert 0 < mean < 0.05 and max(diffs) < 0.3, (mean, max(diffs))
    assert answers["bfloat16"] == answers["float32"]
    assert bf16.weights.weight_copy in (None, "float32, widened from bfloat16")  # as timed
    # raygen's bfloat16 lanes serve the small steps the timings gave them, never past
    # BF16_MAX_ROWS where oneDNN multiplies bfloat16 (the same bytes read either way).
    rows = bf16.weights.quant_rows_by_kind
    assert rows and all(k.endswith(" BF16") for k in rows), rows
    assert max(rows.values()) <= BF16_MAX_ROWS, rows  # 0 where timed slower (a busy start)
    assert answers["float32"].startswith("The capital of France is Paris")


def no_native_bf16(monkeypatch) -> None:
    """As on this repository's AMD EPYC (AVX2), where oneDNN refuses bfloat16 weights."""
    from shards.cpu import layouts
    from shards.worker import model_runner

    for module in (layouts, model_runner):
        monkeypatch.setattr(module, "cpu_bf16_products", lambda: False)


def test_bfloat16_without_native_products_multiplies_bf16_weights_in_the_block_kernel(
        llama_dir, monkeypatch):
    """Few-row steps through raygen's kernel on the bfloat16 weights, the bigger ones on
    float32 copies of them, the rest float32: the float32 model on bf16-rounded weights,
    token for token. Where the kernel has vdpbf16ps, its steps of `bf16_dot_min_rows` rows
    and more take x rounded to bfloat16 (test_quant checks those products, the real-text
    test above their answers): here the kernel serves fewer rows than that, else whether a
    near tie flips would hang on which steps the start-up timings gave it (logprobs move
    by 1e-3 with x rounded; one tie here is 7.8e-4 apart)."""
    from transformers import AutoModelForCausalLM

    from shards.cpu import kernels
    from shards.worker import weight_plan

    if not weight_plan.bf16_block_kernel("auto"):
        pytest.skip("raygen's CPU kernels are not built for this CPU")
    dot_rows = kernels.load().bf16_dot_min_rows()
    if dot_rows:
        monkeypatch.setattr(weight_plan, "QUANT_TIMED_ROWS",
                            tuple(r for r in weight_plan.QUANT_TIMED_ROWS if r < dot_rows))
    no_native_bf16(monkeypatch)
    llm = LLM(llama_dir, num_blocks=256, dtype="bfloat16", max_batch_prefill_tokens=64)
    runner = llm.runner
    assert (runner.weight_dtype, runner.dtype, runner.weights.matmul) == \
        (torch.bfloat16, torch.float32, "onednn")
    assert runner.weights.quant_types["BF16"] > 0  # each linear of whole blocks of 32
    assert runner.weights.quant_rows >= 1  # the kernel serves the one-row steps at least
    # The reference: float32, with the linears' weights (the head's too, untied from the
    # embedding, which raygen keeps in float32 for its lookups) rounded to bfloat16.
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().bfloat16().float(),
                                               requires_grad=False)
    prompts = make_prompts(runner.model_config.vocab_size, [3, 17, 70, 150], seed=6)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt)))
        assert out.token_ids == ref[0, len(prompt):].tolist(), len(prompt)


def test_bfloat16_without_native_products_or_kernels_runs_in_torch(llama_dir, monkeypatch):
    """Without raygen's kernels either (attention_backend=torch here), bfloat16 runs in
    torch throughout, and follows transformers in bfloat16 (the first tokens and their
    log-probabilities; half-precision near-ties may flip a later one)."""
    from transformers import AutoModelForCausalLM

    no_native_bf16(monkeypatch)
    llm = LLM(llama_dir, num_blocks=64, dtype="bfloat16", attention_backend="torch")
    runner = llm.runner
    assert (runner.dtype, runner.weights.matmul, runner.backend.name) == \
        (torch.bfloat16, "torch", "torch")
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).eval()
    prompts = make_prompts(runner.model_config.vocab_size, [5, 40], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, top_n_tokens=1))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(prompt)))
        tokens = ref.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                    for s, t in zip(ref.scores, tokens, strict=True)]
        assert out.token_ids[:4] == tokens[:4]
        torch.testing.assert_close(torch.tensor(out.logprobs[:4]), torch.tensor(logprobs[:4]),
                                   rtol=0, atol=0.05)
