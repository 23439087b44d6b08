"""Incremental detokenization: text out as tokens arrive, never half a character.

The window trick (as in TGI and vLLM): decode the last few tokens with and without the
new ones and emit the difference, unless it ends in U+FFFD (an incomplete UTF-8 byte
sequence, finished by a later token). `flush` emits what is left when the request ends,
so the pieces always concatenate to the decode of the whole output."""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context, so tokenizers that drop a leading space at the
# start of a decode (sentencepiece) still produce it for the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Text that `token_id` completes ("" while a character is still partial)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """What is left at the end: bytes that never completed a character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""


class StopChecker:
    """Finds stop strings in the text as it grows, even when one spans several tokens.
    While streaming it holds back the end of the text that could begin a stop string, so
    no client ever sees text that is then trimmed away."""

    def __init__(self, stop: tuple[str, ...], include_stop_str: bool = False):
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.text = ""
        self.num_emitted = 0
        self.matched: str | None = None  # the stop string that ended the text

    def append(self, piece: str, check: bool = True) -> bool:
        """Add text; True if a stop string now ends the output (text is then trimmed).
        A stop string counts only where it ends in the new piece: one that lies wholly in
        unchecked text (min_tokens) is never found later, whatever is appended after it."""
        if not piece:
            return False
        before = len(self.text)
        self.text += piece
        if not check:
            return False
        found = -1
        stop_len = 0
        for stop in self.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1 and (found == -1 or at < found):
                found, stop_len = at, len(stop)
        if found == -1:
            return False
        self.matched = self.text[found:found + stop_len]
        self.text = self.text[: found + stop_len] if self.include_stop_str else self.text[:found]
        return True

    def take(self, finished: bool) -> str:
        """New text a client may see now."""
        end = len(self.text) if finished else max(self.num_emitted,
                                                  len(self.text) - self._partial_stop_len())
        out = self.text[self.num_emitted : end]
        self.num_emitted = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best
