"""Multi-step decoding in the shard (num_scheduler_steps): decode steps run back to back,
each fed the tokens the one before it drew, give transformers' tokens; a request leaves
them at its stop token; a cut ends them after the step running."""

from __future__ import annotations

import pytest

from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from tests.reference import PARITY_LENGTHS, PARITY_NEW_TOKENS, hf_greedy, make_prompts


class Recording:
    """The shard, with each step's number of steps and rows per request recorded, and
    the multi-steps listed in `cut` cut short (by their order, from 0) before they run."""

    def __init__(self, runner, cut=()):
        self.runner, self.cut = runner, set(cut)
        self.steps: list[tuple[int, dict[str, int]]] = []

    def step(self, step_input):
        if step_input.num_steps > 1:
            if sum(n > 1 for n, _ in self.steps) in self.cut:
                self.runner.cut_short()
        output = self.runner.step(step_input)
        rows: dict[str, int] = {}
        for request_id in output.request_ids if output else ():
            rows[request_id] = rows.get(request_id, 0) + 1
        self.steps.append((step_input.num_steps, rows))
        return output


def run(llm: LLM, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params[i])
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            got[out.request_id].extend(out.token_ids)
        llm.engine.scheduler.check_integrity()
    return got


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(2048, PARITY_LENGTHS, seed=1)


def test_multi_steps_give_transformers_tokens_and_a_cut_ends_them_early(llama_dir, prompts):
    llm = LLM(llama_dir, num_blocks=256, num_scheduler_steps=4)
    shard = llm.engine.worker = Recording(llm.runner, cut=[1])
    params = [SamplingParams(max_new_tokens=n) for n in PARITY_NEW_TOKENS]
    got = run(llm, prompts, params)
    assert got == {f"r{i}": hf_greedy(llama_dir, p, n) for i, (p, n)
                   in enumerate(zip(prompts, PARITY_NEW_TOKENS, strict=True))}
    multi = [rows for n, rows in shard.steps if n > 1]
    assert len(multi) >= 2 and max(max(rows.values()) for rows in multi) == 4
    assert set(multi[1].values()) == {1}  # cut short: one step, every request in it
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_a_request_leaves_the_multi_step_at_its_stop_token(llama_dir, prompts):
    reference = hf_greedy(llama_dir, prompts[0], 12)
    stop = reference[5]
    first = reference.index(stop)
    llm = LLM(llama_dir, num_blocks=256, num_scheduler_steps=8)
    shard = llm.engine.worker = Recording(llm.runner)
    got = run(llm, prompts[:2], [SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)),
                                 SamplingParams(max_new_tokens=12, ignore_eos=True)])
    assert got["r0"] == reference[: first + 1]
    # The shard drew nothing for it past its stop token; the other request went on.
    assert sum(rows.get("r0", 0) for _, rows in shard.steps) == first + 1
    assert len(got["r1"]) == 12 and any(n == 8 for n, _ in shard.steps)
    # min_tokens past its first place: each step inside a multi-step holds it until the
    # count, as single steps do
    held = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), min_tokens=first + 2)
    single = LLM(llama_dir, num_blocks=256).generate([prompts[0]], held)[0].token_ids
    assert run(llm, prompts[:1], [held])["r0"] == single
    assert len(single) > first + 1 and stop not in single[:first + 2]


def test_sampled_and_scored_tokens_equal_one_step_at_a_time(llama_dir, prompts):
    """Seeded sampling, penalties and logprobs depend on the tokens before: the shard
    feeds each step's draws into the next exactly as single steps do."""
    params = [SamplingParams(max_new_tokens=14, temperature=0.9, top_k=30, seed=7 + i,
                             repetition_penalty=1.3, top_n_tokens=2) for i in range(4)]
    outputs = {}
    for k in (1, 5):
        llm = LLM(llama_dir, num_blocks=256, num_scheduler_steps=k)
        outputs[k] = llm.generate([llm.tokenizer.decode(p) for p in prompts[:4]], params)
    for single, multi in zip(outputs[1], outputs[5], strict=True):
        assert multi.token_ids == single.token_ids and len(multi.token_ids) == 14
        assert multi.logprobs == pytest.approx(single.logprobs, abs=1e-5)
        assert multi.top_logprobs == single.top_logprobs
