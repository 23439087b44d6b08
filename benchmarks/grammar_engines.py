"""Which grammar library to build constrained output on: llguidance or xgrammar.

For each one importable here: the time to compile a nested JSON schema (first time, no
cache), and the time to fill the token masks of a batch of 32 matchers per step while
each row walks the grammar (drawing a random allowed token, seeded, until the grammar
stops or 64 steps), reported per token. Install weight is what `pip` says
(`du` of the installed packages); xgrammar is not a dependency, install it by hand to
compare (`pip install xgrammar`).

    python -m benchmarks.grammar_engines --model models/demo-small
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
BATCH, STEPS = 32, 64


def _version(package: str) -> str:
    from importlib.metadata import version

    return f"{package} {version(package)}"


def _walk(fill, consume, done, vocab: int, seed: int = 0) -> tuple[float, int]:
    """Seconds spent filling masks and tokens masked, over STEPS batched steps."""
    rng = random.Random(seed)
    mask_s, tokens = 0.0, 0
    for _ in range(STEPS):
        live = [i for i in range(BATCH) if not done(i)]
        if not live:
            break
        t0 = time.perf_counter()
        bitmask = fill(live)
        mask_s += time.perf_counter() - t0
        tokens += len(live)
        bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)
        for i in live:
            allowed = bits[i, :vocab].nonzero().flatten().tolist()
            consume(i, rng.choice(allowed))
    return mask_s, tokens


def bench_llguidance(tok, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not first.is_error(), first.get_error()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    bitmask = lt.allocate_token_bitmask(BATCH, vocab)

    def fill(live):
        for i in live:
            lt.fill_next_token_bitmask(matchers[i], bitmask, i)
        return bitmask

    mask_s, tokens = _walk(fill, lambda i, t: matchers[i].consume_token(t),
                           lambda i: matchers[i].is_stopped(), vocab)
    return {"engine": _version("llguidance"),
            "compile_ms": compile_s * 1e3, "mask_us_per_token": mask_s / tokens * 1e6}


def bench_xgrammar(tok, vocab: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)

    def fill(live):
        for i in live:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        return bitmask

    mask_s, tokens = _walk(fill, lambda i, t: matchers[i].accept_token(t),
                           lambda i: matchers[i].is_terminated(), vocab)
    return {"engine": _version("xgrammar"), "compile_ms": compile_s * 1e3,
            "mask_us_per_token": mask_s / tokens * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/demo-small")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tok)
    torch.set_num_threads(1)
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            result = bench(tok, vocab)
        except ImportError as exc:
            print(f"{bench.__name__[6:]}: not installed ({exc})")
            continue
        print(f"{result['engine']:<20} compile {result['compile_ms']:8.1f} ms   "
              f"mask {result['mask_us_per_token']:7.1f} us/token (batch {BATCH})")


if __name__ == "__main__":
    main()
