"""Corpus rules on small fake trees: file selection, licences, exact and near de-duplication, splits by package and
by file, and the fixed package set."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from hf_accel.reference import corpus, sources
from hf_accel.reference.sources import Source

CODE = "\n".join(f"value_{i} = compute_something({i}, factor={i * 3})" for i in range(12)) + "\n"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    return root


def _source(root: Path, name: str, files: dict[str, str]) -> Source:
    _tree(root / name, files)
    return Source(name, "1.0", "MIT", root / name, tuple(sorted(files)))


def _fake_distribution(site: Path, metadata: str, files: dict[str, str]) -> importlib.metadata.Distribution:
    _tree(site, files)
    info = site / "fake-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(metadata, encoding="utf-8")
    record = [f"{path},," for path in files] + ["fake-1.0.dist-info/METADATA,,", "../../bin/fake.py,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")
    return importlib.metadata.PathDistribution(info)


def test_stdlib_rule_keeps_code_and_drops_tests_generated_and_distributor_folders(tmp_path):
    files = {"os.py": "a", "json/decoder.py": "b", "unittest/test/test_case.py": "c", "idlelib/run.py": "d",
             "encodings/cp1252.py": "e", "config-3.11-x86_64-linux-gnu/python-config.py": "f",
             "_sysconfigdata__linux.py": "g", "README.txt": "h", "big.py": "x" * (sources.MAX_FILE_BYTES + 1)}
    source = sources.stdlib_source(_tree(tmp_path, files))
    assert source.name == "stdlib" and source.licence == "PSF-2.0"
    assert source.paths == ("json/decoder.py", "os.py")


def test_package_source_reads_record_and_licence(tmp_path):
    files = {"fake/__init__.py": "x = 1\n", "fake/core.py": "y = 2\n", "fake/tests/test_core.py": "z = 3\n",
             "fake/testing/helpers.py": "h = 1\n", "fake/data.json": "{}"}
    metadata = "Metadata-Version: 2.4\nName: fake\nVersion: 1.0\nLicense-Expression: BSD-3-Clause\n"
    source = sources.package_source(_fake_distribution(tmp_path, metadata, files))
    assert (source.name, source.version, source.licence) == ("fake", "1.0", "BSD-3-Clause")
    assert source.paths == ("fake/__init__.py", "fake/core.py")  # RECORD's ../../bin script is outside the package
    assert source.read("fake/core.py") == "y = 2\n"


def test_licence_falls_back_to_license_field_then_classifiers():
    def metadata(text: str) -> importlib.metadata.PackageMetadata:
        import email
        return email.message_from_string("Metadata-Version: 2.1\nName: x\n" + text)

    assert sources.licence_of(metadata("License: Apache 2.0\n")) == "Apache 2.0"
    classifier = "Classifier: License :: OSI Approved :: MIT License\n"
    assert sources.licence_of(metadata("License: " + "long text " * 20 + "\n" + classifier)) == "MIT License"
    assert sources.licence_of(metadata("")) == "unknown"


def test_exact_and_near_duplicates_are_dropped_after_their_first_copy(tmp_path):
    near = CODE.replace("value_0 = compute_something(0, factor=0)", "# Copied from a.one with One->Two")
    a = _source(tmp_path, "a", {"one.py": CODE, "two.py": near, "__init__.py": ""})
    b = _source(tmp_path, "b", {"same.py": CODE, "other.py": "def other():\n    return 42\n", "__init__.py": ""})
    built = corpus.build_corpus([a, b], held_out_packages=())
    kept = [p for split in built.splits.values() for p in split.paths]
    assert sorted(kept) == ["a/__init__.py", "a/one.py", "b/other.py"]
    (ra, rb) = built.sources
    assert (ra.exact_duplicates, ra.near_duplicates) == (0, 1)
    assert (rb.exact_duplicates, rb.near_duplicates) == (2, 0)  # b/__init__.py (empty) and b/same.py
    assert sum(ra.files.values()) == 2 and sum(rb.files.values()) == 1


def test_short_files_are_never_near_duplicates(tmp_path):
    lines = "import collections.abc\nfrom dataclasses import dataclass\n"
    a = _source(tmp_path, "a", {"x.py": lines})
    b = _source(tmp_path, "b", {"y.py": lines + "print('different file')\n"})
    built = corpus.build_corpus([a, b], held_out_packages=())
    assert built.sources[1].near_duplicates == 0 and built.sources[1].files["train"] == 1


def test_held_out_packages_are_whole_and_other_files_split_by_path_hash(tmp_path):
    names = [f"m{i}.py" for i in range(200)]
    train_source = _source(tmp_path, "lib", {name: f"x = {i}\n" for i, name in enumerate(names)})
    held_source = _source(tmp_path, "other", {name: f"y = {i}\n" for i, name in enumerate(names)})
    built = corpus.build_corpus([train_source, held_source], held_out_packages=("other",))
    splits = built.splits
    assert splits["held_out_packages"].paths == [f"other/{name}" for name in sorted(names)]
    assert not any(p.startswith("other/") for p in splits["train"].paths + splits["held_out"].paths)
    assert all(corpus.split_of(p.removeprefix("lib/")) == "held_out" for p in splits["held_out"].paths)
    assert 0.01 < splits["held_out"].num_files / 200 < 0.12
    assert splits["train"].paths == sorted(splits["train"].paths)
    assert corpus.build_corpus([train_source, held_source], ("other",)).splits["train"].fingerprint == \
        splits["train"].fingerprint


def test_split_of_depends_on_the_path_inside_the_source_only():
    assert corpus.split_of("json/decoder.py") == corpus.split_of("json/decoder.py")
    assert corpus.split_of("json/decoder.py", held_out_package=True) == "held_out_packages"
    with pytest.raises(ValueError, match="split"):
        corpus.load_split("validation")


def test_package_set_is_fixed_disjoint_and_pinned():
    assert set(sources.TRAIN_PACKAGES).isdisjoint(sources.HELD_OUT_PACKAGES)
    pinned = Path(__file__).resolve().parents[1] / "constraints.txt"
    names = {line.split("==")[0].strip().lower().replace("_", "-")
             for line in pinned.read_text().splitlines() if "==" in line and not line.startswith("#")}
    for name in sources.TRAIN_PACKAGES + sources.HELD_OUT_PACKAGES:
        assert name.lower().replace("_", "-") in names, f"{name} is not pinned in constraints.txt"


def test_pack_sequences_separates_documents_and_drops_the_tail():
    rows = corpus.pack_sequences([[1, 2, 3], [4], [5, 6]], separator_id=0, seq_len=4)
    assert rows.tolist() == [[1, 2, 3, 0], [4, 0, 5, 6]]  # stream 1 2 3 0 4 0 5 6 0; the tail "0" is dropped
    assert corpus.pack_sequences([[1, 2]], 0, 4).shape == (0, 4)
    assert corpus.pack_sequences([], 0, 4).shape == (0, 4)


def test_measure_only_run_reuses_the_train_token_count_of_the_same_corpus_only():
    from hf_accel.training.reference_build import _known_token_counts

    train = corpus.Corpus(["lib/x.py"], ["x = 1\n"])
    built = corpus.SplitCorpus({"train": train, "held_out": corpus.Corpus(), "held_out_packages": corpus.Corpus()}, [])
    report = {"corpus": {"splits": {"train": {"fingerprint": train.fingerprint, "tokens": 7}}}}
    assert _known_token_counts(report, built) == {"train": 7}
    report["corpus"]["splits"]["train"]["fingerprint"] = "0" * 64
    assert _known_token_counts(report, built) == {}
    assert _known_token_counts({}, built) == {}
