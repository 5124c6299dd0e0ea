"""The README's two opening commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_bench_and_test_commands():
    bench, test = _readme_commands()
    assert bench.endswith("hf-accel bench")
    assert "pytest" in test


def test_ci_runs_the_readme_commands_in_order():
    bench, test = _readme_commands()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in lines
    assert bench in lines and test in lines, "CI must run the README's bench command and its test command verbatim"
    assert lines.index(bench) < lines.index(test)  # the main job on the base install, before the dev extra joins it
