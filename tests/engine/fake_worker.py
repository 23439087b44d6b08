"""A stand-in shard for scheduler tests: mirrors requests from the step diffs (checking
the diffs agree with what it already holds), 'samples' a token computed from the sequence
and keeps it, as a shard does, so runs are deterministic without a model."""

from __future__ import annotations

from engine.messages import StepInput, StepOutput


def next_token(token_ids: list[int]) -> int:
    return 10 + (token_ids[-1] * 31 + len(token_ids)) % 90


class FakeWorker:
    def __init__(self, block_size: int):
        self.block_size = block_size
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
            seq["computed"] += n
            assert seq["computed"] <= len(seq["tokens"])
            assert len(seq["blocks"]) * self.block_size >= seq["computed"], "slots without blocks"
            if seq["computed"] == len(seq["tokens"]):
                ids.append(rid)
                tokens.append(next_token(seq["tokens"]))
                seq["tokens"].append(tokens[-1])  # kept, as a shard keeps what it samples
        self.num_sampled += len(ids)
        return StepOutput(ids, tokens, [0.0] * len(ids), [])
