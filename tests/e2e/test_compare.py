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
            assert ours["median_tpot_ms"] > 0  # the table's per-token column
            assert rows["limit"][c]["output_throughput"] > 0
    # At concurrency 1 the limit also times the core plan's step: one core, one thread.
    limit_1 = result["results"]["prefill-heavy"]["limit"][1]
    assert limit_1["one_thread_step_ms"] > 0 and "one_thread_step_ms" not in \
        result["results"]["prefill-heavy"]["limit"][2]
    # Text prompts of exactly 128 tokens, plus the BOS the server adds.
    assert result["results"]["prefill-heavy"]["raygen TP=1"][1]["total_input_tokens"] == 3 * 129
    assert "raygen / best peer" in printed and "limit (forward only)" in printed
    assert "TPOT p50" in printed
    assert "one-token step on one core" in printed


def test_passes_alternate_the_server_order_and_report_means(llama_dir, tmp_path, monkeypatch):
    """Two passes run the servers A, B then B, A (each sees the same share of a machine that
    drifts) and every cell is the mean of its passes; no server is started here."""
    from benchmarks import compare

    order, throughputs = [], iter([10.0, 20.0, 30.0, 50.0])
    monkeypatch.setattr(compare, "start", lambda server, log: order.append(server.key) or server)
    monkeypatch.setattr(compare, "stop", lambda proc, sig: None)
    monkeypatch.setattr(compare, "measure_limit", lambda w, a, o: {1: {
        "output_throughput": 100.0 + len(order), "prefill_ms": 5.0, "decode_step_ms": 2.0}})

    def fake_load(workload, c, args):
        return {"output_throughput": next(throughputs), "median_ttft_ms": None,
                "p99_ttft_ms": None, "median_itl_ms": None, "p99_itl_ms": None,
                "total_output_tokens": 64, "failed": 1 if len(order) == 4 else 0,
                "errors": ["boom"] if len(order) == 4 else []}

    monkeypatch.setattr(compare, "run_load", fake_load)
    result = main(["--model", llama_dir, "--servers", "raygen-tp1,serve-batch",
                   "--concurrency", "1", "--decode-heavy-concurrency", "", "--passes", "2",
                   "--out", str(tmp_path)])
    assert order == ["raygen-tp1", "serve-batch", "serve-batch", "raygen-tp1"]
    rows = result["results"]["prefill-heavy"]
    ours, peer = rows["raygen TP=1"][1], rows["Ray Serve @serve.batch + generate"][1]
    # raygen ran first and last (10, then 50), the peer second and third (20, then 30).
    assert [p["output_throughput"] for p in ours["passes"]] == [10.0, 50.0]
    assert ours["output_throughput"] == 30.0 and peer["output_throughput"] == 25.0
    assert ours["total_output_tokens"] == 64  # what every pass agrees on stays as it is
    assert ours["failed"] == 1 and ours["errors"] == ["boom"]  # failures add up
    assert peer["failed"] == 0
    assert rows["limit"][1]["output_throughput"] == (102.0 + 104.0) / 2
    assert "mean of 2 passes" in result["table"]


def test_raygen_variants_pass_builder_args_to_a_config_or_the_command_line(llama_dir):
    """`KEY@a=1+b=x` adds builder args: into the config file of a config-run server, on the
    `serve run IMPORT_PATH` command line of the import-path one (no config: that is the
    point of it). No server is started here."""
    from benchmarks.compare import make_servers, parse_args

    args = parse_args(["--model", llama_dir, "--servers",
                       "raygen-import-path@reserved_cpus=0+max_batch_size=8,"
                       "raygen-default-proxy@num_blocks=512"])
    plain, proxy = make_servers(args)
    assert plain.command[1:] == ["run", "deployments.app:build_app", f"model={llama_dir}",
                                 "reserved_cpus=0", "max_batch_size=8"]
    assert not any(k.startswith("RAY_SERVE_") for k in plain.env)
    config = json.loads(open(proxy.command[2]).read())
    assert "controller_options" not in config
    assert config["applications"][0]["args"] == {"model": llama_dir, "num_blocks": 512}


