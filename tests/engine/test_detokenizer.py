"""Incremental detokenization and stop strings on the demo tokenizer (byte-level BPE, so
multi-byte characters really are split across tokens)."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, StopChecker

TEXTS = [
    "Café naïve über façade garçon señor élève",
    "東京の天気は晴れです。中文字符和漢字",
    "Emoji 😀🚀🎉 thumbs 👍🏽 heart ❤️ flag 🇫🇷 robot 🤖",
    "Mixed: kari 東京 😀 tona é ∑∞ → done",
]


def stream(tokenizer, ids: list[int], context: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, context or [1])
    pieces = [detok.step(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_characters_are_never_emitted_half(tokenizer):
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    assert len(ids) > len(TEXTS[2].split())  # emoji span several tokens
    pieces = stream(tokenizer, ids)
    assert "" in pieces[:-1]  # some token completed no character


def test_random_token_sequences_round_trip(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(5, tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        assert "".join(stream(tokenizer, ids, context=[1, 200, 300])) == tokenizer.decode(ids)


def test_stop_string_split_across_tokens_is_caught_and_trimmed(tokenizer):
    text = "kari tona sefi mole dasu vika"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    # A stop string that starts in one token's text and ends in the next one's.
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 2]
    assert all(stop not in p for p in pieces)
    checker = StopChecker((stop,))
    emitted, hit_at = [], None
    for i, piece in enumerate(pieces):
        if checker.append(piece):
            hit_at = i
            emitted.append(checker.take(finished=True))
            break
        emitted.append(checker.take(finished=False))
    assert hit_at == 2
    assert "".join(emitted) == text[: text.index(stop)]
    assert all(stop not in "".join(emitted[: k + 1]) for k in range(len(emitted)))


def test_include_stop_string_keeps_it():
    checker = StopChecker(("END",), include_stop_str=True)
    assert not checker.append("abc E")
    assert checker.take(False) == "abc "  # "E" held back: could start the stop string
    assert checker.append("NDxyz")
    assert checker.take(True) == "END"
    assert checker.text == "abc END"


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(("zz", "b"))
    assert checker.append("aazzb")
    assert checker.text == "aa"


def test_a_stop_string_must_end_in_the_text_just_checked():
    """Text held unchecked (min_tokens) is never searched later: a short stop string that
    lies wholly in it is not found when checking starts, even inside a longer stop
    string's reach; one that runs from it into the checked text is."""
    checker = StopChecker((".", "\n4."))
    assert not checker.append("1. 1\n2. ", check=False)
    assert not checker.append("2")  # the "." two characters back was never checked
    assert checker.append(" 3.") and checker.text == "1. 1\n2. 2 3"
    straddling = StopChecker(("2. 2",))
    assert not straddling.append("1. 1\n2.", check=False)
    assert straddling.append(" 2") and straddling.matched == "2. 2"
