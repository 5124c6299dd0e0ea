"""The held-out text shipped in the package: the prompts and scored rows of `hf-accel bench`, the benchmarks, the
notebooks and the tests, the same on every install (``reference.held_out_sequences``).

``assets/held_out/files.jsonl`` holds the standard library's held-out files (CPython, PSF-2.0), one JSON object
``{"path", "text"}`` per line in corpus order: exactly the first files of the corpus split "held_out" (the stdlib
comes first in corpus order, and its held-out files depend on no package), so rows cut from it equal the first rows
cut from that split. Beside it: ``LICENSE.txt`` (that Python's licence file, which the PSF licence asks to keep
with copies) and ``provenance.json``: the Python version, the licence, the SHA-256 of ``files.jsonl``, the
``Corpus.fingerprint`` of paths and texts, and file, byte and token counts.

Rebuild all three from this interpreter's standard library (``held_out_command.py``):
    python -m hf_accel.reference.held_out_command
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from .corpus import Corpus, build_corpus, count_tokens
from .sources import Source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HELD_OUT_DIR = Path(__file__).resolve().parent / "assets" / "held_out"
FILES_NAME, PROVENANCE_NAME, LICENCE_NAME = "files.jsonl", "provenance.json", "LICENSE.txt"
LICENCE = "PSF-2.0"


def stdlib_held_out(stdlib: Source) -> Corpus:
    """The standard library's files of the "held_out" split, in corpus order (built from the stdlib alone: the
    sources after it in corpus order cannot change which stdlib files are kept or how they split)."""
    return build_corpus([stdlib], held_out_packages=()).splits["held_out"]


def shipped_text(folder: Path = HELD_OUT_DIR) -> Corpus:
    """The shipped held-out files, in corpus order."""
    lines = (Path(folder) / FILES_NAME).read_text(encoding="utf-8").split("\n")
    records = [json.loads(line) for line in lines if line]  # split on "\n" only: texts may hold U+2028
    return Corpus([record["path"] for record in records], [record["text"] for record in records])


def read_provenance(folder: Path = HELD_OUT_DIR) -> dict:
    """``provenance.json`` of the shipped held-out text (see the module docstring)."""
    return json.loads((Path(folder) / PROVENANCE_NAME).read_text())


def file_sha256(folder: Path = HELD_OUT_DIR) -> str:
    """SHA-256 of the bytes of ``files.jsonl``."""
    return hashlib.sha256((Path(folder) / FILES_NAME).read_bytes()).hexdigest()


def write_held_out(texts: Corpus, licence_text: str, tokenizer: PreTrainedTokenizerBase,
                   folder: Path = HELD_OUT_DIR) -> dict:
    """Write ``texts`` as ``files.jsonl``, the licence they come under as ``LICENSE.txt`` and their
    ``provenance.json`` into ``folder``; returns the provenance."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"path": path, "text": text}, ensure_ascii=False) + "\n"
             for path, text in zip(texts.paths, texts.texts, strict=True)]
    (folder / FILES_NAME).write_text("".join(lines), encoding="utf-8")
    (folder / LICENCE_NAME).write_text(licence_text, encoding="utf-8")
    provenance = {
        "source": f"CPython {platform.python_version()} standard library: the files of the reference corpus's "
                  "held-out split (hf_accel/reference/corpus.py), in corpus order, as the corpus reads them (UTF-8, "
                  "universal newlines)",
        "python": platform.python_version(),
        "licence": LICENCE,
        "licence_file": LICENCE_NAME,
        "files": texts.num_files,
        "bytes": texts.num_bytes,
        "tokens": count_tokens(texts.texts, tokenizer),  # reference tokenizer, no end-of-text separators
        "fingerprint": texts.fingerprint,
        "sha256": file_sha256(folder),
        "command": "python -m hf_accel.reference.held_out_command",
    }
    (folder / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance
