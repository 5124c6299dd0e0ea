"""Byte-level BPE tokenizer for the reference models, trained with `tokenizers` on the train split.

Byte-level pre-tokenization without an added prefix space and a byte-level decoder make ``decode(encode(text))``
return ``text`` exactly for any string. One special token, ``<|endoftext|>``, is bos, eos and pad: it separates
files when the corpus is packed into training sequences. The tokenizer is wrapped in ``PreTrainedTokenizerFast`` so
``save_pretrained`` writes the standard ``tokenizer.json`` that ``AutoTokenizer.from_pretrained(folder)`` loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
MIN_VOCAB_SIZE = 256 + 1  # every byte plus the special token


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for the same texts in the same order).

    ``vocab_size`` counts the 256 byte tokens and ``<|endoftext|>`` (id 0); the result may be smaller when the
    texts allow fewer merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(backend)


def wrap_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a trained backend, with ``<|endoftext|>`` as bos, eos and pad."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> Path:
    """Write ``tokenizer.json`` and its config into ``folder`` (created if needed); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return folder
