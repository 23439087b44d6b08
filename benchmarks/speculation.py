"""Prompt-lookup speculation in the server: `speculate=N` against `speculate=0`, one run.

    python -m benchmarks.speculation --model models/SmolLM2-135M-Instruct.Q4_1.gguf

Starts raygen (`serve run`, the builder's defaults) once per setting and sends the same
requests to each, greedy, through `/v1/chat/completions`:
- `grounded`: answers that copy their input (repeat a paragraph, fix its typos, write a
  function out with a docstring), at the concurrencies of `--grounded-concurrency`; the
  paragraphs and functions are this repository's own docstrings and code, so the text is
  real, frozen in grounded_corpus.json so that runs on later code send the same prompts;
- `free`: answers that copy nothing (random words in, `ignore_eos`), at
  `--free-concurrency`: what speculation may cost when it does not pay.
Reports output tokens/s per cell, the ratio to `speculate=0`, the acceptance counters from
`/metrics`, and whether every greedy answer was the same in both servers. `--passes 2`
runs the servers in turn forward, then backward, and reports each cell's mean: in one pass
the server that goes second reads the machine's drift (free answers at 16 read 0.87-0.89x
with `speculate=4` second and 1.00x with it first, benchmarks/NOTES.md 69). `--side-by-side`
serves both settings at once instead, as two applications of one `serve run`, and measures
each cell on one and then at once on the other: the hour's drift, which moved a cell by up
to 11% between two server starts, no longer falls between the two (NOTES.md 115). `--peers
llama-server` also drives llama.cpp's server (built by `make peers`) on the same file and
requests, and reports raygen with drafts against it."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import re
import textwrap
import time
from pathlib import Path

import httpx

from benchmarks import compare
from benchmarks.serve import post_stream

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["engine", "deployments", "shards/worker", "shards/model"]
# The grounded prompts' texts, frozen: drawn from the sources as they stand, the prompts
# (and so every grounded cell) changed with the code. Written by `--write-corpus` from the
# sources at cfb8e95 (30 Nov 2026): the prompts of benchmarks/NOTES.md 85.
CORPUS = Path(__file__).with_name("grounded_corpus.json")


def corpus_from_sources() -> dict[str, list[str]]:
    """Real text to copy: this repository's module docstrings and short functions."""
    paragraphs, functions = [], []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).glob("*.py")):
            source = path.read_text()
            tree = ast.parse(source)
            doc = ast.get_docstring(tree)
            if doc and 200 <= len(doc) <= 900:
                paragraphs.append(" ".join(doc.split()))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 14:
                    functions.append(textwrap.dedent(
                        ast.get_source_segment(source, node, padded=True)))
    return {"paragraphs": paragraphs, "functions": functions}


