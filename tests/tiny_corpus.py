"""A small tokenizer and packed training rows from the reference corpus, for tests that train the tiny preset."""

import torch

from hf_accel.reference import corpus
from hf_accel.training.reference_presets import TRAIN_RECIPES
from hf_accel.training.reference_tokenizer import train_tokenizer


def tiny_tokenizer():
    """A 512-token BPE trained on the first 20 train files."""
    return train_tokenizer(corpus.load_split("train").texts[:20], vocab_size=512)


def packed_rows(tokenizer, num_files: int) -> torch.Tensor:
    """The first `num_files` train files packed into rows of the tiny recipe's sequence length."""
    ids = corpus.tokenize(corpus.load_split("train").texts[:num_files], tokenizer)
    return corpus.pack_sequences(ids, tokenizer.eos_token_id, TRAIN_RECIPES["tiny"].seq_len)
