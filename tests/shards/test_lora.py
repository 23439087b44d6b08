"""LoRA adapters against transformers + peft on the same adapter files, token for token, in
batches that mix the base model and several adapters; the prefix cache never shares a
block across adapters; bad adapters are refused by name."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from deployments.offline import LLM
from engine.sampling_params import SamplingParams
from shards.checkpoints.adapters import AdapterError, parse_lora_adapters, read_adapter_config
from tests.reference import ADAPTERS, hf_greedy, make_prompts, peft_greedy, write_adapters


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    return write_adapters(llama_dir, tmp_path_factory)



@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_mixed_batch_equals_transformers_and_peft_for_every_adapter(llama_dir, adapters,
                                                                      backend):
    """raygen's CPU kernels (decode rows through lora_add, where built) and the torch path
    (a masked product over every adapter: CUDA's)."""
    llm = LLM(llama_dir, num_blocks=256, lora_adapters=adapters, attention_backend=backend)
    lora = next(iter(llm.runner.adapters.lora.layers.values())).lora
    assert (lora.kernels is not None) == (backend == "cpu" and llm.runner.backend.name == "cpu")
    prompts = make_prompts(2048, [5, 17, 33, 9, 40, 3, 21, 12], seed=3)
    new_tokens = [12, 7, 10, 16, 5, 14, 9, 11]
    which = [None, "alpha", "beta", "gamma", "alpha", None, "gamma", "beta"]
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, adapter=a)
                                  for n, a in zip(new_tokens, which, strict=True)])
    for prompt, n, adapter, out in zip(prompts, new_tokens, which, outs, strict=True):
        expected = (hf_greedy(llama_dir, prompt, n) if adapter is None
                    else peft_greedy(llama_dir, adapters[adapter], prompt, n))
        assert out.token_ids == expected, adapter
    if backend == "torch":
        return
    # Each adapter answers otherwise than the base model on the same prompt.
    base = llm.generate(prompts[:3], SamplingParams(max_new_tokens=16))
    adapted = llm.generate(prompts[:3], [SamplingParams(max_new_tokens=16, adapter=a)
                                         for a in ADAPTERS])
    assert all(b.token_ids != a.token_ids for b, a in zip(base, adapted, strict=True))


def test_the_prefix_cache_shares_blocks_within_an_adapter_never_across(llama_dir, adapters):
    llm = LLM(llama_dir, num_blocks=256, lora_adapters=adapters)
    prompt = make_prompts(2048, [70], seed=5)[0]

    def cached(adapter):
        llm.generate([prompt], SamplingParams(max_new_tokens=2, adapter=adapter))
        return llm.engine.scheduler.block_manager.prefix_hits

    hits = [cached(a) for a in (None, "alpha", "beta", "alpha", None)]
    assert hits[:3] == [0, 0, 0]  # the same tokens under another adapter: nothing shared
    assert hits[3] == 64 and hits[4] == 128  # the same adapter again: 4 blocks of 16 each
    out = llm.generate([prompt], SamplingParams(max_new_tokens=6, adapter="beta"))[0]
    assert out.token_ids == peft_greedy(llama_dir, adapters["beta"], prompt, 6)


def test_max_loras_keeps_other_adapters_waiting_and_loses_nothing(llama_dir, adapters):
    llm = LLM(llama_dir, num_blocks=256, lora_adapters=adapters, max_loras=1)
    prompts = make_prompts(2048, [6, 8, 10, 12, 7, 9], seed=8)
    which = ["alpha", "beta", "alpha", "gamma", None, "beta"]
    for i, (prompt, adapter) in enumerate(zip(prompts, which, strict=True)):
        llm.engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=6, adapter=adapter))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            got[out.request_id].extend(out.token_ids)
        running = {r.params.adapter for r in llm.engine.scheduler.running} - {None}
        assert len(running) <= 1, running
    for i, (prompt, adapter) in enumerate(zip(prompts, which, strict=True)):
        expected = (hf_greedy(llama_dir, prompt, 6) if adapter is None
                    else peft_greedy(llama_dir, adapters[adapter], prompt, 6))
        assert got[f"r{i}"] == expected, adapter


