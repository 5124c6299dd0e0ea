"""The fine-tuning domain: English prose about software, read offline from installed distributions.

The reference target was trained on Python source only. The long descriptions in the `METADATA` files of the
installed distributions (`importlib.metadata`: their README as Markdown or reStructuredText) are a domain it never
saw, and they are on every machine that has hf_accel installed, with no download. Rules:
- one document per distribution that has a description of at least `min_chars` characters, cut to `max_chars`;
  hf_accel's own README is left out (it changes with every commit);
- a distribution is held out when the CRC-32 of its lower-cased name is below `held_out_percent` percent of 2**32,
  so train and held-out never share a package and the split does not depend on what else is installed;
- documents go in name order, each followed by the tokenizer's EOS, packed into rows
  (`reference.corpus.pack_sequences`).
The texts depend on what is installed: `DomainTexts.sources` records which distributions were used.
"""

from __future__ import annotations

import importlib.metadata
import zlib
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from ..reference.corpus import pack_sequences, tokenize

EXCLUDED = ("hf_accel",)


@dataclass(slots=True)
class DomainTexts:
    """Documents of one split and the distributions they came from (same order)."""

    texts: list[str]
    sources: list[str]

    @property
    def num_chars(self) -> int:
        return sum(len(text) for text in self.texts)


@dataclass(slots=True)
class DomainSplits:
    """The train and held-out documents (disjoint by distribution)."""

    train: DomainTexts
    held_out: DomainTexts


def package_descriptions(min_chars: int = 500, max_chars: int = 20_000) -> dict[str, str]:
    """`{distribution name (lower case): long description}` of the installed distributions, sorted by name; those
    shorter than `min_chars` are skipped, longer ones cut to `max_chars` characters."""
    if min_chars < 1 or max_chars < min_chars:
        raise ValueError(f"need 1 <= `min_chars` <= `max_chars`, got min_chars={min_chars}, max_chars={max_chars}")
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and name not in EXCLUDED and len(body) >= min_chars:
            found[name] = body[:max_chars]
    return dict(sorted(found.items()))


def is_held_out(name: str, held_out_percent: float) -> bool:
    """Whether distribution `name` belongs to the held-out split (CRC-32 of its lower-cased name)."""
    return zlib.crc32(name.lower().encode()) < held_out_percent / 100 * 2**32


def split_descriptions(descriptions: dict[str, str], held_out_percent: float = 15.0) -> DomainSplits:
    """Split `{name: text}` by distribution; raises ValueError when either split would be empty."""
    if not 0 < held_out_percent < 100:
        raise ValueError(f"`held_out_percent` must be in (0, 100), got {held_out_percent}")
    train, held_out = DomainTexts([], []), DomainTexts([], [])
    for name, text in descriptions.items():
        split = held_out if is_held_out(name, held_out_percent) else train
        split.texts.append(text)
        split.sources.append(name)
    if not train.texts or not held_out.texts:
        raise ValueError(f"{len(descriptions)} descriptions give an empty split at held_out_percent={held_out_percent}")
    return DomainSplits(train, held_out)


def domain_splits(held_out_percent: float = 15.0, min_chars: int = 500, max_chars: int = 20_000) -> DomainSplits:
    """The installed distributions' descriptions, split by distribution (see the module docstring)."""
    return split_descriptions(package_descriptions(min_chars, max_chars), held_out_percent)


def text_rows(texts: DomainTexts, tokenizer: PreTrainedTokenizerBase, seq_len: int,
              max_rows: int | None = None) -> torch.Tensor:
    """`[rows, seq_len]` token ids: the documents in order, each followed by EOS, cut into rows; at most `max_rows`
    rows, spread evenly over the whole split so every part of it is represented."""
    if seq_len < 2:
        raise ValueError(f"`seq_len` must be at least 2, got {seq_len}")
    rows = pack_sequences(tokenize(texts.texts, tokenizer), tokenizer.eos_token_id, seq_len)
    if rows.shape[0] == 0:
        raise ValueError(f"{texts.num_chars} characters of text give no row of seq_len={seq_len} tokens")
    if max_rows is None or max_rows >= rows.shape[0]:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, max_rows).long()]


__all__ = ["DomainSplits", "DomainTexts", "domain_splits", "package_descriptions", "split_descriptions", "text_rows"]
