"""benchmarks.compare end to end, small: it starts raygen and the @serve.batch peer in turn
with `serve run`, drives both with the same prompts, measures the forward-only limit and
reports them side by side. (transformers serve needs its own venv: not started here.)"""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.compare import PORT, main


def test_compare_runs_each_server_in_turn_on_the_same_prompts(llama_dir, tmp_path, capsys):
    result = main(["--model", llama_dir, "--servers", "raygen-tp1,serve-batch",
                   "--concurrency", "1,2", "--decode-heavy-concurrency", "2",
                   "--min-prompts", "3", "--prompts-per-concurrency", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    with pytest.raises(httpx.HTTPError):  # every server was stopped
        httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2)

    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["table"] == result["table"]
    for workload, levels in (("prefill-heavy", [1, 2]), ("decode-heavy", [2])):
        rows = result["results"][workload]
        assert set(rows) == {"raygen TP=1", "Ray Serve @serve.batch + generate", "limit"}
        for c in levels:
            ours, peer = rows["raygen TP=1"][c], rows["Ray Serve @serve.batch + generate"][c]
            assert ours["completed"] == peer["completed"] == max(3, 2 * c)
            assert ours["failed"] == peer["failed"] == 0
            # The same prompts reached both (token counts from each server's usage).
            assert ours["total_input_tokens"] == peer["total_input_tokens"]
            assert ours["total_output_tokens"] > 0 and peer["total_output_tokens"] > 0
            assert ours["median_itl_ms"] is not None  # raygen streams token by token ...
            assert peer["median_itl_ms"] is None  # ... the static batch answers at once
            assert rows["limit"][c]["output_throughput"] > 0
    # Text prompts of exactly 128 tokens, plus the BOS the server adds.
    assert result["results"]["prefill-heavy"]["raygen TP=1"][1]["total_input_tokens"] == 3 * 129
    assert "raygen / best peer" in printed and "limit (forward only)" in printed