def test_an_unknown_adapter_is_refused_by_name(llama_dir, adapters):
    llm = LLM(llama_dir, num_blocks=64, lora_adapters={"alpha": adapters["alpha"]})
    with pytest.raises(ValueError, match="LoRA adapter 'beta' is not loaded"):
        llm.engine.add_request("x", [5, 6, 7], SamplingParams(adapter="beta"))


def test_bad_adapters_are_refused_with_the_reason(llama_dir, qwen2_dir, adapters, tmp_path):
    def edited(name, **changes):
        path = tmp_path / name
        path.mkdir()
        for f in ("adapter_model.safetensors", "adapter_config.json"):
            (path / f).write_bytes((Path(adapters["beta"]) / f).read_bytes())
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    cases = [
        (str(tmp_path / "none"), 64, "no such directory"),
        (str(tmp_path), 64, "no adapter_config.json"),
        (adapters["alpha"], 4, "rank 8 is over max_lora_rank=4"),
        (edited("dora", use_dora=True), 64, "use_dora=True is not supported"),
        (edited("saved", modules_to_save=["lm_head"]), 64, "modules_to_save"),
    ]
    for path, max_rank, message in cases:
        with pytest.raises(AdapterError, match=message):
            read_adapter_config("x", path, max_rank)
    # An adapter trained on another base (other shapes) fails the load, naming both.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(llama_dir)
    config.intermediate_size *= 2
    other = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["down_proj"]))
    other.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(AdapterError, match="'other'.*inputs, the model's layer.*another base"):
        LLM(llama_dir, num_blocks=64, lora_adapters={"other": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="a name is given twice"):
        parse_lora_adapters(f"a={adapters['alpha']},a={adapters['beta']}")
    assert parse_lora_adapters(f"{adapters['alpha']}") == (
        (Path(adapters["alpha"]).name, adapters["alpha"]),)


def test_adapters_added_and_removed_between_steps(llama_dir, adapters):
    """Run-time loads and drops travel with the steps: an adapter added while a request
    runs serves from the next step; a dropped one is refused at once and leaves the shard
    once its last request is done."""
    llm = LLM(llama_dir, num_blocks=256)
    engine, runner = llm.engine, llm.runner
    prompts = make_prompts(2048, [9, 14], seed=11)
    engine.add_request("base", prompts[0], SamplingParams(max_new_tokens=12))
    got: dict[str, list[int]] = {"base": [], "late": []}

    def step():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)

    step()
    # Read ahead on another thread while a step runs (the shard actor's two threads), then
    # loaded by a step from what was read; a bad adapter is left for its step to refuse.
    reader = threading.Thread(target=runner.stage_adapter, args=("beta@1", adapters["beta"]))
    reader.start()
    step()
    reader.join()
    runner.stage_adapter("bad", "/nonexistent/adapter")
    assert list(runner.adapters.staged) == [("beta@1", adapters["beta"])]
    engine.add_adapter("beta@1", adapters["beta"])  # while "base" runs
    engine.add_request("late", prompts[1], SamplingParams(max_new_tokens=8, adapter="beta@1"))
    step()
    assert runner.adapters.lora is not None and runner.adapters.lora.slots == {"beta@1": 1}
    assert runner.adapters.staged == {}  # taken by the step
    engine.remove_adapter("beta@1")  # "late" still runs: dropped after it
    with pytest.raises(ValueError, match="'beta@1' is not loaded"):
        engine.add_request("refused", prompts[1], SamplingParams(adapter="beta@1"))
    while "late" in engine.scheduler.requests:
        assert "beta@1" in runner.adapters.lora.slots
        step()
    while engine.has_unfinished_requests():
        step()
    assert got["late"] == peft_greedy(llama_dir, adapters["beta"], prompts[1], 8)
    assert got["base"] == hf_greedy(llama_dir, prompts[0], 12)
    llm.generate([prompts[0]], SamplingParams(max_new_tokens=1))  # the next step drops it
    assert runner.adapters.lora.slots == {}
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_adapter("gamma", adapters["gamma"])
        engine.add_adapter("gamma", adapters["gamma"])


