"""Constrained output on rank 0: one llguidance matcher per constrained request.

Matchers live where tokens are sampled, so each one advances in the same step that drew
its token: nothing waits for the batcher, however far ahead it schedules. A matcher is
built on a thread (llguidance drops the GIL) as soon as its request reaches the shard,
from a template cached by grammar text, and joined only at the request's first sample,
so the prefill forward runs meanwhile. Each step masks the constrained rows' logits to
the tokens the grammar allows (EOS only where it accepts); other rows are untouched.
A matcher that fails (a grammar past llguidance's limits) fails its request, not the step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where logits are masked, not by the HTTP front's
    import torch  # grammar checks (the front's modules import without the model stack)

logger = logging.getLogger(__name__)
TEMPLATE_CACHE_SIZE = 256


class GrammarError(Exception):
    pass


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int):
        self.vocab_size = vocab_size
        self.model_dir = model_dir
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._tokenizer: Future | None = None  # loaded with the first grammar, on the pool
        self._templates: OrderedDict[str, Future] = OrderedDict()
        self._lock = Lock()
        self._matchers: dict[str, Future] = {}

    def add(self, request_id: str, grammar: str, output_token_ids: list[int]) -> None:
        """Start `request_id`'s matcher; a resumed request replays its output so far."""
        template = self._template(grammar)
        self._matchers[request_id] = self._pool.submit(_matcher, template, output_token_ids)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(self, logits: torch.Tensor, request_ids: list[str],
             drafts: list[int | None] | None = None) -> dict[str, str]:
        """Mask each constrained row in place; returns request id -> error for rows whose
        matcher failed (their row is left as it was, and the request must end).

        A drafting request has a row per draft and one after them, in order (`drafts`: per
        row, the draft its token is checked against, None after the last): its matcher
        takes each draft after masking that draft's row, so the next row is masked as
        decoding would mask it once that draft is kept, and gives them back at the end. A
        draft the grammar forbids ends the draft: it cannot be drawn, so the rows after it
        are dropped whatever their masks."""
        rows = [(i, rid) for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return {}
        import llguidance.torch as lt
        import torch

        errors: dict[str, str] = {}
        bitmask = lt.allocate_token_bitmask(len(rows), self.vocab_size)
        masked = []
        taken: dict[str, int] = {}  # drafts each matcher took, to give back
        ended: set[str] = set()  # a forbidden draft ended the request's draft
        for j, (i, rid) in enumerate(rows):
            if rid in errors:
                continue
            try:
                matcher = self._matchers[rid].result()
                lt.fill_next_token_bitmask(matcher, bitmask, j)
                if matcher.is_error():
                    raise GrammarError(matcher.get_error())
                draft = drafts[i] if drafts is not None else None
                if draft is not None and rid not in ended:
                    if _allows(bitmask[j], draft) and matcher.consume_token(draft):
                        taken[rid] = taken.get(rid, 0) + 1
                    else:
                        ended.add(rid)
            except Exception as exc:  # a grammar error ends its own request only
                errors[rid] = f"grammar failed: {exc}"[:500]
                self._matchers.pop(rid)
                continue
            masked.append((i, j))
        for rid, n in taken.items():
            if rid in self._matchers:
                self._matchers[rid].result().rollback(n)
        if masked:
            index = torch.tensor([i for i, _ in masked], device=logits.device)
            allowed = _unpack(bitmask[[j for _, j in masked]], logits.shape[1]).to(logits.device)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return errors

    def advance(self, sampled: list[tuple[str, int]]) -> dict[str, str]:
        """Feed each constrained request its sampled token; errors as in `mask`."""
        errors = {}
        for rid, token in sampled:
            future = self._matchers.get(rid)
            if future is None:
                continue
            matcher = future.result()
            if not matcher.consume_token(token) or matcher.is_error():
                errors[rid] = f"grammar failed: {matcher.get_error()}"[:500]
                self._matchers.pop(rid)
        return errors

    def _template(self, grammar: str) -> Future:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(load_tokenizer, self.model_dir,
                                                    self.vocab_size)
            template = self._templates.get(grammar)
            if template is None:
                template = self._pool.submit(_compile, self._tokenizer, grammar)
                self._templates[grammar] = template
                if len(self._templates) > TEMPLATE_CACHE_SIZE:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
            return template


def load_tokenizer(model_dir: str, vocab_size: int):
    """llguidance's view of the model's tokenizer, over the logits' width (~1 s for a
    large vocabulary: built once, on a thread)."""
    import copy
    import json

    import llguidance

    from shards.checkpoints import resolve as checkpoint

    tokenizer = checkpoint.load_tokenizer(model_dir)
    backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer reads it
    backend.no_padding()
    backend.no_truncation()
    spec = byte_level_as_such(json.loads(backend.to_str()))
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size,
                                  eos_token=tokenizer.eos_token_id)


def byte_level_as_such(spec: dict) -> dict:
    """A byte-level BPE tokenizer (GPT-2's: `Ġ` is a space) whose decoder is SentencePiece's
    steps around ByteLevel and whose model says byte_fallback: what transformers makes of a
    GGUF file's gpt2 tokenizer (SmolLM2's). llguidance reads byte_fallback's convention
    then, takes `Ġanswer` for the bytes of `Ġ` and `answer`, and refuses every token that
    starts with a space where a grammar writes one. Told plainly that it is byte-level, it
    reads each token's bytes as the tokenizer decodes them."""
    def byte_level(node) -> bool:
        if not isinstance(node, dict):
            return False
        return node.get("type") == "ByteLevel" or any(
            byte_level(n) for n in node.get("pretokenizers", node.get("decoders", [])))

    decoder = spec.get("decoder")
    if not byte_level(spec.get("pre_tokenizer")) or not byte_level(decoder) or \
            decoder.get("type") == "ByteLevel":
        return spec
    return {**spec, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                "trim_offsets": True, "use_regex": True},
            "model": {**spec["model"], "byte_fallback": False}}


def parser_limits():
    """llguidance's limits, the same at the ingress's check and here. Its lexer fuel is a
    fifth of the default: a pathological regex such as `(x{1000}){1000}` then fails in
    ~80 ms instead of ~1.5 s of a core, while a 60-property schema with patterns still
    compiles in ~4 ms (benchmarks/NOTES.md). Errors do not echo parser state."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)


def _compile(tokenizer: Future, grammar: str):
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer.result(), grammar, log_level=0,
                                   limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()  # builds the lexer's first states here, not in a step
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return matcher


def _matcher(template: Future, output_token_ids: list[int]):
    matcher = template.result().deep_copy()
    if output_token_ids and not matcher.consume_tokens(output_token_ids):
        raise GrammarError(f"resumed output does not fit the grammar: {matcher.get_error()}")
    return matcher


def _allows(words: torch.Tensor, token_id: int) -> bool:
    """Whether one row of the int32 bitmask allows `token_id`."""
    word = token_id >> 5
    return 0 <= word < len(words) and bool((int(words[word]) >> (token_id & 31)) & 1)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab] bool (bit b of word w is token 32w+b)."""
    import torch

    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
