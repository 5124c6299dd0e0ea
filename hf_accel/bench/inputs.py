"""The prompts benchmarks feed a model: held-out text for a model with a tokenizer, random token ids otherwise, always
left-padded to one width (`input_ids` and `attention_mask`, `[rows, longest]`), and `hf-accel bench`'s spread of
lengths."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from .. import reference
from .models import BenchModel


def prompt_lengths(longest: int, batch_size: int) -> list[int]:
    """Lengths evenly spread from `longest // 2` to `longest` (just `[longest]` for one row)."""
    if batch_size == 1:
        return [longest]
    shortest = max(longest // 2, 1)
    return [shortest + (longest - shortest) * row // (batch_size - 1) for row in range(batch_size)]


def bench_prompts(loaded: BenchModel, lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """Held-out text prompts when the model has a tokenizer (`text_prompts`), else random token ids (`make_prompts`)."""
    if loaded.tokenizer is not None:
        return text_prompts(loaded.tokenizer, lengths)
    pad = loaded.model.generation_config.pad_token_id
    return make_prompts(lengths, loaded.model.config.vocab_size, pad_token_id=0 if pad is None else int(pad))


def text_prompts(tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """Left-padded prompts of the given lengths cut from the held-out text shipped in the package (standard-library
    files the reference models never trained on: `reference.held_out_sequences`), tokenized by `tokenizer`; row r
    starts at a different place in the text."""
    rows = reference.held_out_sequences(tokenizer, max(lengths), max_rows=len(lengths))
    if rows.shape[0] < len(lengths):
        raise ValueError(f"the held-out text shipped in the package gives {rows.shape[0]} rows of {max(lengths)} "
                         f"tokens; asked for {len(lengths)} (lower the prompt length or the batch size)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return left_padded([rows[row, :length] for row, length in enumerate(lengths)], pad)


def copy_heavy_prompts(tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int],
                       num_repeated: int = 16) -> dict[str, torch.Tensor]:
    """`text_prompts` of the given lengths, each followed by a blank line and its own first `num_repeated` tokens:
    the prompt holds a block of code and begins to repeat it (as in editing a file). Row r has `lengths[r] + 1 +
    num_repeated` tokens when the blank line is one token."""
    inputs = text_prompts(tokenizer, lengths)
    blank = torch.tensor(tokenizer.encode("\n\n"), dtype=torch.long)
    blocks = [ids[mask.bool()] for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return left_padded([torch.cat([block, blank, block[:num_repeated]]) for block in blocks], pad)


def make_prompts(
    lengths: Sequence[int], vocab_size: int, pad_token_id: int = 0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random prompts of the given lengths, left-padded: `input_ids` and `attention_mask`, `[len(lengths), max]`."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, vocab_size, (length,), generator=generator) for length in lengths]
    return left_padded(rows, pad_token_id)


def left_padded(rows: Sequence[torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """`input_ids` `[len(rows), longest]` with each row's ids at its right end, `pad_token_id` before them, and the
    `attention_mask` (1 on the ids, 0 on the padding)."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = row
        attention_mask[index, width - len(row) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