def test_an_adapter_of_another_base_is_refused_before_loading(llama_dir, adapters, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from shards.model.config import ModelConfig

    config = AutoConfig.from_pretrained(llama_dir)
    config.hidden_size *= 2
    other = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(str(tmp_path / "other"))
    model = ModelConfig.from_pretrained(llama_dir)
    with pytest.raises(AdapterError, match="q_proj.lora_A.weight of shape .* another base"):
        read_adapter_config("other", tmp_path / "other", 64, model)
    assert read_adapter_config("beta", adapters["beta"], 64, model).rank == 4


def test_max_cpu_loras_drops_the_least_recently_used_idle_adapter(llama_dir, adapters):
    llm = LLM(llama_dir, num_blocks=128, max_cpu_loras=2)
    engine = llm.engine
    prompt = make_prompts(2048, [7], seed=4)[0]
    assert engine.add_adapter("a@1", adapters["alpha"]) == []
    assert engine.add_adapter("b@2", adapters["beta"]) == []
    llm.generate([prompt], SamplingParams(max_new_tokens=2, adapter="a@1"))  # b@2: least recent
    assert engine.add_adapter("c@3", adapters["gamma"]) == ["b@2"]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=6, adapter="c@3"))[0]
    assert out.token_ids == peft_greedy(llama_dir, adapters["gamma"], prompt, 6)
    assert set(llm.runner.adapters.lora.slots) == {"a@1", "c@3"} == engine.adapters
    # An adapter with a request waiting is never dropped: the limit is passed instead.
    engine.add_request("busy", prompt, SamplingParams(max_new_tokens=2, adapter="a@1"))
    engine.add_request("busy2", prompt, SamplingParams(max_new_tokens=2, adapter="c@3"))
    assert engine.add_adapter("b@4", adapters["beta"]) == []
    assert engine.adapters == {"a@1", "c@3", "b@4"}


def test_max_cpu_loras_keeps_an_adapter_whose_request_is_on_its_way(llama_dir, adapters):
    """The batcher names the adapters of requests that passed its check and are not in
    the scheduler yet (`in_use`): none of them is dropped to make room."""
    llm = LLM(llama_dir, num_blocks=128, max_cpu_loras=1)
    engine = llm.engine
    assert engine.add_adapter("a@1", adapters["alpha"]) == []
    assert engine.add_adapter("b@2", adapters["beta"], in_use={"a@1"}) == []
    assert engine.adapters == {"a@1", "b@2"}
    assert engine.add_adapter("c@3", adapters["gamma"], in_use={"b@2"}) == ["a@1"]
    assert engine.adapters == {"b@2", "c@3"}


def test_the_cpu_kernel_adds_each_rows_own_adapter_delta():
    """lora_add against torch: rows of the base model (no columns), of adapters of ranks
    2 to 48 side by side, a K that is no multiple of a vector; bad columns are refused."""
    import torch

    from shards.cpu import kernels as cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip(f"raygen's CPU kernels did not build: {cpu_kernels.load_error()}")
    g = torch.Generator().manual_seed(0)
    ranks = [2, 8, 48]
    k, n, room = 37, 70, 64
    a_rows, b_rows = torch.randn(room, k, generator=g), torch.randn(room, n, generator=g)
    bounds, start = [(0, 0)], 0
    for rank in ranks:
        bounds.append((start, start + rank))
        start += rank
    which = [0, 1, 2, 3, 3, 0, 2, 1, 3]
    x, y = torch.randn(len(which), k, generator=g), torch.randn(len(which), n, generator=g)
    columns = torch.tensor([bounds[w] for w in which])
    want = y.clone()
    for r, (c0, c1) in enumerate(columns.tolist()):
        want[r] += (x[r].double() @ a_rows[c0:c1].double().T @ b_rows[c0:c1].double()).float()
    got = y.clone()
    kernels.lora_add(x, got, a_rows, b_rows, columns)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[0], y[0]) and torch.equal(got[5], y[5])  # base rows untouched
    with pytest.raises(RuntimeError, match="not within 64"):
        kernels.lora_add(x, got, a_rows, b_rows, torch.tensor([[60, 70]] * len(which)))
