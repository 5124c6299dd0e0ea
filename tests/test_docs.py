"""The docs site builds with `mkdocs build --strict` (no broken link, no docstring the API reference cannot parse),
every docs page is in the nav, every public name is in the API reference, and benchmark pages are the files the
benchmark scripts write."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

import hf_accel

ROOT = Path(__file__).resolve().parents[1]


def _nav_files(nav: list) -> set[str]:
    files = set()
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            files |= _nav_files(value) if isinstance(value, list) else {value}
    return files


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "api" / "index.html").read_text()
    assert all(f'id="hf_accel.{name}"' in api for name in hf_accel.__all__)
    bench = (ROOT / "docs" / "bench_paged.md").read_text().splitlines()
    table_row = next(line for line in bench if line.startswith("| hf_accel paged |"))
    assert table_row.split("|")[2].strip() in (tmp_path / "bench_paged" / "index.html").read_text()


def test_every_docs_page_is_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # no !tags used
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert _nav_files(config["nav"]) == pages
