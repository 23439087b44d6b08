"""Batched sampling on rank 0: one row of logits per request that needs a token.

Order as TGI (and transformers' logits processors): TGI's watermark, OpenAI's logit_bias
(before the penalties, as vLLM's logits processors come before its penalties),
vLLM's allowed_token_ids and bad_words (masks, as vLLM applies them before penalties),
min_tokens' hold on the end tokens, repetition penalty, frequency and presence
penalties, then temperature, top-k, top-p, min-p, typical-p. Greedy rows take the argmax
after the bias and penalties. Each sampled row draws from its own generator seeded by
(request seed, output position), so a seeded request gives the same text whatever else
is in the batch and after preemption. Logprobs are TGI's: log-softmax of the processed
scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    position: int  # index of the output token being drawn
    token_ids: list[int]  # prompt + output so far, for penalties
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def sample(logits: torch.Tensor, rows: list[SampleRow],
           eos_token_ids: frozenset[int] = frozenset()) -> SampleResult:
    scores = logits.float()
    if any(r.params.watermark for r in rows):
        scores = _watermark(scores, rows)
    if any(r.params.logit_bias for r in rows):
        scores = _apply_logit_bias(scores, rows)
    if any(r.params.allowed_token_ids or r.params.bad_words for r in rows):
        scores = _restrict(scores, rows)
    if any(r.position < r.params.min_tokens for r in rows):
        scores = _hold_ends(scores, rows, eos_token_ids)
    if any(r.params.has_penalties for r in rows):
        scores = _apply_penalties(scores, rows)
    temps = [r.params.temperature for r in rows]
    sampled = [i for i, t in enumerate(temps) if t > 0]
    tokens = scores.argmax(dim=-1)
    if sampled:
        idx = torch.tensor(sampled, device=scores.device)
        warped = _warp(scores[idx], [rows[i].params for i in sampled])
        scores = scores.index_copy(0, idx, warped)
        probs = warped.softmax(dim=-1)
        for j, i in enumerate(sampled):
            gen = torch.Generator(device=scores.device)
            gen.manual_seed(_mix(rows[i].seed, rows[i].position))
            # Exponential race: argmax p / E with E ~ Exp(1) draws from p.
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            tokens[i] = (probs[j] / noise).argmax()
    logprobs = scores.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_n = max(r.params.top_n_tokens for r in rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if top_n:
        values, ids = logprobs.topk(top_n, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, r in enumerate(rows):
            n = r.params.top_n_tokens
            top[i] = list(zip(ids[i][:n], values[i][:n], strict=True))
    return SampleResult(tokens.tolist(), chosen.tolist(), top)


def _mix(seed: int, position: int) -> int:
    return hash((seed, position)) & 0x7FFF_FFFF_FFFF_FFFF


# TGI's watermark: the green list's share of the vocabulary, its logit bonus, and the
# prime that seeds the list's draw from the previous token (TGI's WATERMARK_GAMMA and
# WATERMARK_DELTA defaults; transformers' WatermarkingConfig with seeding_scheme="lefthash"
# and context_width=1 draws the same list).
WATERMARK_GAMMA, WATERMARK_DELTA, WATERMARK_KEY = 0.5, 2.0, 15485863


def _watermark(scores: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Kirchenbauer et al.'s green list: a permutation of the vocabulary drawn by a CPU
    generator seeded with the previous token, its first half raised by WATERMARK_DELTA.
    Drawn on the CPU on every device, so a text's list is the same wherever it ran."""
    scores = scores.clone()
    width = scores.shape[1]
    gen = torch.Generator()
    for i, r in enumerate(rows):
        if r.params.watermark:
            gen.manual_seed(WATERMARK_KEY * r.token_ids[-1])
            green = torch.randperm(width, generator=gen)[:int(width * WATERMARK_GAMMA)]
            scores[i, green.to(scores.device)] += WATERMARK_DELTA
    return scores


def _apply_logit_bias(scores: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    scores = scores.clone()
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids, values = zip(*r.params.logit_bias, strict=True)
            scores[i, list(ids)] += torch.tensor(values, dtype=scores.dtype,
                                                 device=scores.device)
    return scores


def _restrict(scores: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's allowed_token_ids (every other token masked) and bad_words (a word's last token
    masked where the output so far, not the prompt, ends with the rest of the word)."""
    scores = scores.clone()
    width = scores.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < width],
                                device=scores.device, dtype=torch.long)
            row = torch.full_like(scores[i], float("-inf"))
            row[keep] = scores[i, keep]
            scores[i] = row
        if p.bad_words:
            drawn = len(r.token_ids) - r.num_prompt_tokens  # a word's rest: output only
            banned = [w[-1] for w in p.bad_words if w[-1] < width and len(w) - 1 <= drawn
                      and tuple(r.token_ids[len(r.token_ids) - len(w) + 1:]) == w[:-1]]
            if banned:
                scores[i, banned] = float("-inf")
    return scores


def _hold_ends(scores: torch.Tensor, rows: list[SampleRow],
               eos_token_ids: frozenset[int]) -> torch.Tensor:
    """min_tokens: a row that draws one of a request's first min_tokens tokens cannot draw
    what would end it (its stop tokens, and end-of-sequence unless it ignores it)."""
    scores = scores.clone()
    for i, r in enumerate(rows):
        if r.position < r.params.min_tokens:
            ends = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ends |= eos_token_ids
            ends = [t for t in ends if t < scores.shape[1]]
            if ends:
                scores[i, ends] = float("-inf")
    return scores


def _apply_penalties(scores: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    scores = scores.clone()
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), device=scores.device)
            s = scores[i, seen]
            scores[i, seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = r.token_ids[r.num_prompt_tokens :]
            if out:
                counts = torch.bincount(torch.tensor(out, device=scores.device),
                                        minlength=scores.shape[1]).to(scores.dtype)
                scores[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return scores


def _warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, typical-p; removed tokens get -inf."""
    device = scores.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=scores.dtype)
    scores = scores / temps.unsqueeze(1)
    if any(p.top_k for p in params):
        k = torch.tensor([p.top_k or scores.shape[1] for p in params], device=device)
        k = k.clamp(max=scores.shape[1])
        kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=scores.dtype)
        sorted_scores, order = scores.sort(dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p).unsqueeze(1)
        remove[:, -1] = False  # keep at least the best token
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=scores.dtype)
        probs = scores.softmax(dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        # The top token always stays (transformers' min_tokens_to_keep=1).
        remove = (probs < floor).scatter(1, scores.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, float("-inf"))
    if any(p.typical_p < 1.0 for p in params):
        scores = _typical(scores, params)
    return scores


def _typical(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Locally typical sampling: keep the tokens whose surprisal is closest to the
    entropy, up to mass typical_p (as transformers' TypicalLogitsWarper)."""
    mass = torch.tensor([p.typical_p for p in params], device=scores.device, dtype=scores.dtype)
    logp = scores.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(torch.nan_to_num(logp) * p).sum(dim=-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shift, order = shifted.sort(dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass.unsqueeze(1)).sum(dim=1).clamp(max=scores.shape[1] - 1)
    remove = sorted_shift > sorted_shift.gather(1, last.unsqueeze(1))
    remove = remove.scatter(1, order, remove)
    keep_all = (mass >= 1.0).unsqueeze(1)
    return scores.masked_fill(remove & ~keep_all, float("-inf"))
