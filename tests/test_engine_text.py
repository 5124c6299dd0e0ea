"""Incremental detokenization: streamed text always a prefix of the final text, stop strings cut exactly, text
that may start a stop string held back until it cannot; the decoder it uses gives the tokenizer's own text."""

import copy

from hf_accel.engine.detokenizer import Detokenizer, _held_back, text_decoder
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


def test_the_text_decoder_decodes_as_the_tokenizer_does():
    tokenizer = _tokenizer()
    ids = tokenizer("def f(x):\n    return {'a': x}  # ü € 漢字", add_special_tokens=True)["input_ids"]
    ids += [tokenizer.eos_token_id, 7]
    fast = text_decoder(tokenizer)
    assert fast.func == tokenizer.backend_tokenizer.decode  # the backend's own: transformers' decode only calls it
    for end in range(len(ids) + 1):
        assert fast(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # transformers' decode changes the text: it keeps decoding
    assert text_decoder(cleaning).func == cleaning.decode

    class OwnDecode(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    own = copy.deepcopy(tokenizer)
    own.__class__ = OwnDecode
    assert text_decoder(own)(ids) == "own"
