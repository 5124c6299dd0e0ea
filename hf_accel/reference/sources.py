"""Where the reference corpus comes from: the stdlib and a fixed list of installed distributions.

A ``Source`` is one origin of files: the stdlib, or one distribution (named as on PyPI, read through
``importlib.metadata``, so its files are the ones its ``RECORD`` lists). The package set is fixed data
(``TRAIN_PACKAGES``, ``HELD_OUT_PACKAGES``: exactly the distributions pinned in constraints.txt), never "whatever is
installed", so that a fresh ``pip install -c constraints.txt -e ".[dev]"`` yields the same files even after other
packages join the environment.

File rule, for every source:
- ``*.py`` files only, listed by relative POSIX path in sorted order;
- minus test suites and caches (any folder in ``EXCLUDED_FOLDERS``), and files over ``MAX_FILE_BYTES`` (generated
  tables and op lists, not code anyone writes);
- stdlib only: minus the folders that distributors ship separately or that are generated data (``idlelib``,
  ``tkinter``, ``encodings``, ``pydoc_data``, ...) and the build-specific ``config-*`` / ``_sysconfigdata_*`` files.
"""

from __future__ import annotations

import importlib.metadata
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

STDLIB = "stdlib"
TRAIN_PACKAGES = (
    "torch", "transformers", "numpy", "huggingface_hub", "datasets", "tokenizers", "safetensors", "tqdm",
    "hypothesis", "bitsandbytes", "optimum-quanto", "ninja",
)
HELD_OUT_PACKAGES = ("accelerate", "pytest")  # never trained on: the generalisation split
MAX_FILE_BYTES = 400_000
EXCLUDED_FOLDERS = frozenset({"__pycache__", "test", "tests", "testing", "idle_test", "site-packages", "lib-dynload"})
STDLIB_EXCLUDED_FOLDERS = frozenset(
    {"idlelib", "turtledemo", "tkinter", "lib2to3", "distutils", "ensurepip", "encodings", "pydoc_data"}
)
STDLIB_EXCLUDED_PREFIXES = ("config-", "_sysconfigdata_")


@dataclass(frozen=True, slots=True)
class Source:
    """One origin of corpus files: ``root / paths[i]`` is a file; ``licence`` is what its metadata declares."""

    name: str
    version: str
    licence: str
    root: Path
    paths: tuple[str, ...]

    def read(self, path: str) -> str:
        """The text of one file: UTF-8 with universal newlines (undecodable bytes replaced)."""
        with open(self.root / path, encoding="utf-8", errors="replace") as handle:
            return handle.read()


def is_included(relative_path: str, stdlib: bool = True) -> bool:
    """Whether a relative POSIX path belongs to the corpus (see the module docstring); ``stdlib`` adds the
    stdlib-only exclusions."""
    parts = PurePosixPath(relative_path).parts
    if not relative_path.endswith(".py") or ".." in parts:
        return False
    excluded = EXCLUDED_FOLDERS | STDLIB_EXCLUDED_FOLDERS if stdlib else EXCLUDED_FOLDERS
    if any(part in excluded or part.endswith((".dist-info", ".egg-info")) for part in parts[:-1]):
        return False
    return not (stdlib and any(part.startswith(STDLIB_EXCLUDED_PREFIXES) for part in parts))


def _small_enough(root: Path, paths: list[str]) -> tuple[str, ...]:
    return tuple(sorted(path for path in paths if (root / path).stat().st_size <= MAX_FILE_BYTES))


def stdlib_source(root: Path | None = None) -> Source:
    """The standard library under ``root`` (default: this interpreter's), licensed PSF-2.0."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_FOLDERS | STDLIB_EXCLUDED_FOLDERS]
        relative = Path(folder).relative_to(root)
        paths.extend((relative / name).as_posix() for name in names)
    version = sysconfig.get_python_version()
    return Source(STDLIB, version, "PSF-2.0", root, _small_enough(root, [p for p in paths if is_included(p)]))


def licence_of(metadata: importlib.metadata.PackageMetadata) -> str:
    """The licence a distribution declares: ``License-Expression``, else a one-line ``License``, else its
    ``License ::`` classifiers, else "unknown"."""
    expression = metadata.get("License-Expression")
    if expression:
        return expression
    text = (metadata.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 60:
        return text
    classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License")]
    return " AND ".join(classifiers) or "unknown"


def package_source(distribution: importlib.metadata.Distribution) -> Source:
    """The ``*.py`` files a distribution's ``RECORD`` lists, relative to the folder it is installed in."""
    root = Path(distribution.locate_file(""))
    listed = [PurePosixPath(str(file)).as_posix() for file in distribution.files or []]
    paths = [path for path in listed if is_included(path, stdlib=False) and (root / path).is_file()]
    name = distribution.metadata["Name"]
    return Source(name, distribution.version, licence_of(distribution.metadata), root, _small_enough(root, paths))


def default_sources() -> list[Source]:
    """The corpus sources in corpus order: the stdlib, ``TRAIN_PACKAGES``, then ``HELD_OUT_PACKAGES``.

    Raises ``importlib.metadata.PackageNotFoundError`` when a listed distribution is not installed.
    """
    names = TRAIN_PACKAGES + HELD_OUT_PACKAGES
    return [stdlib_source(), *(package_source(importlib.metadata.distribution(name)) for name in names)]
