"""A stand-in shard for scheduler tests: mirrors requests from the step diffs (checking
the diffs agree with what it already holds), 'samples' a token computed from the sequence
and keeps it, as a shard does, so runs are deterministic without a model."""

from __future__ import annotations

from engine.messages import StepInput, StepOutput
from engine.speculation import SpeculationState, draft_step


def next_token(token_ids: list[int]) -> int:
    return 10 + (token_ids[-1] * 31 + len(token_ids)) % 90


class FakeWorker:
    def __init__(self, block_size: int, model=next_token):
        """`model`: the token that follows a sequence (a function of its token ids)."""
        self.block_size = block_size
        self.model = model
        self.seqs: dict[str, dict] = {}
        self.steps: list[StepInput] = []
        self.num_sampled = 0
        # Multi-steps cut short, in turn: each stops after this many of its steps (as a
        # shard asked to by ModelRunner.cut_short).
        self.cuts: list[int] = []

    def step(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        for rid in step.freed_request_ids:
            self.seqs.pop(rid, None)
        for new in step.new_requests:
            assert new.request_id not in self.seqs, "sent whole twice without being freed"
            self.seqs[new.request_id] = {"tokens": list(new.token_ids),
                                         "blocks": list(new.block_ids),
                                         "computed": new.num_computed_tokens}
        for cached in step.cached_requests:
            seq = self.seqs[cached.request_id]
            assert seq["computed"] == cached.num_computed_tokens, "mirror out of step"
            seq["blocks"].extend(cached.new_block_ids)
        if step.num_steps > 1:
            return self._multi_step(step)
        ids, tokens = [], []
        for rid, n in step.num_scheduled_tokens.items():
            seq = self.seqs[rid]
            draft = step.draft_token_ids.get(rid, [])
            seq["computed"] += n
            assert seq["computed"] <= len(seq["tokens"]) + len(draft)
            assert len(seq["blocks"]) * self.block_size >= seq["computed"], "slots without blocks"
            if seq["computed"] == len(seq["tokens"]) + len(draft):
                # Keep the drafts that match what would be drawn, then draw one more.
                for d in [*draft, None]:
                    ids.append(rid)
                    tokens.append(self.model(seq["tokens"]))
                    seq["tokens"].append(tokens[-1])  # kept, as a shard keeps what it samples
                    if tokens[-1] != d:
                        break
                if draft:  # positions past the last kept draft are computed again
                    seq["computed"] = len(seq["tokens"]) - 1
        self.num_sampled += len(ids)
        return StepOutput(ids, tokens, [0.0] * len(ids), [])

    def _multi_step(self, step: StepInput) -> StepOutput:
        """Decode steps in turn, rows step after step; each request takes part until it has
        taken its scheduled tokens. With `step.drafting`, each step drafts as a shard does
        (engine.speculation.draft_step) and keeps the drafts that match what is drawn."""
        assert not step.draft_token_ids and not step.new_requests
        ids, tokens = [], []
        left = dict(step.num_scheduled_tokens)
        drafted: dict[str, tuple[int, int]] = {}
        stop_after = self.cuts.pop(0) if self.cuts else step.num_steps
        for _ in range(min(step.num_steps, stop_after)):
            drafts = {}
            if step.drafting is not None:
                d = step.drafting
                for rid in left:
                    self.seqs[rid].setdefault("spec", SpeculationState(d.min_n, d.max_n))
                drafts = draft_step([(rid, self.seqs[rid]["spec"], self.seqs[rid]["tokens"], n)
                                     for rid, n in left.items() if n > 0],
                                    d.speculate, d.max_rows)
                assert sum(map(len, drafts.values())) <= d.max_rows
            for rid, n in left.items():
                if n <= 0:
                    continue
                seq = self.seqs[rid]
                draft = drafts.get(rid, [])
                assert len(draft) < n, "drafts past what the request may take"
                assert seq["computed"] == len(seq["tokens"]) - 1, "a multi-step row not decoding"
                assert len(seq["blocks"]) * self.block_size >= seq["computed"] + 1 + len(draft), \
                    "no blocks"
                got = 0
                for d_token in [*draft, None]:
                    ids.append(rid)
                    tokens.append(self.model(seq["tokens"]))
                    seq["tokens"].append(tokens[-1])
                    got += 1
                    if tokens[-1] != d_token:
                        break
                seq["computed"] = len(seq["tokens"]) - 1
                left[rid] -= got
                if draft:
                    seq["spec"].record(len(draft), got - 1)
                    n_drafted, n_kept = drafted.get(rid, (0, 0))
                    drafted[rid] = (n_drafted + len(draft), n_kept + got - 1)
        self.num_sampled += len(ids)
        return StepOutput(ids, tokens, [0.0] * len(ids), [], drafted=drafted)
