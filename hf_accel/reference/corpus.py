"""The reference models' corpus: de-duplicated Python source of the stdlib and a fixed set of packages, in 3 splits.

Rules (documented in docs/reference-models.md); the files of each source come from ``sources.py``:
- **corpus order**: sources in order (stdlib, train packages, held-out packages), each source's files sorted by path;
  a file's corpus path is ``<source>/<relative path>``;
- **exact duplicates**: a file whose text (after newline normalisation) equals an earlier file's is dropped;
- **near duplicates**: a file with at least ``NEAR_DUP_MIN_LINES`` distinct code lines (stripped, at least
  ``NEAR_DUP_LINE_CHARS`` characters) of which at least ``NEAR_DUP_SHARE`` already occurred in earlier kept files
  is dropped (transformers' "Copied from" modeling files, vendored copies, generated twins);
- **splits**: every file of a held-out package is ``held_out_packages`` (whole packages never trained on); any
  other file is ``held_out`` when the first 8 bytes of the SHA-256 of its relative path (without the source name,
  so the stdlib's held-out files are the same as in the stdlib-only v1 corpus), read as an integer, are below
  ``HELD_OUT_PERCENT`` percent of 2**64, else ``train``.

``Corpus.fingerprint`` hashes paths and contents, so a different install is detectable in the model card.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from .sources import HELD_OUT_PACKAGES, Source, default_sources

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Split = Literal["train", "held_out", "held_out_packages"]
SPLITS: tuple[Split, ...] = ("train", "held_out", "held_out_packages")

HELD_OUT_PERCENT = 5
NEAR_DUP_SHARE = 0.7
NEAR_DUP_MIN_LINES = 10
NEAR_DUP_LINE_CHARS = 16


@dataclass(slots=True)
class Corpus:
    """Files of one split, in corpus order: ``paths[i]`` (``<source>/<relative path>``) holds ``texts[i]``."""

    paths: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def num_files(self) -> int:
        return len(self.paths)

    @property
    def num_bytes(self) -> int:
        """Size in UTF-8 bytes, after newline normalisation."""
        return sum(len(text.encode("utf-8")) for text in self.texts)

    @property
    def fingerprint(self) -> str:
        """SHA-256 over paths and contents in order: equal fingerprints mean an identical corpus."""
        digest = hashlib.sha256()
        for path, text in zip(self.paths, self.texts, strict=True):
            digest.update(path.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
        return digest.hexdigest()


@dataclass(slots=True)
class SourceRecord:
    """What the corpus took from one source: files kept per split and files dropped per rule (model card rows)."""

    name: str
    version: str
    licence: str
    files: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    exact_duplicates: int = 0
    near_duplicates: int = 0


@dataclass(slots=True)
class SplitCorpus:
    """The three splits and one record per source."""

    splits: dict[str, Corpus]
    sources: list[SourceRecord]


def split_of(relative_path: str, held_out_package: bool = False) -> Split:
    """The split of a file from its source's kind and the hash of its path inside the source alone."""
    if held_out_package:
        return "held_out_packages"
    value = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big")
    return "held_out" if value * 100 < HELD_OUT_PERCENT * 2**64 else "train"


def _line_keys(text: str) -> set[bytes]:
    lines = {line.strip() for line in text.splitlines()}
    return {hashlib.blake2b(line.encode("utf-8"), digest_size=8).digest() for line in lines
            if len(line) >= NEAR_DUP_LINE_CHARS}


class _Deduplicator:
    """Remembers kept files' content hashes and line keys; ``verdict`` says why a new file is dropped, or None."""

    def __init__(self) -> None:
        self.contents: set[bytes] = set()
        self.lines: set[bytes] = set()

    def verdict(self, text: str) -> str | None:
        content = hashlib.sha256(text.encode("utf-8")).digest()
        if content in self.contents:
            return "exact"
        keys = _line_keys(text)
        seen = len(keys & self.lines)
        if len(keys) >= NEAR_DUP_MIN_LINES and seen >= NEAR_DUP_SHARE * len(keys):
            return "near"
        self.contents.add(content)
        self.lines |= keys
        return None


def build_corpus(sources: Sequence[Source], held_out_packages: Iterable[str] = HELD_OUT_PACKAGES) -> SplitCorpus:
    """De-duplicate the sources' files in corpus order and split them (see the module docstring)."""
    held_out_names = set(held_out_packages)
    result = SplitCorpus({split: Corpus() for split in SPLITS}, [])
    dedup = _Deduplicator()
    for source in sources:
        record = SourceRecord(source.name, source.version, source.licence)
        for path in source.paths:
            text = source.read(path)
            verdict = dedup.verdict(text)
            if verdict == "exact":
                record.exact_duplicates += 1
            elif verdict == "near":
                record.near_duplicates += 1
            else:
                split = split_of(path, source.name in held_out_names)
                record.files[split] += 1
                result.splits[split].paths.append(f"{source.name}/{path}")
                result.splits[split].texts.append(text)
        result.sources.append(record)
    return result


@functools.cache
def default_corpus() -> SplitCorpus:
    """The corpus of ``sources.default_sources()``, built once per process (a pure function of the install).

    Raises ``ModuleNotFoundError`` naming the install command when a corpus distribution is not installed (the base
    install lacks some; the benchmarks' held-out text ships in the package instead, see ``held_out.py``).
    """
    try:
        sources = default_sources()
    except importlib.metadata.PackageNotFoundError as missing:
        raise ModuleNotFoundError(
            f"the reference corpus reads the sources of the distributions pinned in constraints.txt, and "
            f"{missing.name!r} is not installed: pip install -c constraints.txt -e \".[dev]\"", name=missing.name,
        ) from missing
    return build_corpus(sources)


def load_split(split: Split) -> Corpus:
    """The files of one split of the default corpus, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return default_corpus().splits[split]


def tokenize(texts: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def count_tokens(texts: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> int:
    """Number of tokens the tokenizer gives the texts, without special tokens (packing adds one
    ``<|endoftext|>`` per file on top of this)."""
    return sum(len(ids) for ids in tokenize(texts, tokenizer))


def pack_sequences(token_ids: list[list[int]], separator_id: int, seq_len: int) -> torch.Tensor:
    """Concatenate documents, each followed by ``separator_id``, and cut the stream into rows.

    Returns ``[num_rows, seq_len]`` int64; the tail shorter than ``seq_len`` is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    separator = torch.tensor([separator_id], dtype=torch.long)
    pieces = [piece for ids in token_ids for piece in (torch.tensor(ids, dtype=torch.long), separator)]
    stream = torch.cat(pieces) if pieces else separator[:0]
    num_rows = len(stream) // seq_len
    return stream[: num_rows * seq_len].view(num_rows, seq_len)
