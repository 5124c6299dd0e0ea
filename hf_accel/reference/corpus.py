"""The reference models' corpus: the Python standard library's own source files.

Rule (documented in docs/reference-models.md):
- every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, listed by relative POSIX path in sorted order;
- minus test suites (any folder named ``test``, ``tests`` or ``idle_test``) and installed third-party code
  (``site-packages``);
- minus the folders that distributors often ship separately or that are generated data rather than code, so that
  every CPython 3.11 install yields the same file list: ``idlelib``, ``turtledemo``, ``tkinter``, ``lib2to3``,
  ``distutils``, ``ensurepip``, ``encodings`` (codec tables), ``pydoc_data`` (one generated 750 kB string), and
  the build-specific ``config-*`` folder and ``_sysconfigdata_*.py`` files.

Files are read as UTF-8 with universal newlines. Each file lands in the held-out split when the first 8 bytes of the
SHA-256 of its relative path, read as an integer, are below ``HELD_OUT_PERCENT`` percent of 2**64; a file's split
therefore depends on its path alone, not on which other files exist. ``Corpus.fingerprint`` hashes paths and
contents, so a different install (another patch release) is detectable in the model card.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Split = Literal["train", "held_out"]

HELD_OUT_PERCENT = 5
EXCLUDED_FOLDERS = frozenset(
    {
        "site-packages", "__pycache__", "lib-dynload", "test", "tests", "idle_test",
        "idlelib", "turtledemo", "tkinter", "lib2to3", "distutils", "ensurepip", "encodings", "pydoc_data",
    }
)
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata_")


@dataclass(slots=True)
class Corpus:
    """Files of one split, in corpus order: ``paths[i]`` (relative POSIX path) holds ``texts[i]``."""

    paths: list[str]
    texts: list[str]

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


def stdlib_root() -> Path:
    """The folder this interpreter's standard library lives in."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_included(relative_path: str) -> bool:
    """Whether a relative POSIX path of a ``.py`` file belongs to the corpus (see the module docstring)."""
    parts = PurePosixPath(relative_path).parts
    if not relative_path.endswith(".py"):
        return False
    if any(part in EXCLUDED_FOLDERS for part in parts[:-1]):
        return False
    return not any(part.startswith(EXCLUDED_PREFIXES) for part in parts)


def split_of(relative_path: str) -> Split:
    """The split a file belongs to, from the hash of its relative path alone."""
    value = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big")
    return "held_out" if value * 100 < HELD_OUT_PERCENT * 2**64 else "train"


def list_source_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root`` (default: the stdlib), sorted."""
    root = stdlib_root() if root is None else root
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_FOLDERS]  # prune; is_included decides
        relative = Path(folder).relative_to(root)
        paths.extend((relative / name).as_posix() for name in names)
    return sorted(path for path in paths if is_included(path))


def load_split(split: Split, root: Path | None = None) -> Corpus:
    """The files of one split, in corpus order, read from ``root`` (default: the stdlib)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    root = stdlib_root() if root is None else root
    paths = [path for path in list_source_files(root) if split_of(path) == split]
    return Corpus(paths=paths, texts=[(root / path).read_text(encoding="utf-8") for path in paths])


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
    stream = [token for ids in token_ids for token in (*ids, separator_id)]
    num_rows = len(stream) // seq_len
    return torch.tensor(stream[: num_rows * seq_len], dtype=torch.long).view(num_rows, seq_len)