def test_raygen_variants_pass_environment_variables_after_a_percent_sign(llama_dir):
    from benchmarks.compare import make_servers, parse_args

    args = parse_args(["--model", llama_dir, "--servers",
                       "raygen-import-path%RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5+X=1,"
                       "raygen-import-path@reserved_cpus=0%X=2,raygen-tp1%X=3"])
    env_only, both, tp1 = make_servers(args)
    assert args.raygen_tp == [1] and tp1.env["X"] == "3"
    # A config-run raygen runs under the controller's settings that serve_config.yaml ships.
    from deployments.app import THROUGHPUT_MODE_ENV
    assert THROUGHPUT_MODE_ENV.items() <= tp1.env.items()
    assert env_only.command[1:] == ["run", "deployments.app:build_app", f"model={llama_dir}"]
    assert (env_only.env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"], env_only.env["X"]) == ("0.5", "1")
    assert both.command[-1] == "reserved_cpus=0" and both.env["X"] == "2"
    assert both.env["HF_HUB_OFFLINE"] == "1"  # the server's own environment is kept


def test_help_prints(capsys):
    from benchmarks.compare import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0 and "after %:" in capsys.readouterr().out


def test_llama_cpp_serves_the_same_gguf_file_and_is_skipped_without_its_build(tmp_path,
                                                                              llama_dir):
    """No server starts here: the llama.cpp peer's command serves the GGUF --model with a
    slot per request, and is left out (saying why) without its build or a GGUF model."""
    from benchmarks.compare import make_servers, parse_args
    from tests.reference import smollm2_gguf

    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    gguf = str(smollm2_gguf())
    args = parse_args(["--model", gguf, "--servers", "raygen-tp1,llama-server",
                       "--llama-cpp", str(tmp_path)])
    assert args.dtype == "float32" and args.tokenizer != args.model  # the converted dir
    raygen, llama = make_servers(args)
    assert raygen.key == "raygen-tp1"
    assert llama.command[:3] == [str(binary), "-m", args.model]
    assert llama.command[llama.command.index("-np") + 1] == "32"
    # Environment variables after % reach a peer too (llama.cpp's extra buffer types off:
    # its AMX path dies on an illegal instruction on some VMs); builder args do not.
    (no_repack,) = make_servers(parse_args(["--model", gguf, "--llama-cpp", str(tmp_path),
                                            "--servers", "llama-server%LLAMA_ARG_REPACK=0"]))
    assert no_repack.command == llama.command and no_repack.env["LLAMA_ARG_REPACK"] == "0"
    with pytest.raises(SystemExit, match="only a raygen server takes builder args"):
        make_servers(parse_args(["--model", gguf, "--llama-cpp", str(tmp_path),
                                 "--servers", "llama-server@x=1"]))
    for argv in (["--model", gguf, "--llama-cpp", str(tmp_path / "none")],
                 ["--model", llama_dir, "--llama-cpp", str(tmp_path)]):
        for key in ("llama-server", "llama-server%LLAMA_ARG_REPACK=0"):
            assert make_servers(parse_args([*argv, "--servers", key])) == []
    # vLLM's CPU server dies at start on a GGUF file: left out, saying why; a directory runs.
    vllm_python = tmp_path / "vllm" / "bin" / "python"
    vllm_python.parent.mkdir(parents=True)
    vllm_python.write_text("")
    for model, count in ((gguf, 0), (llama_dir, 1)):
        argv = ["--model", model, "--vllm-venv", str(tmp_path / "vllm"), "--servers", "vllm-cpu"]
        assert len(make_servers(parse_args(argv))) == count
    with pytest.raises(SystemExit, match="needs a GGUF --model"):
        parse_args(["--model", llama_dir, "--weights", "F32"])
