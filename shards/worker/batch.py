"""A step's batch on a rank: its rows from the scheduled tokens, the attention's view of
them, and its sampled rows made into the step's output (rank 0's), drafts kept up to the
first one that differs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.messages import PromptScores, StepOutput
from shards.model.attention import AttentionMetadata, PrefillSeq
from shards.model.grammar import Grammars
from shards.model.sampler import SampleRow, sample

# A row whose every token a request's own rules masked (allowed_token_ids, a bad word that
# its output so far completes, min_tokens' hold on the end tokens): the request cannot go on.
NOTHING_LEFT = ("no token may be drawn at output position {}: allowed_token_ids, bad_words "
                "and min_tokens together forbid every token there")


def metadata(backend, dev: torch.device, decodes, prefills, num_tokens: int,
             slots: list[int] | None = None) -> AttentionMetadata:
    """The attention's view of a step's rows: `decodes` as (sequence length, block ids),
    then `prefills` as (first row, end row, tokens cached before, block ids). Prefill
    chunks right after the decodes that the backend takes as decode rows
    (`prefill_as_decodes_max_tokens`) become one decode row a token."""
    if slots is None:
        slots = list(range(num_tokens))
    most, decodes = backend.prefill_as_decodes_max_tokens, list(decodes)
    while most and prefills:
        start, end, cached, blocks = prefills[0]
        if start != len(decodes) or cached + end - start > most:
            break
        decodes += [(cached + i + 1, blocks) for i in range(end - start)]
        prefills = prefills[1:]
    width = max((len(b) for _, b in decodes), default=0)
    tables = torch.tensor([b + [0] * (width - len(b)) for _, b in decodes] or [[0]],
                          dtype=torch.long, device=dev)[: len(decodes)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        num_decodes=len(decodes),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor([n for n, _ in decodes], dtype=torch.long, device=dev),
        prefills=[PrefillSeq(s, e, c, torch.tensor(b, dtype=torch.long, device=dev))
                  for s, e, c, b in prefills],
    )
    if backend.needs_varlen_metadata:
        add_varlen(meta, decodes, prefills, dev)
    return meta


@dataclass(frozen=True, slots=True)
class Sample:
    """A row that draws a token: the request's next one, or the one after a draft
    (`draft`: the draft token at this row's position, which the drawn token must equal for
    the request's next row to count)."""

    request_id: str
    logit_row: int
    row: SampleRow
    draft: int | None = None


@dataclass(slots=True)
class StepRows:
    """A step's rows, in the order the forward takes them (decodes first)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each row's KV cache slot
    decodes: list[tuple[int, list[int]]] = field(default_factory=list)  # (length, blocks)
    # (first row, end row, tokens cached before, block ids)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    lora_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, first, end)
    logit_rows: list[int] = field(default_factory=list)  # hidden rows that need logits
    samples: list[Sample] = field(default_factory=list)
    # request -> (its first row among the logits, the position of that row, the prompt
    # tokens those rows predict, how many alternatives to return with each, and whether
    # their ranks)
    prompt_rows: dict[str, tuple[int, int, list[int], int, bool]] = field(default_factory=dict)


def step_rows(seqs: dict, num_scheduled_tokens: dict[str, int],
              draft_token_ids: dict[str, list[int]], block_size: int) -> StepRows:
    """The rows of the requests' scheduled tokens, each request's from where its rank's
    copy (`seqs`, model_runner._Seq) says it stands, which this moves past them."""
    # Decodes first (drafting ones too): the attention backend handles them as one
    # batched call.
    order = sorted(num_scheduled_tokens, key=lambda r: (num_scheduled_tokens[r] != 1
                                                        and r not in draft_token_ids))
    rows = StepRows()
    for request_id in order:
        seq = seqs[request_id]
        n = num_scheduled_tokens[request_id]
        draft = draft_token_ids.get(request_id, [])
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        row0 = len(rows.input_ids)
        if seq.lora_slot:
            rows.lora_runs.append((seq.lora_slot, row0, row0 + n))
        rows.input_ids.extend(seq.token_ids[start:end - len(draft)])
        rows.input_ids.extend(draft)
        rows.positions.extend(range(start, end))
        rows.slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size
                          for p in range(start, end))
        if n == 1 or draft:
            # A decode; with drafts, each of its rows attends as a decode of its own (the
            # cache up to its position, its own new key included): one batched call, where
            # a chunk of its own cost a call per layer and request (benchmarks/NOTES.md 69).
            rows.decodes.extend((p + 1, seq.block_ids) for p in range(start, end))
        else:
            rows.prefills.append((row0, row0 + n, start,
                                  seq.block_ids[: -(-end // block_size)]))
        if seq.params.prompt_logprobs and start < seq.num_prompt_tokens - 1:
            count = min(end, seq.num_prompt_tokens - 1) - start
            rows.prompt_rows[request_id] = (len(rows.logit_rows), start,
                                            seq.token_ids[start + 1 : start + 1 + count],
                                            seq.params.prompt_top_n_tokens,
                                            seq.params.prompt_ranks)
            rows.logit_rows.extend(range(row0, row0 + count))
        if end - len(draft) == len(seq.token_ids):
            # One row per token to draw: after the known tokens, then after each draft
            # (kept only while the drafts before it match what was drawn).
            for j in range(len(draft) + 1):
                known = seq.token_ids + draft[:j] if j else seq.token_ids
                row = SampleRow(seq.params, seq.seed, len(known) - seq.num_prompt_tokens,
                                known, seq.num_prompt_tokens)
                rows.samples.append(Sample(request_id, len(rows.logit_rows), row,
                                           draft[j] if j < len(draft) else None))
                rows.logit_rows.append(row0 + n - 1 - len(draft) + j)
        seq.num_computed_tokens = end
    return rows


def make_output(logits: torch.Tensor | None, samples: list[Sample],
                 prompt_rows: dict[str, tuple[int, int, list[int], int, bool]],
                 grammars: Grammars | None,
                 eos_token_ids: frozenset[int] = frozenset()) -> tuple[StepOutput, list[int]]:
    """Rank 0's output, and per sample row the token kept (-1: dropped, after a draft
    that differed from what was drawn)."""
    if logits is None:
        return StepOutput([], [], [], []), []
    errors: dict[str, str] = {}
    result = None
    kept: list[int] = []
    if samples:
        rows = logits[[s.logit_row for s in samples]]
        if grammars is not None:
            errors = grammars.mask(rows, [s.request_id for s in samples],
                                   [s.draft for s in samples])
        result = sample(rows, [s.row for s in samples], eos_token_ids)
        # A drafting request keeps its rows up to the first draft that differs from what
        # was drawn there; what is drawn is what decoding without drafts would draw.
        failed: set[str] = set()
        for s, token, logprob in zip(samples, result.token_ids, result.logprobs, strict=True):
            if s.request_id in failed or s.request_id in errors:
                kept.append(-1)
                continue
            if math.isnan(logprob):  # every token masked: nothing may be drawn here
                errors[s.request_id] = NOTHING_LEFT.format(s.row.position)
                kept.append(-1)
                continue
            kept.append(token)
            if s.draft is not None and token != s.draft:
                failed.add(s.request_id)
        if grammars is not None:
            errors |= grammars.advance([(s.request_id, token) for s, token
                                        in zip(samples, kept, strict=True)
                                        if token >= 0 and s.request_id not in errors])
    prompt_logprobs = {request_id: score_prompt(logits, *scored)
                       for request_id, scored in prompt_rows.items()}
    if result is None:
        return StepOutput([], [], [], [], prompt_logprobs), kept
    keep = [i for i, token in enumerate(kept) if token >= 0]
    return StepOutput([samples[i].request_id for i in keep], [kept[i] for i in keep],
                      [result.logprobs[i] for i in keep],
                      [result.top_logprobs[i] for i in keep], prompt_logprobs, errors), kept


def argmax_only(samples: list[Sample], prompt_rows: dict) -> bool:
    """Whether a step needs of its logits only the argmax of each sampled row (no prompt
    to score, every row `SamplingParams.argmax_only` and past min_tokens' hold)."""
    return (bool(samples) and not prompt_rows
            and all(s.row.params.argmax_only and s.row.position >= s.row.params.min_tokens
                    for s in samples))


def greedy_output(tokens: list[int], samples: list[Sample]) -> tuple[StepOutput, list[int]]:
    """make_output for a step of `argmax_only` rows whose tokens were drawn already:
    logprobs NaN (not asked for), drafts kept as make_output keeps them."""
    kept: list[int] = []
    failed: set[str] = set()
    for s, token in zip(samples, tokens, strict=True):
        if s.request_id in failed:
            kept.append(-1)
            continue
        kept.append(token)
        if s.draft is not None and token != s.draft:
            failed.add(s.request_id)
    keep = [i for i, token in enumerate(kept) if token >= 0]
    return StepOutput([samples[i].request_id for i in keep], [kept[i] for i in keep],
                      [math.nan] * len(keep), [[] for _ in keep]), kept


def score_prompt(logits: torch.Tensor, first: int, start: int, targets: list[int],
                 top_n: int, ranks: bool) -> PromptScores:
    """A request's prompt rows (from logit row `first`, position `start`): each next
    prompt token's logprob, the `top_n` best tokens there (ties as topk orders them), and
    with `ranks` the token's rank (1 + the tokens more likely)."""
    logp = logits[first : first + len(targets)].float().log_softmax(dim=-1)
    target_ids = torch.tensor(targets, device=logits.device).unsqueeze(1)
    chosen = logp.gather(1, target_ids)
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n:
        values, ids = logp.topk(top_n, dim=-1)
        top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                              strict=True)]
    rank = ((logp > chosen).sum(dim=-1) + 1).tolist() if ranks else []
    return PromptScores(start, chosen.squeeze(1).tolist(), top, rank)


def add_varlen(meta: AttentionMetadata, decodes, prefills, dev) -> None:
    q_lens = [1] * len(decodes) + [e - s for s, e, _, _ in prefills]
    seq_lens = [n for n, _ in decodes] + [c + e - s for s, e, c, _ in prefills]
    tables = [b for _, b in decodes] + [b for _, _, _, b in prefills]
    width = max(len(b) for b in tables)
    meta.cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=dev)
    meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    meta.block_tables = torch.tensor([b + [0] * (width - len(b)) for b in tables],
                                     dtype=torch.int32, device=dev)
    meta.max_seqlen_q = max(q_lens)
    meta.max_seqlen_k = max(seq_lens)
