"""How the trainers of this package get their training rows and batches.

- `training_data`: what the training commands read: a `datasets.save_to_disk` folder, else the reference corpus's
  train split (`reference.corpus`);
- `token_rows`: any of those forms (texts, id lists, a `datasets.Dataset`, a tensor) as `[rows, seq_len]` ids:
  documents joined with a separator (the tokenizer's EOS) and cut into rows (`reference.corpus.pack_sequences`);
- `self_distilled_rows`: the model's own greedy continuations of row prompts: what greedy decoding will ask a
  speculative head to guess (`self_distilled_data`: a command's rows of them, plus rows of the data itself);
- `batch_indices`: the head trainers' batch order: the rows of step s come from epoch e = s // (rows // batch),
  a permutation seeded `seed + e`, so a run resumed at step s sees the same batches;
- `seeded_batches`: the reference models' batch order: epochs of one seeded shuffle, a batch never spanning two
  epochs; a resumed run replays it up to its step.

The fine-tune path's text and rows are `finetune_domain.py`; LoRA's `datasets.Dataset` is `lora.lm_dataset`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..reference.corpus import load_split, pack_sequences


def training_data(dataset: Path | None) -> Any:
    """The `datasets.Dataset` saved in folder `dataset` (needs `datasets`), or by default the texts of the
    reference corpus's train split (needs the `dev` extra)."""
    if dataset is None:
        return load_split("train").texts
    import datasets  # optional dependency, needed only for a saved dataset

    return datasets.load_from_disk(str(dataset))


def token_rows(
    dataset: Any, seq_len: int, tokenizer: PreTrainedTokenizerBase | None = None, separator_id: int | None = None
) -> torch.Tensor:
    """`[rows, seq_len]` training ids from a `datasets.Dataset` (column "input_ids" or "text"), a list of texts, a
    list of id lists, or a `[rows, >= seq_len]` tensor. Documents are joined with `separator_id` (default: the
    tokenizer's EOS) and cut into rows."""
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() != 2 or dataset.shape[1] < seq_len:
            raise ValueError(f"a tensor `dataset` must be [rows, >= seq_len={seq_len}], got {tuple(dataset.shape)}")
        return dataset[:, :seq_len].long()
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:  # a datasets.Dataset
        column = "input_ids" if "input_ids" in column_names else "text"
        if column not in column_names:
            raise ValueError(f"`dataset` needs an 'input_ids' or 'text' column, has {column_names}")
        dataset = dataset[column]
    items = list(dataset)
    if not items:
        raise ValueError("`dataset` is empty")
    if isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("a `dataset` of text needs `tokenizer=`")
        items = tokenizer(items, add_special_tokens=False)["input_ids"]
    separator = separator_id if separator_id is not None else getattr(tokenizer, "eos_token_id", None)
    rows = pack_sequences([list(ids) for ids in items], 0 if separator is None else separator, seq_len)
    if rows.shape[0] == 0:
        raise ValueError(f"`dataset` holds fewer than seq_len={seq_len} tokens")
    return rows


@torch.no_grad()
def self_distilled_rows(model: PreTrainedModel, rows: torch.Tensor, prompt_len: int = 32, batch_size: int = 64,
                        progress: bool = False) -> torch.Tensor:
    """The model's own greedy continuations of the first `prompt_len` tokens of each of `rows` `[n, seq]`, as
    `[n, seq]` training rows (Medusa's self-distillation data: what greedy decoding will ask the heads to guess)."""
    device, seq_len, out = next(model.parameters()).device, rows.shape[1], []
    for start in tqdm(range(0, rows.shape[0], batch_size), desc="self-distillation data", disable=not progress):
        prompts = rows[start : start + batch_size, :prompt_len].to(device)
        out.append(model.generate(prompts, max_new_tokens=seq_len - prompt_len, min_new_tokens=seq_len - prompt_len,
                                  do_sample=False, eos_token_id=None, pad_token_id=0).cpu())
    return torch.cat(out)


def self_distilled_data(model: PreTrainedModel, data: Any, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                        num_rows: int, data_rows: int = 0, progress: bool = False) -> torch.Tensor:
    """`[num_rows + data_rows, seq_len]`: the model's greedy continuations of 32-token prompts from `num_rows` rows
    of `data` (`token_rows`), then `data_rows` further rows of the data itself; rows in a permutation seeded 0."""
    rows = token_rows(data, seq_len, tokenizer, model.generation_config.eos_token_id)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))
    distilled = self_distilled_rows(model, rows[order[:num_rows]], progress=progress)
    return torch.cat([distilled, rows[order[num_rows : num_rows + data_rows]]])


def batch_indices(num_rows: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Row indices of step `step`: epochs of a seeded permutation, so a resumed run sees the same batches."""
    per_epoch = max(num_rows // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    take = order[index * batch_size : (index + 1) * batch_size]
    return take if take.numel() else order[:batch_size]


def seeded_batches(rows: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless `[batch_size, seq]` batches of `rows`: epochs of one seeded shuffle; a batch never spans two epochs."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(rows), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield rows[order[start : start + batch_size]]


__all__ = ["batch_indices", "seeded_batches", "self_distilled_data", "self_distilled_rows", "token_rows",
           "training_data"]
