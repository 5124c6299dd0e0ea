"""What every script under benchmarks/ shares: its command line, the machine it states (`hardware`), and where it
writes its results.

A script `benchmarks/bench_<name>.py` writes `benchmarks/results/bench_<name>.json` (the full report) and
`docs/bench_<name>.md` (its tables), and replaces the text between `<!-- bench_<name>:start -->` and
`<!-- bench_<name>:end -->` in the docs that quote its headline.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from .timing import torch_threads


def hardware() -> dict[str, Any]:
    """CPU model (from /proc/cpuinfo where present, with its family and model numbers: a virtual machine's name,
    such as "AMD EPYC", is the same for every generation), the vector ISA torch's kernels use, torch threads,
    versions."""
    return {
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _cpu_name() -> str:
    """"model name (family F, model M)" from the first processor of /proc/cpuinfo, else the platform's name."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends here
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def target_table(targets: list[dict[str, Any]], heading: str = "| target | value | met |") -> list[str]:
    """Markdown lines of a report's targets: each `{"name", "goal", "value", "met"}` (value and met None when the
    row could not be measured), under a three-column `heading`."""
    lines = [heading, "| --- | --- | --- |"]
    lines += [f"| {t['name']} {t['goal']} | " + ("-" if t["value"] is None else f"{t['value']:.2f}")
              + f" | {'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |" for t in targets]
    return lines


def benchmark_parser(description: str, name: str) -> argparse.ArgumentParser:
    """`--quick` (a smoke run), `--threads` (default 1) and `--out` (the root results are written under)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"root for benchmarks/results/{name}.json and docs/{name}.md "
                             "(default: this repository; with --quick, nothing is written)")
    return parser


def output_root(args: argparse.Namespace, repository: Path) -> Path | None:
    """Where to write: `--out`, else the repository, except that a `--quick` run without `--out` writes nothing."""
    return args.out if args.quick else (args.out or repository)


def write_results(out: Path, name: str, report: dict[str, Any], markdown: str,
                  headlines: Mapping[str, str] = {}) -> None:
    """Write the JSON report and the markdown page; `headlines` maps a docs path (relative to `out`) to the text
    that goes between its `name` markers."""
    (out / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    (out / "docs").mkdir(parents=True, exist_ok=True)
    (out / f"benchmarks/results/{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"docs/{name}.md").write_text(markdown)
    for relative, text in headlines.items():
        update_marked_section(out / relative, name, text)


def update_marked_section(path: Path, name: str, text: str) -> None:
    """Replace what lies between the `name` markers in `path`, if the file has them."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    doc = path.read_text() if path.exists() else ""
    if start in doc and end in doc:
        head, rest = doc.split(start, 1)
        path.write_text(head + start + text + "\n" + end + rest.split(end, 1)[1])


def run_benchmark(argv: list[str] | None, description: str, name: str, repository: Path,
                  measure: Callable[[bool], dict[str, Any]], render: Callable[[dict[str, Any]], str],
                  headlines: Callable[[dict[str, Any]], Mapping[str, str]] = lambda report: {}) -> dict[str, Any]:
    """A benchmark script's `main`: parse the common options, `measure(quick)` on `--threads` threads, print
    `render(report)`, and write the results (see `write_results`) unless it is a quick run without `--out`."""
    args = benchmark_parser(description, name).parse_args(argv)
    with torch_threads(args.threads):
        report = measure(args.quick)
    text = render(report)
    print("\n" + text)
    out = output_root(args, repository)
    if out is not None:
        write_results(out, name, report, text, headlines(report))
    return report
