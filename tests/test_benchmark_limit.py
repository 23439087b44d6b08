"""benchmarks.limit, the forward-only bound that benchmarks.compare prints beside the
servers: it reads a GGUF file as the servers do, in the dtype they were given."""

from __future__ import annotations

from benchmarks import limit
from tests.reference import smollm2_gguf


def test_the_limit_reads_a_gguf_file_in_the_servers_dtype(monkeypatch):
    model = str(smollm2_gguf())
    configs = []
    runner_class = limit.ModelRunner

    def recording(config):
        configs.append(config)
        return runner_class(config)

    monkeypatch.setattr(limit, "ModelRunner", recording)
    out = limit.main(["--model", model, "--dtype", "bfloat16", "--input-len", "16",
                      "--output-len", "4", "--batch-sizes", "1,2", "--repeats", "1"])
    (config,) = configs
    assert (config.model, config.dtype) == (model, "bfloat16")
    steps = out["timings"]["decode_step_s"]
    assert set(steps) == {1, 2} and all(s > 0 for s in steps.values())
    assert 0 < out["limit_output_tok_s"][1] < out["limit_output_tok_s"][2] * 2
