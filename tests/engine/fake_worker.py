"""A stand-in shard for scheduler tests: mirrors requests from the step diffs (checking
the diffs agree with what it already holds), 'samples' a token computed from the sequence
and keeps it, as a shard does, so runs are deterministic without a model."""

from __future__ import annotations

from engine.messages import StepInput, StepOutput


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
