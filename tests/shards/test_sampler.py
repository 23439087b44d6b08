"""Sampling: warpers agree with transformers' logits processors, sampled frequencies
follow the warped distribution, seeds are independent of the batch, logprobs agree with
transformers' scores."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from deployments.offline import LLM
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from shards.model.sampler import SampleRow, _apply_penalties, _warp, _watermark, sample
from tests.reference import hf_model, make_prompts

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.0, -0.5, -1.0, -3.0, 1.4])


def hf_warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores.clone())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.typical_p < 1:
        scores = TypicalLogitsWarper(p.typical_p)(ids, scores)
    return scores


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, typical_p=0.6),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=1.5, top_p=0.95, min_p=0.1),
]


@pytest.mark.parametrize("params", CASES)
def test_warpers_match_transformers(params):
    ours = _warp(LOGITS.unsqueeze(0), [params])
    ref = hf_warp(LOGITS.unsqueeze(0), params)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    assert torch.allclose(ours[finite], ref[finite])


def test_batched_warp_mixes_parameters_per_row():
    rows = torch.stack([LOGITS] * len(CASES))
    ours = _warp(rows, CASES)
    for i, params in enumerate(CASES):
        ref = hf_warp(LOGITS.unsqueeze(0), params)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), params


@pytest.mark.parametrize("params", CASES)
def test_sampled_frequencies_follow_the_distribution(params):
    n = 6000
    rows = [SampleRow(params, seed=s, position=0, token_ids=[1], num_prompt_tokens=1)
            for s in range(n)]
    result = sample(LOGITS.expand(n, -1), rows)
    freq = torch.bincount(torch.tensor(result.token_ids), minlength=len(LOGITS)).float() / n
    expected = hf_warp(LOGITS.unsqueeze(0), params).softmax(-1)[0]
    assert (freq - expected).abs().max() < 0.03, (freq, expected)
    assert freq[expected == 0].sum() == 0  # removed tokens never drawn


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seen = [3, 7, 7, 20, 41]
    params = SamplingParams(repetition_penalty=1.3)
    ours = _apply_penalties(logits, [SampleRow(params, 0, 0, seen, len(seen))])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits.clone())
    assert torch.allclose(ours, ref)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 10)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Prompt [1, 2]; output [2, 2, 5].
    out = _apply_penalties(logits, [SampleRow(params, 0, 3, [1, 2, 2, 2, 5], 2)])
    assert out[0, 1] == 0  # prompt-only token
    assert out[0, 2] == pytest.approx(-(0.5 * 2 + 0.25))
    assert out[0, 5] == pytest.approx(-(0.5 + 0.25))


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, num_blocks=128)


def test_seeded_request_is_independent_of_batch_composition(llm):
    prompts = make_prompts(2048, [12, 30, 5, 44, 9], seed=21)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_new_tokens=n, temperature=1.0) for n in (5, 30, 12, 18)]
    batched = llm.generate(prompts, [seeded, *others])[0].token_ids
    # Joined later, into a batch already decoding.
    for p, params in zip(prompts[1:], others, strict=True):
        llm.engine.add_request(f"bg-{id(params)}", p, params)
    llm.engine.step()
    late = llm.generate([prompts[0]], seeded)[0].token_ids
    assert alone == batched == late
    other_seed = llm.generate([prompts[0]], SamplingParams(
        max_new_tokens=24, temperature=0.9, top_p=0.95, seed=99))[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    prompts = make_prompts(2048, [7, 33], seed=22)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=20))]
    top1 = [o.token_ids for o in llm.generate(
        prompts, SamplingParams(max_new_tokens=20, temperature=1.5, top_k=1))]
    assert greedy == top1


def test_logprobs_match_transformers_scores(llm, llama_dir):
    prompt = make_prompts(2048, [25], seed=23)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, top_n_tokens=3))[0]
    with torch.inference_mode():
        ref = hf_model(llama_dir).generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_scores=True,
            return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt)))
    for i, scores in enumerate(ref.scores):
        logp = scores[0].log_softmax(-1)
        assert out.logprobs[i] == pytest.approx(logp[out.token_ids[i]].item(), abs=1e-4)
        top_ids = [t for t, _ in out.top_logprobs[i]]
        assert top_ids == logp.topk(3).indices.tolist()
        assert top_ids[0] == out.token_ids[i]


def test_prompt_logprobs_match_transformers_across_chunks(llama_dir):
    """Each prompt token's logprob, and (when asked: echo with logprobs) the best tokens
    there, equal transformers' over a prompt prefilled in chunks beside another's."""
    llm = LLM(llama_dir, num_blocks=64, max_batch_prefill_tokens=16)
    prompt, other = make_prompts(2048, [50, 29], seed=24)
    greedy = llm.generate([other], SamplingParams(max_new_tokens=8))[0].token_ids
    other = other + greedy  # its last 8 tokens are each the model's best there
    plain, top3 = llm.generate([prompt, other], [
        SamplingParams(max_new_tokens=2, prompt_logprobs=True),
        SamplingParams(max_new_tokens=2, prompt_logprobs=True, prompt_top_n_tokens=3,
                       prompt_ranks=True)])
    model = hf_model(llama_dir)
    for out, ids in ((plain, prompt), (top3, other)):
        with torch.inference_mode():
            logp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), ref, atol=1e-4)
    assert plain.prompt_top_logprobs is None
    # each token's rank: 1 + the tokens transformers finds more likely there (give or take
    # those within the two computations' difference of it)
    surely = ((logp > ref[:, None] + 1e-4).sum(-1) + 1).tolist()
    maybe = ((logp > ref[:, None] - 1e-4).sum(-1) + 1).tolist()
    assert top3.prompt_ranks[0] is None
    assert all(a <= r <= b for a, r, b in zip(surely, top3.prompt_ranks[1:], maybe, strict=True))
    assert top3.prompt_ranks[-8:] == [1] * 8 and max(top3.prompt_ranks[1:]) > 1
    assert top3.prompt_top_logprobs[0] is None and len(top3.prompt_top_logprobs) == len(other)
    for i, top in enumerate(top3.prompt_top_logprobs[1:]):
        assert [t for t, _ in top] == logp[i].topk(3).indices.tolist()
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    # Where the prompt's token is the best one, its logprob is the best one's, to the bit
    # (lm-evaluation-harness's is_greedy compares them).
    for i in range(len(other) - 8, len(other)):
        assert top3.prompt_top_logprobs[i][0] == (other[i], top3.prompt_logprobs[i])


def test_min_tokens_holds_what_would_end_the_output():
    """Rows drawing one of a request's first min_tokens tokens never draw its stop tokens
    or EOS (EOS stays with ignore_eos, which does not end on it); later rows may."""
    logits = torch.stack([LOGITS] * 4)
    held = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=(2,))
    ignoring = SamplingParams(max_new_tokens=8, min_tokens=3, ignore_eos=True)
    rows = [SampleRow(held, 1, 2, [1], 1), SampleRow(held, 1, 3, [1], 1),
            SampleRow(ignoring, 1, 0, [1], 1), SampleRow(SamplingParams(), 1, 0, [1], 1)]
    result = sample(logits, rows, eos_token_ids=frozenset({0}))
    assert result.token_ids == [1, 0, 0, 0]  # 0 (EOS) and 2 held only in the first row
    assert result.logprobs[1] == result.logprobs[3]  # an unheld row is untouched


def test_min_tokens_equals_transformers_min_new_tokens(llm, llama_dir):
    """vLLM's min_tokens against transformers' min_new_tokens on the same weights: a stop
    token (transformers' eos here) the greedy output draws early is not drawn before the
    count, and ends the output after it; a stop string is not looked for before it."""
    from shards.model.config import ModelConfig

    # A prompt whose greedy output draws, without min_tokens, its second token early and
    # then (with it held) again after the count: both sides stop there.
    prompt = make_prompts(2048, [15], seed=29)[0]
    free = llm.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    end = free.token_ids[1]
    ends = sorted({end, *ModelConfig.from_pretrained(llama_dir).eos_token_ids})
    with torch.inference_mode():
        ref = hf_model(llama_dir).generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=8, eos_token_id=ends,
            pad_token_id=ends[0], do_sample=False, attention_mask=torch.ones(1, len(prompt)))
    got = llm.generate([prompt], SamplingParams(max_new_tokens=24, min_tokens=8,
                                                stop_token_ids=(end,)))[0]
    assert got.token_ids == ref[0, len(prompt):].tolist()
    assert end not in got.token_ids[:8] and got.token_ids[-1] == end and len(got.token_ids) < 24
    assert got.finish_reason is FinishReason.STOP_SEQUENCE
    stop = llm.tokenizer.decode(free.token_ids[1:2])
    early = llm.generate([prompt], SamplingParams(max_new_tokens=24, stop=(stop,)))[0]
    held = llm.generate([prompt], SamplingParams(max_new_tokens=24, min_tokens=8,
                                                 stop=(stop,)))[0]
    assert len(early.token_ids) == 2 and 8 <= len(held.token_ids) < 24
    assert held.finish_reason is FinishReason.STOP_SEQUENCE
    assert held.token_ids == free.token_ids[:len(held.token_ids)]


def test_allowed_token_ids_and_bad_words_mask_only_their_rows():
    """vLLM's allowed_token_ids: the best allowed token greedily, only allowed ones sampled.
    Its bad_words: a one-token word never; a longer word's last token only where the output
    (not the prompt) ends with the rest of it."""
    allowed = SamplingParams(allowed_token_ids=(3, 6, 8))
    sampled = SamplingParams(temperature=2.0, allowed_token_ids=(3, 6, 8))
    banned = SamplingParams(bad_words=((0,), (4, 1)))  # 0, 1, 9: the best three
    rows = [SampleRow(allowed, 1, 0, [5], 1), SampleRow(banned, 1, 1, [5, 7], 1),
            SampleRow(banned, 1, 1, [5, 4], 1), SampleRow(banned, 1, 0, [4], 1),
            SampleRow(SamplingParams(), 1, 0, [5], 1)]
    result = sample(torch.stack([LOGITS] * 5), rows)
    # 1 after the output's 7 and after the prompt's 4, but not after the output's 4
    assert result.token_ids == [3, 1, 9, 1, 0]
    assert result.logprobs[4] == pytest.approx(sample(LOGITS[None], rows[4:]).logprobs[0])
    draws = {sample(LOGITS[None], [SampleRow(sampled, s, 0, [5], 1)]).token_ids[0]
             for s in range(60)}
    assert draws == {3, 6, 8}
    for bad, message in (({"allowed_token_ids": (-1,)}, "allowed_token_ids"),
                         ({"bad_words": ((),)}, "bad_words"),
                         ({"bad_words": ((1,),), "grammar": "x"}, "cannot be used with a grammar")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)


def test_allowed_token_ids_and_bad_words_equal_transformers(llm, llama_dir):
    """The same masks as transformers' prefix_allowed_tokens_fn and bad_words_ids on the same
    weights, greedy: the unconstrained output's own tokens banned, as one-token words and as
    a two-token one, and its tokens past the first few left out of the allowed set."""
    prompt = make_prompts(2048, [12], seed=31)[0]
    free = llm.generate([prompt], SamplingParams(max_new_tokens=16))[0].token_ids
    model = hf_model(llama_dir)

    def hf(**kwargs):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt)), **kwargs)
        return out[0, len(prompt):].tolist()

    words = ((free[2],), (free[4], free[5]))
    assert prompt[-1] != free[4]  # transformers also looks at the prompt: not needed here
    got = llm.generate([prompt], SamplingParams(max_new_tokens=16, bad_words=words))[0]
    assert got.token_ids == hf(bad_words_ids=[list(w) for w in words]) != free
    assert free[2] not in got.token_ids
    keep = sorted(set(free[:3]) | set(range(100, 400)))
    got = llm.generate([prompt], SamplingParams(max_new_tokens=16,
                                                allowed_token_ids=tuple(keep)))[0]
    assert got.token_ids == hf(prefix_allowed_tokens_fn=lambda _, __: keep) != free
    assert set(got.token_ids) <= set(keep)


@pytest.mark.parametrize("steps, speculate", [(1, 0), (4, 0), (4, 2)])
def test_a_row_with_every_token_masked_fails_its_request_alone(llama_dir, steps, speculate):
    """allowed_token_ids whose every token a two-token bad word bans once the output has
    drawn one of them: the second row has nothing left to draw. That request fails and says
    why (it drew token 0 with a NaN logprob before, in single steps, multi-steps and with
    drafts alike); the plain request beside it decodes as it does alone."""
    llm = LLM(llama_dir, num_blocks=128, num_scheduler_steps=steps, speculate=speculate)
    prompt, other = make_prompts(2048, [12, 9], seed=41)
    a, b = 100, 200
    cornered = SamplingParams(max_new_tokens=8, allowed_token_ids=(a, b),
                              bad_words=((a, a), (a, b), (b, a), (b, b)))
    plain = SamplingParams(max_new_tokens=12)
    alone = llm.generate([other], plain)[0].token_ids
    llm.engine.add_request("cornered", prompt, cornered)
    llm.engine.add_request("plain", other, plain)
    outputs: dict[str, list] = {"cornered": [], "plain": []}
    while not all(o and o[-1].finished for o in outputs.values()):
        for output in llm.engine.step():
            outputs[output.request_id].append(output)
    last = outputs["cornered"][-1]
    assert last.finish_reason == FinishReason.ERROR
    assert "no token may be drawn at output position 1" in last.error
    drawn = [t for o in outputs["cornered"] for t in o.token_ids]
    assert len(drawn) <= 1 and set(drawn) <= {a, b}
    assert [t for o in outputs["plain"] for t in o.token_ids] == alone


def test_logit_bias_is_added_first_and_only_to_its_row():
    """OpenAI's logit_bias: +100 makes a token the greedy and the sampled choice, -100 takes
    the argmax away; rows without a bias in the same batch are untouched."""
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    up = SamplingParams(logit_bias=((8, 100.0),))
    down = SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))
    rows = [SampleRow(p, seed=3, position=0, token_ids=[1], num_prompt_tokens=1)
            for p in (up, down, SamplingParams())]
    result = sample(logits, rows)
    assert result.token_ids[0] == 8 and result.token_ids[2] == int(LOGITS.argmax())
    plain = sample(LOGITS[None], rows[2:])
    assert result.logprobs[2] == pytest.approx(plain.logprobs[0])
    assert result.logprobs[0] == pytest.approx(0.0, abs=1e-6)  # all the mass is on token 8
    draws = {sample(LOGITS[None], [SampleRow(down, s, 0, [1], 1)]).token_ids[0]
             for s in range(40)}
    assert 0 not in draws and len(draws) > 1
    sampled_up = SamplingParams(temperature=1.5, logit_bias=((8, 100.0),))
    assert {sample(LOGITS[None], [SampleRow(sampled_up, s, 0, [1], 1)]).token_ids[0]
            for s in range(20)} == {8}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_watermark_raises_a_green_half_drawn_from_the_previous_token_only():
    """TGI's watermark: +2 on half the vocabulary, a half that depends on the previous
    token alone; rows without it in the same batch are untouched."""
    on = SamplingParams(watermark=True)
    rows = [SampleRow(on, 1, 0, [7, 3], 2), SampleRow(on, 2, 4, [9, 1, 3], 1),
            SampleRow(on, 1, 0, [3, 7], 2), SampleRow(SamplingParams(), 1, 0, [3], 1)]
    got = _watermark(torch.zeros(4, 1000), rows)
    assert [int((row == 2.0).sum()) for row in got] == [500, 500, 500, 0]
    assert set(got.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(got[0], got[1]) and not torch.equal(got[0], got[2])


def test_watermark_equals_transformers_lefthash_watermarking(llm, llama_dir):
    """Greedy with TGI's watermark equals transformers' generate with its watermarking
    config in TGI's settings (green half, +2, the same key, seeded by the previous token),
    and differs from the unmarked output; an unmarked request beside it is untouched."""
    from transformers import WatermarkingConfig

    prompts = make_prompts(2048, [9, 14], seed=37)
    free = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=16))]
    marked = SamplingParams(max_new_tokens=16, watermark=True)
    got = llm.generate(prompts, [marked, SamplingParams(max_new_tokens=16)])
    config = WatermarkingConfig(greenlist_ratio=0.5, bias=2.0, hashing_key=15485863,
                                seeding_scheme="lefthash", context_width=1)
    with torch.inference_mode():
        ref = hf_model(llama_dir).generate(
            torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False,
            attention_mask=torch.ones(1, len(prompts[0])), watermarking_config=config)
    assert got[0].token_ids == ref[0, len(prompts[0]):].tolist() != free[0]
    assert got[1].token_ids == free[1]
