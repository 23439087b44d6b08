"""Constrained output in the engine (rank 0's matchers): outputs fit their grammar and end
by EOS, unconstrained rows in the same batch are untouched, a failing grammar fails only
its own request."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest

from deployments.offline import LLM
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.reference import hf_greedy, make_prompts

# Bounded: every property required, no extra properties, bounded strings, arrays and
# integers, so a compact document has a bounded length and must end.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}},
     "required": ["name", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "object", "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "big": {"type": "boolean"}},
            "required": ["zip", "big"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
]
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)", r"[A-Z][a-z]{1,6} [0-9]{1,2}"]


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, num_blocks=256)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_validate_and_end_by_eos(llm, temperature):
    prompts = make_prompts(2048, [7, 30, 3], seed=41)
    params = [SamplingParams(max_new_tokens=200, temperature=temperature, seed=5,
                             grammar=json_grammar(s)) for s in SCHEMAS]
    for schema, out in zip(SCHEMAS, llm.generate(prompts, params), strict=True):
        jsonschema.validate(json.loads(out.text), schema)
        assert out.finish_reason is FinishReason.EOS_TOKEN
        assert len(out.token_ids) < 200


def test_regexes_fullmatch(llm):
    prompts = make_prompts(2048, [4, 12, 25], seed=42)
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=9,
                             grammar=llguidance.LLMatcher.grammar_from_regex(r)) for r in REGEXES]
    for pattern, out in zip(REGEXES, llm.generate(prompts, params), strict=True):
        assert re.fullmatch(pattern, out.text), (pattern, out.text)
        assert out.finish_reason is FinishReason.EOS_TOKEN


def test_unconstrained_rows_in_a_mixed_batch_equal_transformers(llm, llama_dir):
    prompts = make_prompts(2048, [9, 20, 33, 5], seed=43)
    free = SamplingParams(max_new_tokens=16)
    params = [free, SamplingParams(max_new_tokens=60, grammar=json_grammar(SCHEMAS[0])),
              free, SamplingParams(max_new_tokens=20, grammar=llguidance.LLMatcher
                                   .grammar_from_regex(REGEXES[0]))]
    outs = llm.generate(prompts, params)
    for i in (0, 2):
        assert outs[i].token_ids == hf_greedy(llama_dir, prompts[i], 16)
    jsonschema.validate(json.loads(outs[1].text), SCHEMAS[0])
    assert re.fullmatch(REGEXES[0], outs[3].text)


def test_a_grammar_that_fails_fails_only_its_request(llm, llama_dir):
    # llguidance accepts this regex, then gives up building its lexer (too many
    # expressions): the matcher errors, and only its request ends, with the reason.
    bad = llguidance.LLMatcher.grammar_from_regex(r"(x{1000}){1000}")
    prompts = make_prompts(2048, [6, 11], seed=44)
    engine = llm.engine
    engine.add_request("bad", prompts[0], SamplingParams(max_new_tokens=10, grammar=bad))
    engine.add_request("good", prompts[1], SamplingParams(max_new_tokens=12))
    outputs: dict[str, list] = {"bad": [], "good": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert "grammar failed" in outputs["bad"][-1].error
    assert not any(o.token_ids for o in outputs["bad"])
    assert [t for o in outputs["good"] for t in o.token_ids] == hf_greedy(llama_dir, prompts[1], 12)


def test_grammar_with_ignore_eos_is_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=json_grammar(SCHEMAS[0]), ignore_eos=True)


def test_a_resumed_request_replays_its_output_into_a_new_matcher(llama_dir):
    # After preemption a request comes back whole; its matcher must resume where it was.
    import torch

    from shards.model.grammar import Grammars

    grammars = Grammars(llama_dir, 2048)
    grammar = json_grammar(SCHEMAS[1])
    grammars.add("first", grammar, [])
    produced = []
    for _ in range(8):
        logits = torch.zeros(1, 2048)
        assert grammars.mask(logits, ["first"]) == {}
        token = int(logits.argmax())
        produced.append(token)
        assert grammars.advance([("first", token)]) == {}
    grammars.add("resumed", grammar, produced)
    a, b = torch.zeros(2, 2048), torch.zeros(2, 2048)
    grammars.mask(a, ["first", "resumed"])
    assert torch.equal(a[0], a[1])
    grammars.mask(b, ["resumed", "free"])
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], torch.zeros(2048))


def test_draft_rows_are_masked_as_decoding_masks_them_after_each_draft(llama_dir, tokenizer):
    """A drafting request's rows (rank 0, speculation): row j is masked as decoding masks
    the position after drafts 0..j-1 are kept; a draft the grammar forbids is masked out
    at its row, which ends the draft; after the step the matcher stands where it stood."""
    import torch

    from shards.model.grammar import Grammars

    vocab = 2048
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[a-z]+ [0-9]{2,3}")
    ids = tokenizer.encode("abc 123", add_special_tokens=False)
    assert len(ids) >= 3
    reference = Grammars(llama_dir, vocab)  # decoding: a token a step
    reference.add("r", grammar, [])
    expected = []
    for token in ids[:3] + [None]:
        logits = torch.zeros(1, vocab)
        assert reference.mask(logits, ["r"]) == {}
        expected.append(logits[0] == 0)
        if token is not None:
            assert reference.advance([("r", token)]) == {}
    assert not all(torch.equal(expected[0], e) for e in expected[1:])  # the masks move

    grammars = Grammars(llama_dir, vocab)
    grammars.add("r", grammar, [])
    # An unconstrained row first: rows and the matcher's bitmask rows are told apart.
    logits = torch.zeros(5, vocab)
    assert grammars.mask(logits, ["free", "r", "r", "r", "r"], [None, *ids[:3], None]) == {}
    assert torch.equal(logits[0], torch.zeros(vocab))
    for j in range(4):
        assert torch.equal(logits[1 + j] == 0, expected[j])

    # A forbidden second draft: its row forbids it, and the rows after it are not masked
    # past it (they are dropped); the matcher took nothing for good.
    forbidden = int((~expected[1]).nonzero()[0])
    logits = torch.zeros(3, vocab)
    assert grammars.mask(logits, ["r", "r", "r"], [ids[0], forbidden, None]) == {}
    assert torch.equal(logits[0] == 0, expected[0]) and torch.equal(logits[1] == 0, expected[1])
    assert logits[1, forbidden] == float("-inf")
    again = torch.zeros(1, vocab)
    assert grammars.mask(again, ["r"]) == {} and torch.equal(again[0] == 0, expected[0])
    assert grammars.advance([("r", t) for t in ids]) == {}


def test_a_gguf_file_s_byte_level_tokens_are_read_as_their_bytes():
    """transformers makes SmolLM2's GGUF tokenizer (GPT-2's byte-level BPE) a decoder of
    SentencePiece's steps around ByteLevel, with byte_fallback set; llguidance took its
    `Ġanswer` for the bytes of `Ġ` and `answer` then, and refused a grammar's literal
    spaces (the shipped config answered 400 to `"The answer is " ("yes" | "no")`). Each
    token's bytes are now those the tokenizer decodes to."""
    from deployments import grammar
    from shards.checkpoints.resolve import load_tokenizer as load_hf
    from shards.checkpoints.resolve import model_dir
    from shards.model.grammar import load_tokenizer
    from tests.reference import smollm2_gguf

    path = model_dir(str(smollm2_gguf()))
    hf = load_hf(path)
    ll = load_tokenizer(path, len(hf))
    ids = hf("The answer is yes.", add_special_tokens=False).input_ids
    assert hf.convert_ids_to_tokens(ids)[1] == "Ġanswer"
    assert ll.decode_bytes(ids) == b"The answer is yes."
    for text in ('root ::= "The answer is " ("yes" | "no") "."',
                 'start: "The answer is " ("yes" | "no") "."'):
        matcher = llguidance.LLMatcher(ll, grammar.context_free(text), log_level=0)
        assert matcher.validate_tokens(ids) == len(ids), text
    # every whole-text token (no partial UTF-8, no special token) reads as it decodes
    words = [i for i in range(0, len(hf), 97)
             if "\ufffd" not in hf.decode([i]) and i not in hf.all_special_ids]
    assert [ll.decode_bytes([i]) for i in words] == [hf.decode([i]).encode() for i in words]
