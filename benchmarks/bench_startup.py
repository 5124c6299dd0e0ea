"""How fast hf_accel is ready: `import hf_accel` and `hf-accel serve` from a cold and a warm cache (issue 47, item 5).

Import: fresh interpreters, alternating, the median of rounds: what a user's script imports from transformers anyway
(`AutoModelForCausalLM`, `AutoTokenizer`, generate's `GenerationMixin`), then `import hf_accel` on top (the ratio
is the total over transformers' part), and `import transformers` alone (lazy: it loads almost nothing). Serving:
`hf-accel serve` on the reference target, compiled, in a fresh process each time: seconds until `/health` answers 200
and the latency of the first completion (8 tokens), first with an empty inductor cache (cold: every graph compiled,
its C++ kernels built), then again on the cache that run left (warm: a restart of the same model). `--quick` runs
one import round and serves eagerly (`--enforce-eager`): a smoke run. vLLM's start-up is not measured here
(bench_vllm_peer.json records its engine load times). Not in CI.
    .venv/bin/python benchmarks/bench_startup.py [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.bench.peer import free_port, serving

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_startup"
COMMAND = ".venv/bin/python benchmarks/bench_startup.py"
IMPORT_ROUNDS = 5
USER_IMPORTS = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "from transformers.generation.utils import GenerationMixin\n")
# each probe prints [seconds of its first part, seconds in all]
PROBES = {
    "transformers alone": "import transformers\nfirst = time.perf_counter()\n",
    "transformers, then hf_accel": USER_IMPORTS + "first = time.perf_counter()\nimport hf_accel\n",
}


def import_seconds(probe: str) -> tuple[float, float]:
    """(seconds to the probe's `first` mark, seconds in all) of `probe` in a fresh interpreter."""
    code = f"import time\nstart = time.perf_counter()\n{probe}\nend = time.perf_counter()\n" \
           "print(first - start, end - start)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    first, total = map(float, done.stdout.split())
    return first, total


def measure_imports(rounds: int) -> dict[str, Any]:
    """Median seconds of each probe over `rounds` alternating rounds."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in PROBES}
    for index in range(rounds):
        for name in (list(PROBES) if index % 2 == 0 else list(PROBES)[::-1]):
            runs[name].append(import_seconds(PROBES[name]))
    alone = statistics.median(total for _, total in runs["transformers alone"])
    users = statistics.median(first for first, _ in runs["transformers, then hf_accel"])
    total = statistics.median(total for _, total in runs["transformers, then hf_accel"])
    return {"rounds": rounds, "transformers_alone_s": alone, "transformers_user_imports_s": users,
            "with_hf_accel_s": total, "hf_accel_share_s": total - users, "ratio": total / users, "runs": runs}


def serve_once(cache: Path, eager: bool, log: Path) -> dict[str, float]:
    """`hf-accel serve` (reference target) with inductor's cache at `cache`: seconds to healthy, first request."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("hf-accel")), "serve", "--port", str(port),
               *(["--enforce-eager"] if eager else [])]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    with serving(command, env, log, f"http://127.0.0.1:{port}") as url:
        ready = time.perf_counter() - started
        sent = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", timeout=300,
                              json={"model": "hf_accel-reference-target", "prompt": "def main():", "max_tokens": 8,
                                    "temperature": 0})
        response.raise_for_status()
        first = time.perf_counter() - sent
    return {"ready_s": ready, "first_request_s": first}


def measure_serving(eager: bool, scratch: Path) -> dict[str, Any]:
    """A cold start on an empty inductor cache, then a warm one on what it left."""
    cache = scratch / "inductor"
    cold = serve_once(cache, eager, scratch / "cold.log")
    warm = serve_once(cache, eager, scratch / "warm.log")
    return {"compiled": not eager, "cold": cold, "warm": warm}


def measure(quick: bool) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp:
        report = {"benchmark": NAME, "command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
                  "imports": measure_imports(1 if quick else IMPORT_ROUNDS),
                  "serve": measure_serving(quick, Path(tmp))}
    report["total_seconds"] = time.perf_counter() - started
    return report


def render(report: dict[str, Any]) -> str:
    imports, serve = report["imports"], report["serve"]
    mode = "compiled (default)" if serve["compiled"] else "eager (`--enforce-eager`, a smoke run)"
    lines = [f"Start-up on {report['hardware']['cpu']} (shared, 2 cores), fresh processes.", "",
             f"Import, median of {imports['rounds']} alternating rounds:", "",
             "| import | seconds |", "| --- | --- |",
             f"| `import transformers` alone (lazy) | {imports['transformers_alone_s']:.2f} |",
             f"| what a script imports from transformers (`AutoModelForCausalLM`, `AutoTokenizer`, "
             f"`GenerationMixin`) | {imports['transformers_user_imports_s']:.2f} |",
             f"| the same, then `import hf_accel` | {imports['with_hf_accel_s']:.2f} "
             f"({imports['ratio']:.2f}x; hf_accel's share {imports['hf_accel_share_s']:.2f}) |", "",
             f"`hf-accel serve` on the reference target, {mode}:", "",
             "| start | ready (`/health` 200), s | first completion (8 tokens), s |", "| --- | --- | --- |"]
    lines += [f"| {name} ({'empty inductor cache' if name == 'cold' else 'the cache the cold start left'}) | "
              f"{serve[name]['ready_s']:.1f} | {serve[name]['first_request_s']:.2f} |" for name in ("cold", "warm")]
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
