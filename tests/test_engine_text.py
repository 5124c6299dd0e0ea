"""Incremental detokenization: streamed text always a prefix of the final text, stop strings cut exactly, text
that may start a stop string held back until it cannot."""

from hf_accel.engine.detokenizer import Detokenizer, _held_back
from hf_accel.reference import load


def _tokenizer():
    return load("draft")[1]


def test_streamed_text_is_always_a_prefix_of_the_decoded_text():
    tokenizer = _tokenizer()
    text = "def f(x):\n    return x * 2  # double ü €\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer, stop=[])
    for token in ids:
        assert detok.add(token) is None
        assert text.startswith(detok.text[: detok.released])
    detok.finish()
    assert detok.text == tokenizer.decode(ids) == text


def test_stop_string_cuts_text_and_partial_stops_are_held_back():
    tokenizer = _tokenizer()
    ids = tokenizer("x = 1\nreturn x\n", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer, stop=["return"])
    stop = None
    for token in ids:  # the engine ends the sequence at the first stop
        if (stop := detok.add(token)) is not None:
            break
    assert stop == "return"
    assert detok.text == "x = 1\n" and detok.released == len("x = 1\n")
    assert _held_back("abc ret", ["return"]) == 3 and _held_back("abc", ["return"]) == 0
