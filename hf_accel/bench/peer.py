"""A peer engine for side-by-side benchmarks: its own virtual environment (`venv_python`, `create_venv`), a script run
to completion in another interpreter on a JSON job (`run_job`), a server process that lives for a `with` block
(`serving`) or for a load test (`load_server`), and the maths over the sides' rounds (`side_order`, `tokens_per_s`,
`rounds_summary`, `count_identical`, `median_rows`, `judged`).

Rules: nothing here knows which engine the peer is; every process gets its environment and a log file from the
caller, and a process that fails raises RuntimeError quoting the end of its log. A run is a worker's result:
`{"seconds": timed seconds, "load_seconds", "outputs": generated token ids per request, "versions"}`; its tok/s
counts the tokens it generated, not the tokens asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

LOG_TAIL = 3000  # characters of a failed process's log quoted in the error


def venv_python(venv: Path, module: str) -> Path | None:
    """The python of the venv at `venv` when it exists and imports `module`, else None."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, timeout=300)
    return python if found.returncode == 0 else None


def run_check(python_venv: Path, name: str, root: Path, measure: Callable[[Path, Path], dict[str, Any]],
              render: Callable[[dict[str, Any]], str]) -> int:
    """The main of a check against a peer in its venv: skip (0, with a message) without it; else, with one torch
    thread, `measure(peer python, scratch folder)`, write its JSON and page under `root`, print the page, and return
    0 when the report `passed`, else 1."""
    import torch

    from .output import write_results

    python = venv_python(python_venv, "vllm")
    if python is None:
        print(f"skipped: no vLLM venv at {python_venv} (create it with benchmarks/bench_vllm_peer.py --setup)")
        return 0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        report = measure(python, Path(scratch))
    write_results(root, name, report, render(report))
    print(render(report))
    return 0 if report["passed"] else 1


def create_venv(venv: Path, install: Sequence[str], uninstall: Sequence[str] = ()) -> Path:
    """Create a venv at `venv` (`python3 -m venv`), `pip install` the `install` requirements into it, then
    `pip uninstall -y` the `uninstall` packages; returns its python. Raises CalledProcessError when a step fails."""
    python = venv / "bin" / "python"
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", *install], check=True)
    if uninstall:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *uninstall], check=True)
    return python


def run_job(command: Sequence[str], job: Mapping[str, Any], env: Mapping[str, str], stem: Path,
            timeout: float) -> dict[str, Any]:
    """Run `command JOB RESULT` to completion (at most `timeout` seconds) with `job` written as JSON to
    `<stem>-job.json`; returns the JSON it wrote to `<stem>-result.json`. Its output goes to `<stem>-log.txt`."""
    paths = [stem.with_name(f"{stem.name}-{suffix}") for suffix in ("job.json", "result.json", "log.txt")]
    paths[0].write_text(json.dumps(job))
    with paths[2].open("w") as log:
        done = subprocess.run([*command, str(paths[0]), str(paths[1])], env=dict(env), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:2]} exited with {done.returncode}: {paths[2].read_text()[-LOG_TAIL:]}")
    return json.loads(paths[1].read_text())


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(command: Sequence[str], env: Mapping[str, str], log_path: Path, url: str,
            startup_timeout: float = 600.0, stop_timeout: float = 60.0, compiled: bool = True) -> Iterator[str]:
    """Run the server `command` until the block ends; yields `url` once `url/health` answers 200 (with `compiled`,
    also not `{"status": "compiling"}`: a benchmark measures the server as it stays, not its eager start). On exit
    the server gets SIGINT (a graceful shutdown), and SIGKILL after `stop_timeout` seconds."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + startup_timeout
            while not healthy(url, compiled):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command[:3]} did not start: {log_path.read_text()[-LOG_TAIL:]}")
                time.sleep(0.5)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def load_server(command: Sequence[str], env: Mapping[str, str], log_path: Path, port: int, model: str,
                requests: list[tuple[list[int], int]], rates: Sequence[float],
                startup_timeout: float = 600.0) -> list[dict[str, Any]]:
    """Serve `command` (listening on 127.0.0.1:`port`) and send it `requests` (prompt token ids, max_tokens) with
    `hf_accel.server.load.run_load` at each of `rates`, after two of them as a warm-up; one result per rate."""
    from ..server.load import run_load

    with serving(command, env, log_path, f"http://127.0.0.1:{port}", startup_timeout) as url:
        asyncio.run(run_load(url, model, requests[:2], float("inf")))
        return [asyncio.run(run_load(url, model, requests, rate)) for rate in rates]


def healthy(url: str, compiled: bool = False) -> bool:
    """Whether `url/health` answers 200 (with `compiled`: and its body, if any, does not say "compiling")."""
    try:
        response = httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return False
    if response.status_code != 200:
        return False
    return not compiled or not response.content or response.json().get("status") != "compiling"


def side_order(sides: Sequence[str], round_index: int) -> list[str]:
    """The order the sides run in round `round_index` (0-based): as given in even rounds, reversed in odd ones."""
    return list(sides) if round_index % 2 == 0 else list(sides)[::-1]


def tokens_per_s(run: Mapping[str, Any]) -> float:
    """Generated tokens (every request's output ids) per second of the run's timed call."""
    return sum(len(out) for out in run["outputs"]) / run["seconds"]


def count_identical(a: Sequence[list[int]], b: Sequence[list[int]]) -> int:
    """Requests whose generated ids are the same in `a` and `b` (the same requests, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"compared outputs of {len(a)} and {len(b)} requests")
    return sum(x == y for x, y in zip(a, b))


def rounds_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's rounds: median and per-round tok/s, timed and load seconds, generated tokens, whether every round
    generated the same ids, and the first round's versions."""
    if not runs:
        raise ValueError("no rounds to summarize")
    rates = [tokens_per_s(run) for run in runs]
    return {"tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
            "seconds": [run["seconds"] for run in runs], "load_seconds": [run["load_seconds"] for run in runs],
            "generated_tokens": sum(len(out) for out in runs[0]["outputs"]),
            "same_outputs_every_round": all(run["outputs"] == runs[0]["outputs"] for run in runs),
            "versions": runs[0]["versions"]}


def median_rows(rounds: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of the same measurements over rounds (`rounds[r][i]`: round r's row i) merged into one row each: every
    number the median over rounds (nested dicts alike), anything else (a label) the first round's."""
    return [_median_row(rows) for rows in zip(*rounds, strict=True)]


def _median_row(rows: Sequence[Any]) -> Any:
    first = rows[0]
    if isinstance(first, Mapping):
        return {key: _median_row([row[key] for row in rows]) for key in first}
    numeric = isinstance(first, (int, float)) and not isinstance(first, bool)
    return statistics.median(rows) if numeric else first


def judged(name: str, op: str, goal: float, value: float | None) -> dict[str, Any]:
    """A target as a record: `value op goal` (op ">=" or "<="), `met` None when `value` was not measured."""
    if op not in (">=", "<="):
        raise ValueError(f"op must be '>=' or '<=', got {op!r}")
    met = None if value is None else value >= goal if op == ">=" else value <= goal
    return {"name": name, "goal": f"{op} {goal}", "value": value, "met": met}
