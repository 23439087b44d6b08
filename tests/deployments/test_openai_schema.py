"""The OpenAI adapter's prompt handling, without a server."""

from __future__ import annotations

import pytest

from deployments.admission import ApiError
from deployments.openai_schema import CompletionRequest, prompts


class CountingTokenizer:
    """The real tokenizer, counting how often its vocabulary is sized (about 1 ms a time)."""

    def __init__(self, tok):
        self.tok, self.sized = tok, 0

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def __len__(self):
        self.sized += 1
        return len(self.tok)


def test_token_id_prompts_are_checked_against_the_vocabulary(tokenizer):
    vocab = len(tokenizer)
    tok = CountingTokenizer(tokenizer)
    assert prompts(tok, CompletionRequest(model="m", prompt=[1, vocab - 1]), chat=False) == \
        [[1, vocab - 1]]
    assert prompts(tok, CompletionRequest(model="m", prompt=[[1], [2, 3]]), chat=False) == \
        [[1], [2, 3]]
    for bad_ids in ([1, vocab], [[1], [-1]]):
        with pytest.raises(ApiError) as err:
            prompts(tok, CompletionRequest(model="m", prompt=bad_ids), chat=False)
        assert err.value.status == 400
        assert err.value.message == f"prompt token ids must be in [0, {vocab})"
    assert tok.sized == 4


def test_text_prompts_do_not_size_the_vocabulary(tokenizer):
    tok = CountingTokenizer(tokenizer)
    for text in ("Tona sefi", ["Tona", "sefi mole"]):
        got = prompts(tok, CompletionRequest(model="m", prompt=text), chat=False)
        texts = [text] if isinstance(text, str) else text
        assert got == [tokenizer(t).input_ids for t in texts]
    assert tok.sized == 0
