"""Prompt-lookup speculation: draft tokens found in the request's own text.

The proposer matches the last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) against earlier text of the same request, prompt and output alike,
and drafts the tokens that followed the most recent match. The step that decodes the
request checks the drafts in the same forward (shards/worker/model_runner.py); a draft is
kept only where it equals the token the request would have drawn anyway, so output is the
same with and without speculation, token for token, greedy and seeded alike.

Each request keeps an index of its n-grams (n-gram -> where its latest occurrence ends),
extended as tokens arrive, so a proposal costs a few dict lookups, not a scan.

Who drafts: the scheduler, for a step it sends alone (a batch too big to multi-step),
and the shard, before each step of a multi-step (`draft_step`): inside a multi-step only
the shard knows the tokens the steps before drew.

Whether to draft is decided per step and per request (`SpeculationState.wants_draft`):
a request whose drafts keep failing backs off for a growing number of steps, and the
scheduler drafts only while the batch is small enough that extra rows are cheap."""

from __future__ import annotations

from dataclasses import dataclass, field

# Steps a request goes without drafting after drafts that all failed: doubling from 1.
MAX_BACKOFF_STEPS = 32


@dataclass(slots=True)
class SpeculationState:
    """One request's n-gram index and its drafting record."""

    min_n: int
    max_n: int
    # n-gram -> end (exclusive) of its latest occurrence that a known token follows.
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_to: int = 0  # n-grams ending before this position are in the index
    failures: int = 0  # drafting steps in a row that kept no draft
    skip: int = 0  # steps left without drafting
    drafted: int = 0
    accepted: int = 0
    # Wait for the step in flight before the next one (the scheduler's decision): drafting
    # needs every token known.
    hold: bool = False

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        suffix that occurred before ([] when none did)."""
        if k <= 0:
            return []
        self._extend(token_ids)
        end = len(token_ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self.index.get(tuple(token_ids[end - n:]))
            if start is not None:
                return token_ids[start:start + k]
        return []

    def _extend(self, token_ids: list[int]) -> None:
        # Index the n-grams that end before the last token: their next token is known.
        last = len(token_ids) - 1
        for end in range(max(self.indexed_to, 1), last + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index[tuple(token_ids[end - n:end])] = end
        self.indexed_to = max(self.indexed_to, last + 1)

    def wants_draft(self) -> bool:
        """Whether this step may draft for the request (not while backing off)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """A drafting step's result: drafts that all failed double the back-off."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted:
            self.failures = 0
        else:
            self.failures += 1
            self.skip = min(MAX_BACKOFF_STEPS, 1 << (self.failures - 1))


def draft_step(rows: list[tuple[str, SpeculationState, list[int], int]], speculate: int,
               max_rows: int) -> dict[str, list[int]]:
    """The drafts of one step inside a multi-step (the shard drafts there: it knows every
    token, the batcher does not until the message returns). `rows`: per request its id,
    state, tokens and the most tokens it may still take; each drafts up to `speculate`,
    one fewer than it may take (the step draws one more). Then the drafts are cut to
    `max_rows` in all depth by depth, every request's first draft before any second one:
    a draft is kept only if those before it were, so earlier ones pay more often."""
    proposals: dict[str, list[int]] = {}
    for request_id, spec, token_ids, most in rows:
        k = min(speculate, most - 1)
        if k > 0 and spec.wants_draft():
            draft = spec.propose(token_ids, k)
            if draft:
                proposals[request_id] = draft
    depth = dict.fromkeys(proposals, 0)
    left = max_rows
    for level in range(speculate):
        for request_id, draft in proposals.items():
            if left and len(draft) > level:
                depth[request_id] += 1
                left -= 1
    return {r: draft[:depth[r]] for r, draft in proposals.items() if depth[r]}
