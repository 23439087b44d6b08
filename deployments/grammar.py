"""Grammars at the edge: what both adapters turn a schema or a regex into, and the check
that refuses a bad or pathological one before it is queued.

A grammar is llguidance's text (rank 0 builds its matchers from the same text, see
shards/model/grammar.py). The check builds a matcher and walks its first few tokens on a thread
pool (llguidance drops the GIL, so the event loop keeps serving), under a time bound;
results are cached by grammar text, so a grammar is checked once however often it comes."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shards.model.grammar import load_tokenizer, parser_limits

CACHE_SIZE = 1024
CHECK_STEPS = 8
# Compact JSON: the model cannot pad whitespace, so a bounded schema ends by EOS.
JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidGrammar(ValueError):
    pass


def json_schema(schema: Any) -> str:
    """The grammar of JSON documents that validate against `schema` (a dict or its text),
    its objects closed where it lists their properties (see `closed`)."""
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidGrammar(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidGrammar("the JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)),
                                                             defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidGrammar(str(exc)) from exc


# Keywords whose value is a schema, a list of schemas, or a map from names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if",
              "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with `"additionalProperties": false` on each object schema that lists its
    properties and says nothing about others. JSON Schema allows unlisted properties by
    default, and llguidance follows it, so a model could add keys no one asked for (a
    tool call's `get_weather` got `"month"` beside `"city"`). TGI (outlines), vLLM
    (xgrammar; `disable_additional_properties` for guidance) and llama.cpp's server
    generate only the listed properties: so does raygen. An explicit
    `additionalProperties` or `unevaluatedProperties` is kept, and the parts of an `allOf`
    stay open, since closing each would refuse the others' properties. A copy: the
    request's own schema is not changed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, in_all_of=key == "allOf") for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    lists_properties = "properties" in out or "patternProperties" in out
    says_how = "additionalProperties" in out or "unevaluatedProperties" in out
    if lists_properties and not says_how and not in_all_of and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def regex(pattern: Any) -> str:
    import llguidance

    if not isinstance(pattern, str):
        raise InvalidGrammar("a regex grammar's value must be a string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: Any) -> str:
    """The grammar of exactly one of `options` (vLLM's `choice`), each a literal string."""
    import llguidance

    if not isinstance(options, list) or not options or \
            not all(isinstance(o, str) and o for o in options):
        raise InvalidGrammar("a choice must be a list of non-empty strings")
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(o) for o in options))


def context_free(text: Any) -> str:
    """A context-free grammar in llama.cpp's GBNF (the EBNF that vLLM's xgrammar reads:
    `root ::= ...`) or in Lark (what vLLM's guidance backend and llguidance read)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(text, str) or not text.strip():
        raise InvalidGrammar("a grammar must be a non-empty string")
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter's own parse errors, of several kinds
        raise InvalidGrammar(f"neither Lark nor GBNF: {_first_line(str(exc))}") from exc
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarChecker:
    def __init__(self, model_dir: str, vocab_size: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-check")
        self._tokenizer = self._pool.submit(load_tokenizer, model_dir, vocab_size)
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # grammar -> error, "" if fine

    async def check(self, grammar: str) -> None:
        """Raise InvalidGrammar (with llguidance's reason) unless `grammar` compiles and
        walks its first tokens within the time bound."""
        verdict = self._verdicts.get(grammar)
        if verdict is None:
            if not self._tokenizer.done():  # loading it is not the grammar's time
                await asyncio.wrap_future(self._tokenizer)
            future = asyncio.wrap_future(self._pool.submit(self._check, grammar))
            try:
                verdict = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
                self._remember(grammar, verdict)
            except TimeoutError:
                # Refused now; the verdict is kept once the check ends, so a grammar that
                # only waited behind others is not refused for good.
                future.add_done_callback(lambda f: self._remember(grammar, f.result()))
                verdict = f"compiling it took longer than {self.timeout_s:g} s"
        if verdict:
            raise InvalidGrammar(verdict)

    def _remember(self, grammar: str, verdict: str) -> None:
        self._verdicts[grammar] = verdict
        if len(self._verdicts) > CACHE_SIZE:
            self._verdicts.popitem(last=False)

    def _check(self, grammar: str) -> str:
        """Build a matcher and walk it a few tokens (the first allowed each time): llguidance
        builds its lexer lazily, so a pathological regex may pass construction and the
        first mask, and give up only a token or two later."""
        import llguidance
        import numpy as np

        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0,
                                       limits=parser_limits())
        for _ in range(CHECK_STEPS):
            if matcher.is_error() or matcher.is_stopped():
                break
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            if matcher.is_error():
                break
            allowed = np.flatnonzero(mask)
            if allowed.size == 0:
                break
            word = int(allowed[0])
            bit = (int(mask[word]) & -int(mask[word])).bit_length() - 1
            matcher.consume_token(word * 32 + bit)
        return _first_line(matcher.get_error()) if matcher.is_error() else ""


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:300] if error.strip() else "invalid grammar"
