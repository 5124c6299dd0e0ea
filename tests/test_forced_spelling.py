"""`ForcedSpelling.record`: which of the tokens written after a forced text spell it."""

from __future__ import annotations

from hf_accel.structured.forced_spelling import MAX_SPELLED, MAX_TEXTS, ForcedSpelling

TOKEN_BYTES = [0, 1, 2, 3, 4]  # token i is i bytes long (token 0: a special token, no text)


def test_tokens_that_reach_the_end_of_the_text_are_its_spelling():
    spelling = ForcedSpelling(TOKEN_BYTES)
    assert spelling.record("abcde", 5, [2, 3, 4, 1]) and spelling.get("abcde") == [2, 3]


def test_a_token_that_crosses_the_end_is_left_out():
    spelling = ForcedSpelling(TOKEN_BYTES)
    assert spelling.record("abcd", 4, [3, 2, 1]) and spelling.get("abcd") == [3]
    assert spelling.record("ab", 2, [4]) and spelling.get("ab") is None  # nothing ends inside it: not recorded


def test_tokens_short_of_the_end_wait():
    spelling = ForcedSpelling(TOKEN_BYTES)
    assert not spelling.record("abcdef", 6, [2, 3]) and spelling.get("abcdef") is None
    assert spelling.record("abcdef", 6, [2, 3, 1]) and spelling.get("abcdef") == [2, 3, 1]


def test_a_first_token_past_the_end_drops_the_record():
    spelling = ForcedSpelling(TOKEN_BYTES)
    spelling.record("ab", 2, [1, 1])
    assert spelling.record("ab", 2, [4]) and spelling.get("ab") is None


def test_a_new_spelling_replaces_the_old_and_the_oldest_texts_go():
    spelling = ForcedSpelling(TOKEN_BYTES)
    spelling.record("abc", 3, [3])
    spelling.record("abc", 3, [1, 2])
    assert spelling.get("abc") == [1, 2]
    for i in range(MAX_TEXTS):
        spelling.record(f"{i:04d}", 4, [4])
    assert len(spelling) == MAX_TEXTS and spelling.get("abc") is None and spelling.get("0001") == [4]


def test_long_spellings_keep_their_first_tokens():
    spelling = ForcedSpelling(TOKEN_BYTES)
    assert spelling.record("x" * 40, 40, [1] * 40) and spelling.get("x" * 40) == [1] * MAX_SPELLED