def grounded_prompts(n: int, seed: int = 0) -> list[str]:
    """Input-grounded tasks over real text: repeat a paragraph, fix its typos, write a
    function out with a docstring (the texts of CORPUS)."""
    corpus = json.loads(CORPUS.read_text())
    paragraphs, functions = corpus["paragraphs"], corpus["functions"]
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = rng.choice(paragraphs)
            prompts.append(f"Repeat the following text exactly, word for word.\n\n{text}")
        elif kind == 1:
            text = rng.choice(paragraphs)
            words = text.split()
            for j in rng.sample(range(len(words)), max(1, len(words) // 12)):
                if len(words[j]) > 4:  # drop a letter: a typo to fix
                    k = rng.randrange(1, len(words[j]) - 1)
                    words[j] = words[j][:k] + words[j][k + 1:]
            prompts.append("Fix the spelling mistakes in this text and write it out in "
                           f"full.\n\n{' '.join(words)}")
        else:
            code = rng.choice(functions)
            code = re.sub(r'\n\s*"""[\s\S]*?"""', "", code, count=1)  # its docstring goes
            prompts.append(f"Add a docstring to this Python function and write it out in "
                           f"full.\n\n```python\n{code}\n```")
    return prompts


def free_prompts(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    words = ("river", "glass", "orbit", "maple", "signal", "copper", "harbor", "lantern",
             "meadow", "puzzle", "quartz", "saddle", "thunder", "velvet", "whistle", "yarn")
    return [" ".join(rng.choice(words) for _ in range(60)) for _ in range(n)]


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
              ignore_eos: bool) -> tuple[str, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    r = await post_stream(client, "/v1/chat/completions", body)
    try:
        await r.aread()
    finally:
        await r.aclose()
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


async def load(model: str, prompts: list[str], concurrency: int, max_tokens: int,
               ignore_eos: bool, prefix: str = "") -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{compare.PORT}{prefix}",
                                 timeout=1800) as client:
        # Warm: a server just started is still settling (one cell at concurrency 1 read
        # 61 tok/s first and 80 a minute later, NOTES.md 69), and a first draft of each
        # shape is slower. Not a prompt of the cells: it would fill the prefix cache.
        for prompt in grounded_prompts(2, seed=99):
            await one(client, model, prompt, 48, False)
        sem = asyncio.Semaphore(concurrency)

        async def limited(prompt):
            async with sem:
                return await one(client, model, prompt, max_tokens, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
            "duration_s": round(duration, 2), "output_tok_s": round(tokens / duration, 2),
            "texts": [t for t, _ in results]}


def counters(prefix: str = "") -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{compare.PORT}{prefix}/metrics", timeout=10).text
    found = {}
    for name in ("raygen_speculation_draft_tokens_total",
                 "raygen_speculation_accepted_tokens_total"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        found[name] = float(m.group(1)) if m else 0.0
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--speculate", type=int, default=4)
    p.add_argument("--extra", default="", help="more builder args for both servers, "
                   "`key=value+key=value`")
    p.add_argument("--grounded-concurrency", default="1,8")
    p.add_argument("--free-concurrency", default="16,32")
    p.add_argument("--requests-per-concurrency", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--peers", default="", help="comma list of benchmarks.compare servers "
                   "to run on the same requests (llama-server)")
    p.add_argument("--passes", type=int, default=1, help="run the servers this many times, "
                   "in turn forward and backward (a machine that drifts during a run favours "
                   "whichever server goes first); each cell's tok/s is the mean of its passes")
    p.add_argument("--side-by-side", action="store_true", help="serve both settings at once, "
                   "as two applications of one `serve run`, and measure each cell on one then "
                   "the other (A B, then B A in the next pass) rather than server after server")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--write-corpus", action="store_true", help=f"write {CORPUS.name} from "
                   "the sources as they are now, and stop (the grounded prompts change)")
    return p.parse_args(argv)


def measure(cell: tuple[str, int], args, peer: bool, prefix: str = "") -> dict:
    """Drive one cell against the server (the application under `prefix`): its row."""
    kind, c = cell
    n = max(args.min_requests, args.requests_per_concurrency * c)
    prompts = grounded_prompts(n, seed=c) if kind == "grounded" else free_prompts(n, c)
    before = {} if peer else counters(prefix)
    row = asyncio.run(load(args.model, prompts, c, args.max_tokens, kind == "free", prefix))
    after = {} if peer else counters(prefix)
    row.update({k.removeprefix("raygen_speculation_").removesuffix("_total"):
                after[k] - before[k] for k in after})
    where = f"{prefix} " if prefix else ""
    print(f"  {where}{kind} c={c}: {row['output_tok_s']} tok/s, {row['output_tokens']} "
          f"tokens, drafts {row.get('draft_tokens', 0):.0f} kept "
          f"{row.get('accepted_tokens', 0):.0f}", flush=True)
    return row


def run_server(server, cells, args, log_path: Path, peer: bool) -> dict:
    """Start one server, drive every cell, stop it: the cells' rows."""
    proc = compare.start(server, log_path)
    try:
        return {f"{kind}@{c}": measure((kind, c), args, peer) for kind, c in cells}
    finally:
        compare.stop(proc, server.stop_signal)


def side_by_side(servers, cells, args, out_dir: Path) -> dict[str, list[dict]]:
    """Both settings as two applications of one `serve run` (route prefixes /app0 and
    /app1), each cell measured on one right after the other, in turn A B, then B A: a
    comparison that the machine's drift between two server starts (minutes apart) does not
    reach. The idle application costs its Ray actors' upkeep (about 2% of a core here),
    under both."""
    apps, prefixes = [], {}
    for i, server in enumerate(servers):
        app = json.loads(Path(server.command[2]).read_text())["applications"][0]
        prefixes[server.key] = f"/app{i}"
        apps.append({**app, "name": f"app{i}", "route_prefix": prefixes[server.key]})
    both = compare.Server("raygen-side-by-side", " + ".join(s.name for s in servers),
                          [*servers[0].command[:2], compare.serve_config_apps(apps)],
                          servers[0].env, health_paths=tuple(f"{p}/health"
                                                             for p in prefixes.values()))
    passes: dict[str, list[dict]] = {server.key: [] for server in servers}
    proc = compare.start(both, out_dir / "speculation-side-by-side.log")
    try:
        for i in range(args.passes):
            rows: dict[str, dict] = {server.key: {} for server in servers}
            for j, (kind, c) in enumerate(cells):
                for server in servers if (i + j) % 2 == 0 else servers[::-1]:
                    print(f"== {server.name} (pass {i + 1})", flush=True)
                    rows[server.key][f"{kind}@{c}"] = measure((kind, c), args, False,
                                                              prefixes[server.key])
            for key, row in rows.items():
                passes[key].append(row)
    finally:
        compare.stop(proc, both.stop_signal)
    return passes


def merge_passes(passes: list[dict]) -> dict:
    """One server's cells over its passes: tok/s the mean, drafts summed, the first pass's
    texts and token counts (greedy: every pass answers the same)."""
    merged = {}
    for cell, first in passes[0].items():
        rows = [p[cell] for p in passes]
        merged[cell] = {**first, "output_tok_s": round(sum(r["output_tok_s"] for r in rows)
                                                       / len(rows), 2),
                        "passes_tok_s": [r["output_tok_s"] for r in rows]}
        for key in ("draft_tokens", "accepted_tokens"):
            if key in first:
                merged[cell][key] = sum(r[key] for r in rows)
    return merged


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.write_corpus:
        CORPUS.write_text(json.dumps(corpus_from_sources(), indent=0) + "\n")
        print(f"written: {CORPUS}")
        return {}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = [("grounded", int(c)) for c in args.grounded_concurrency.split(",") if c] + \
            [("free", int(c)) for c in args.free_concurrency.split(",") if c]
    extra = f"+{args.extra}" if args.extra else ""
    keys = [f"raygen-tp1@speculate=0{extra}", f"raygen-tp1@speculate={args.speculate}{extra}"]
    peers = [k for k in args.peers.split(",") if k]
    ns = compare.parse_args(["--model", args.model, "--servers", ",".join(keys + peers)])
    servers = compare.make_servers(ns)
    results: dict = {"model": args.model, "machine": compare.machine_description(args.model),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "servers": {}}
    if args.side_by_side:
        if peers:
            raise SystemExit("--side-by-side serves raygen's two settings only; run --peers "
                             "without it")
        passes = side_by_side(servers, cells, args, out_dir)
        results["side_by_side"] = True
    else:
        passes = {server.key: [] for server in servers}
        for i in range(args.passes):
            for server in servers if i % 2 == 0 else servers[::-1]:
                print(f"== {server.name} (pass {i + 1})", flush=True)
                log_path = out_dir / f"speculation-{server.key.replace('@', '-')}-{i + 1}.log"
                passes[server.key].append(run_server(server, cells, args, log_path,
                                                     server.key in peers))
    results["servers"] = {key: merge_passes(rows) for key, rows in passes.items()}
    base, spec = (results["servers"][k] for k in keys)
    print(f"\n| cell | speculate=0 tok/s | speculate={args.speculate} tok/s | ratio | drafts kept "
          f"| same answers |\n|---|---|---|---|---|---|")
    for cell in base:
        a, b = base[cell], spec[cell]
        kept = (f"{b['accepted_tokens']:.0f}/{b['draft_tokens']:.0f}" if b["draft_tokens"]
                else "none")
        same = sum(x == y for x, y in zip(a["texts"], b["texts"], strict=True))
        ratio = b["output_tok_s"] / a["output_tok_s"]
        results.setdefault("ratios", {})[cell] = round(ratio, 3)
        print(f"| {cell} | {a['output_tok_s']} | {b['output_tok_s']} | {ratio:.2f}x | {kept} "
              f"| {same}/{len(a['texts'])} |")
    for key in peers:
        for cell, row in results["servers"].get(key, {}).items():
            ratio = spec[cell]["output_tok_s"] / row["output_tok_s"]
            results.setdefault("peer_ratios", {}).setdefault(key, {})[cell] = round(ratio, 3)
            print(f"{cell}: {key} {row['output_tok_s']} tok/s ({row['output_tokens']} tokens); "
                  f"raygen speculate={args.speculate} / {key} = {ratio:.2f}x")
    path = out_dir / f"speculation-{time.strftime('%Y-%m-%d-%H%M')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwritten: {path}")
    return results


if __name__ == "__main__":
    main()
