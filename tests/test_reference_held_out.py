"""The held-out text shipped in the package: it matches its provenance, ships with the package, serves
`held_out_sequences` without the corpus's packages, equals the first files of the corpus split, and its generator
rebuilds it byte for byte."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_accel import reference
from hf_accel.reference import corpus, held_out, held_out_command

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = held_out.read_provenance()
SAME_PYTHON = pytest.mark.skipif(platform.python_version() != SHIPPED["python"],
                                 reason=f"the shipped text is Python {SHIPPED['python']}'s stdlib")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(reference.ASSETS_DIR / "tokenizer", local_files_only=True)


@pytest.fixture()
def no_corpus(monkeypatch):
    """The base install: the corpus's distributions are missing (an uncached default_corpus sees it; the cached one
    other tests share is left alone)."""
    def missing():
        raise importlib.metadata.PackageNotFoundError("datasets")

    monkeypatch.setattr(corpus, "default_sources", missing)
    monkeypatch.setattr(corpus, "default_corpus", functools.cache(corpus.default_corpus.__wrapped__))


def test_shipped_text_matches_its_provenance(tokenizer):
    text = held_out.shipped_text()
    assert held_out.file_sha256() == SHIPPED["sha256"]
    assert text.fingerprint == SHIPPED["fingerprint"]
    assert (text.num_files, text.num_bytes) == (SHIPPED["files"], SHIPPED["bytes"])
    assert corpus.count_tokens(text.texts, tokenizer) == SHIPPED["tokens"]
    assert all(path.startswith("stdlib/") for path in text.paths) and SHIPPED["licence"] == "PSF-2.0"
    licence = (held_out.HELD_OUT_DIR / SHIPPED["licence_file"]).read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence


def test_package_data_ships_the_held_out_text():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "hf_accel" / "reference"
    shipped = {path for pattern in patterns["hf_accel.reference"] for path in package.glob(pattern)}
    assert {path for path in held_out.HELD_OUT_DIR.iterdir()} <= shipped


def test_held_out_sequences_needs_no_corpus(no_corpus, tokenizer):
    rows = reference.held_out_sequences(tokenizer, 400, max_rows=64)  # bench_serving's, the largest benchmark need
    assert rows.shape == (64, 400)
    text = held_out.shipped_text()
    stream = corpus.pack_sequences(corpus.tokenize(text.texts, tokenizer), tokenizer.eos_token_id, 2).flatten()
    assert torch.equal(rows.flatten(), stream[: 64 * 400])
    assert reference.held_out_sequences(tokenizer, 512).shape[0] == (SHIPPED["tokens"] + SHIPPED["files"]) // 512
    with pytest.raises(ModuleNotFoundError, match=r"'datasets' is not installed.*\.\[dev\]"):
        reference.held_out_sequences(tokenizer, 64, split="held_out_packages")
    with pytest.raises(ValueError, match="split"):
        reference.held_out_sequences(tokenizer, 64, split="train")


@SAME_PYTHON
def test_shipped_text_is_the_first_files_of_the_corpus_split(tokenizer):
    try:
        split = corpus.load_split("held_out")
    except ModuleNotFoundError as missing:
        pytest.skip(str(missing))
    text = held_out.shipped_text()
    assert split.paths[: text.num_files] == text.paths and split.texts[: text.num_files] == text.texts
    assert not split.paths[text.num_files].startswith("stdlib/")  # every stdlib held-out file is shipped
    for seq_len, max_rows in ((400, 64), (256, 4), (4096, None)):  # bench_serving, hf-accel bench, bench_sink
        rows = reference.held_out_sequences(tokenizer, seq_len, max_rows)
        whole = corpus.pack_sequences(corpus.tokenize(split.texts, tokenizer), tokenizer.eos_token_id, seq_len)
        assert torch.equal(rows, whole[: rows.shape[0]])


@SAME_PYTHON
def test_generator_rebuilds_the_shipped_files(no_corpus, tmp_path):
    assert held_out_command.main(["--out", str(tmp_path)]) == 0
    for path in held_out.HELD_OUT_DIR.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
    assert {path.name for path in tmp_path.iterdir()} == {path.name for path in held_out.HELD_OUT_DIR.iterdir()}


def test_written_text_reads_back_exactly(tokenizer, tmp_path):
    texts = corpus.Corpus(["stdlib/a.py", "stdlib/b.py"], ['s = "\u2028é 🙂"\n\n', "x = '\\n'  # \"quoted\"\n"])
    provenance = held_out.write_held_out(texts, "licence", tokenizer, tmp_path)
    assert held_out.shipped_text(tmp_path) == texts
    assert provenance == held_out.read_provenance(tmp_path)
    assert provenance["sha256"] == held_out.file_sha256(tmp_path) and provenance["fingerprint"] == texts.fingerprint
    assert len((tmp_path / held_out.FILES_NAME).read_text(encoding="utf-8").split("\n")) == 3  # a line per file
