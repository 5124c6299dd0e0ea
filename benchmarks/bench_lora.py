"""Many LoRA adapters in one Engine: the same 64 requests on the base model, on one adapter and spread over 8
adapters, against peft's mixed-adapter `generate`.

On the reference target (7.3M parameters), one thread, greedy: 8 random rank-16 peft adapters on every linear
projection (attention and MLP), saved as peft folders in a temp folder (never kept). 64 held-out prompts of 16-96
tokens, each generating 16-64 tokens (EOS ignored; `hf_accel.bench.workload.serving_requests`). Rows, interleaved
with warm-up, tok/s of generated tokens:
- the base model in the Engine, compiled (its default) and eager (`enforce_eager=True`);
- the Engine with `lora=LoRAConfig(max_loras=8)`, compiled (its default): every request on one adapter, the 8
  adapters uniformly (request i
  on adapter i % 8), and skewed (adapter k with weight 1 / (k + 1));
- peft: a `PeftModel` holding the 8 adapters, `generate(adapter_names=...)` over the same requests in batches of 16
  (left-padded, each batch as long as its longest request), the mixed-adapter path peft offers.
Each LoRA row's outputs are compared with peft's greedy outputs of the same requests (identical count).
Then, side by side with vLLM's CPU build (`LLM(enable_lora=True, max_loras=9, max_lora_rank=16)`, fp32, one thread,
in its own process from the peer venv of bench_vllm_peer.py: benchmarks/vllm_lora_worker.py; a warm-up round, then
the runs timed in turn; `max_loras` one over the adapters, see docs/check_vllm_lora.md) on the same requests and
adapter folders: base requests and the 8 adapters uniform, on the reference target and on bench_size.py's 185M
random-weight Llama (where the hf_accel rows are the base engine and the LoRA engine, interleaved; peft's
`generate` is left out there: minutes a run). On both models, the time of one decode step by batch size (1, 4, 16,
64 sequences; base, LoRA engine on base requests, and on the batch spread over the 8 adapters: lora_step_times.py).
Last, a runtime load under load: 32 adapter requests running in the engine's loop, `add_lora` of a ninth adapter
and a request on it: seconds from the call to its first token, and the requests that failed (none should).

Regenerate benchmarks/results/bench_lora.json and docs/bench_lora.md:
    .venv/bin/python benchmarks/bench_lora.py
Smoke run (fewer requests, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_lora.py --quick
"""

from __future__ import annotations

import copy
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, reference
from hf_accel.bench.output import hardware, run_benchmark, target_table
from hf_accel.bench.peer import run_job, venv_python
from hf_accel.bench.timing import time_interleaved
from hf_accel.bench.workload import Request, serving_requests
from lora_step_times import render_step_times, step_times

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vllm_peer import DEFAULT_VENV, side_env  # noqa: E402
WORKER = ROOT / "benchmarks" / "vllm_lora_worker.py"
PEER_MAX_MODEL_LEN = 512
NAME = "bench_lora"
COMMAND = ".venv/bin/python benchmarks/bench_lora.py"
NUM_ADAPTERS, RANK = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL = {"requests": 64, "repeats": 3, "peft_batch": 16, "peer": True, "size_repeats": 2}
QUICK = {"requests": 16, "repeats": 1, "peft_batch": 16, "peer": False, "size_repeats": 1}
PEFT_ROW = "peft generate(adapter_names), 8 adapters uniform"


def make_adapters(model, folder: Path, count: int = NUM_ADAPTERS) -> list[LoRARequest]:
    """`count` random rank-16 peft adapters on every projection of `model`, saved under `folder`."""
    from peft import LoraConfig, get_peft_model

    requests = []
    for i in range(count):
        torch.manual_seed(100 + i)
        tuned = get_peft_model(copy.deepcopy(model), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                                init_lora_weights=False))
        with torch.no_grad():
            for name, param in tuned.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.05)  # a fine-tune's size of change, not a different model
        tuned.save_pretrained(folder / f"adapter{i}")
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(folder / f"adapter{i}")))
    return requests


def assignments(kind: str, count: int) -> list[int | None]:
    """Each request's adapter index: None (base), all 0 ("one"), i % 8 ("uniform") or drawn 1 / (k + 1)
    ("skewed")."""
    if kind == "base":
        return [None] * count
    if kind == "one":
        return [0] * count
    if kind == "uniform":
        return [i % NUM_ADAPTERS for i in range(count)]
    rng = random.Random(0)
    return rng.choices(range(NUM_ADAPTERS), weights=[1 / (k + 1) for k in range(NUM_ADAPTERS)], k=count)


def engine_run(engine: Engine, work: list[Request], adapters: list[LoRARequest],
               chosen: list[int | None]) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in work]
    lora = [None if k is None else adapters[k] for k in chosen]
    start = time.perf_counter()
    outs = engine.generate([r.prompt for r in work], params, lora_request=lora)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def peft_run(peft_model, work: list[Request], chosen: list[int | None], batch: int) -> tuple[float, list[list[int]]]:
    """peft's `generate(adapter_names=...)` in batches of `batch` requests (left padding, greedy)."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(work), batch):
        group, names = work[first: first + batch], chosen[first: first + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        longest = max(r.max_tokens for r in group)
        out = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                  do_sample=False, pad_token_id=0,
                                  adapter_names=["__base__" if k is None else f"adapter{k}" for k in names])
        outputs += [row[width: width + r.max_tokens] for row, r in zip(out.tolist(), group)]
    return time.perf_counter() - start, outputs


def measure(quick: bool) -> dict[str, Any]:
    from peft import PeftModel

    plan = QUICK if quick else FULL
    started = time.perf_counter()
    model, tokenizer = reference.load("target")
    work = serving_requests(tokenizer, plan["requests"], (16, 96), (16, 64), max_len=reference_len(model))
    tokens = sum(r.max_tokens for r in work)
    with tempfile.TemporaryDirectory() as scratch:
        adapters = make_adapters(model, Path(scratch))
        compiled = Engine(copy.deepcopy(model), tokenizer, config=EngineConfig(max_num_seqs=64))
        eager = Engine(copy.deepcopy(model), tokenizer, config=EngineConfig(max_num_seqs=64, enforce_eager=True))
        served = Engine(copy.deepcopy(model), tokenizer, config=EngineConfig(max_num_seqs=64),
                        lora=LoRAConfig(max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
        peft_model = PeftModel.from_pretrained(copy.deepcopy(model), adapters[0].lora_path, adapter_name="adapter0")
        for request in adapters[1:]:
            peft_model.load_adapter(request.lora_path, adapter_name=request.lora_name)
        peft_model.eval()
        kinds = {"base": assignments("base", len(work)), "one": assignments("one", len(work)),
                 "uniform": assignments("uniform", len(work)), "skewed": assignments("skewed", len(work))}
        engines = {"base, compiled": (compiled, "base"), "base, eager": (eager, "base"),
                   "LoRA engine, base requests": (served, "base"), "LoRA engine, one adapter": (served, "one"),
                   "LoRA engine, 8 adapters uniform": (served, "uniform"),
                   "LoRA engine, 8 adapters skewed": (served, "skewed")}
        runs = {key: (lambda engine=engine, kind=kind: engine_run(engine, work, adapters, kinds[kind]))
                for key, (engine, kind) in engines.items()}
        runs[PEFT_ROW] = lambda: peft_run(peft_model, work, kinds["uniform"], plan["peft_batch"])
        timings = time_interleaved(list(runs), lambda key: runs[key](), plan["repeats"])
        steps = step_times(compiled, served, work, adapters, plan["repeats"])
        reference_outputs = {kind: peft_run(peft_model, work, kinds[kind], plan["peft_batch"])[1]
                             for kind in ("one", "uniform", "skewed")}
        runtime_load = measure_runtime_load(served, work, adapters, model, Path(scratch))
        peer_kinds = {"base": kinds["base"], "uniform": kinds["uniform"]}
        folder = Path(scratch) / "reference"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        ours = {"base": statistics.median(timings.seconds["LoRA engine, base requests"]),
                "uniform": statistics.median(timings.seconds["LoRA engine, 8 adapters uniform"])}
        ours_outputs = {"base": timings.outputs["LoRA engine, base requests"],
                        "uniform": timings.outputs["LoRA engine, 8 adapters uniform"]}
        vllm_reference = vllm_side_by_side(plan, folder, work, adapters, peer_kinds, ours, ours_outputs, tokens,
                                           Path(scratch))
        size_185m = measure_185m(plan, work, peer_kinds, tokens, Path(scratch))
    rows = []
    base_s = statistics.median(timings.seconds["base, compiled"])
    eager_s = statistics.median(timings.seconds["base, eager"])
    for key in runs:
        seconds = statistics.median(timings.seconds[key])
        kind = engines[key][1] if key in engines else None
        same = None
        if kind in reference_outputs and key.startswith("LoRA engine"):
            same = sum(a == b for a, b in zip(timings.outputs[key], reference_outputs[kind]))
        rows.append({"run": key, "tok_s": tokens / seconds, "vs_base_compiled": base_s / seconds,
                     "vs_base_eager": eager_s / seconds, "identical_to_peft": same})
    return {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(), "requests": len(work),
            "tokens": tokens, "adapters": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS, "rows": rows,
            "step_times": steps,
            "vllm_reference": vllm_reference, "size_185m": size_185m, "runtime_load": runtime_load,
            "total_seconds": time.perf_counter() - started,
            "targets_met": targets(rows, vllm_reference, size_185m, runtime_load)}


def vllm_side_by_side(plan: dict[str, Any], folder: Path, work: list[Request], adapters: list[LoRARequest],
                      kinds: dict[str, list[int | None]], ours: dict[str, float],
                      ours_outputs: dict[str, list[list[int]]], tokens: int, scratch: Path) -> dict[str, Any]:
    """vLLM's CPU build on `kinds`' requests with the same adapter folders, beside the hf_accel LoRA engine's median
    seconds `ours` and outputs; or why it is skipped."""
    python = venv_python(DEFAULT_VENV, "vllm")
    if python is None or not plan["peer"]:
        return {"skipped": "--quick" if python is not None else
                f"no vLLM venv at {DEFAULT_VENV} (bench_vllm_peer.py --setup creates it)"}
    runs = {kind: [[r.prompt, r.max_tokens, None if k is None else adapters[k].lora_name] for r, k in zip(work, chosen)]
            for kind, chosen in kinds.items()}
    job = {"model": str(folder), "max_model_len": PEER_MAX_MODEL_LEN, "max_loras": NUM_ADAPTERS + 1,
           "max_lora_rank": RANK, "adapters": {a.lora_name: [a.lora_int_id, str(a.lora_path)] for a in adapters},
           "runs": runs, "warmup": 1, "repeats": plan["size_repeats"]}
    result = run_job([str(python), str(WORKER)], job, side_env("vllm"), scratch / f"vllm-{folder.name}", 3600.0)
    rows = {}
    for kind in kinds:
        vllm_s = statistics.median(result["runs"][kind]["seconds"])
        same = sum(a == b for a, b in zip(result["runs"][kind]["outputs"], ours_outputs[kind]))
        rows[kind] = {"hf_accel_tok_s": tokens / ours[kind], "vllm_tok_s": tokens / vllm_s,
                      "hf_accel_vs_vllm": vllm_s / ours[kind], "identical": same}
    return {"rows": rows, "vllm_load_seconds": result["load_seconds"], "versions": result["versions"]}


def measure_185m(plan: dict[str, Any], work: list[Request], kinds: dict[str, list[int | None]], tokens: int,
                 scratch: Path) -> dict[str, Any]:
    """The base engine and the LoRA engine (8 adapters) on bench_size.py's 185M Llama, interleaved, then vLLM's."""
    import bench_size
    from transformers import AutoModelForCausalLM

    size = next(size for size in bench_size.FULL.sizes if size.name == "185M")
    folder = bench_size.model_folder(size, scratch / "185M")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    adapters = make_adapters(model, scratch / "adapters-185M")
    # the pool sized for these requests (the model's 4096 positions x 64 sequences would be 8.6 GB an engine)
    config = EngineConfig(max_num_seqs=64, max_model_len=PEER_MAX_MODEL_LEN, compile_in_background=False)
    base = Engine(copy.deepcopy(model), config=config)
    served = Engine(model, config=config, lora=LoRAConfig(max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
    runs = {"base engine, base requests": lambda: engine_run(base, work, adapters, kinds["base"]),
            "LoRA engine, base requests": lambda: engine_run(served, work, adapters, kinds["base"]),
            "LoRA engine, 8 adapters uniform": lambda: engine_run(served, work, adapters, kinds["uniform"])}
    timings = time_interleaved(list(runs), lambda key: runs[key](), plan["size_repeats"])
    steps = step_times(base, served, work, adapters, plan["size_repeats"])
    base_s = statistics.median(timings.seconds["base engine, base requests"])
    rows = [{"run": key, "tok_s": tokens / statistics.median(timings.seconds[key]),
             "vs_base_compiled": base_s / statistics.median(timings.seconds[key])} for key in runs]
    del base
    ours = {"base": statistics.median(timings.seconds["LoRA engine, base requests"]),
            "uniform": statistics.median(timings.seconds["LoRA engine, 8 adapters uniform"])}
    outputs = {"base": timings.outputs["LoRA engine, base requests"],
               "uniform": timings.outputs["LoRA engine, 8 adapters uniform"]}
    del served, model
    return {"rows": rows, "step_times": steps,
            "vllm": vllm_side_by_side(plan, folder, work, adapters, kinds, ours, outputs, tokens, scratch)}


def measure_runtime_load(engine: Engine, work: list[Request], adapters: list[LoRARequest], model,
                         scratch: Path) -> dict[str, Any]:
    """32 adapter requests running in `engine`'s loop; then `add_lora` of a new adapter and one request on it: the
    seconds from the call to that request's first token, and how many requests failed."""
    extra = make_adapters(model, scratch / "extra", NUM_ADAPTERS + 1)[-1]
    extra = LoRARequest("runtime", 100, extra.lora_path)
    finished, first_token, errors = threading.Event(), [], []
    remaining = [33]
    lock = threading.Lock()

    def listener(out, timed: bool = False) -> None:
        if isinstance(out, BaseException) or out.error is not None:
            errors.append(out)
        elif timed and not first_token and out.outputs[0].token_ids:
            first_token.append(time.perf_counter())
        if isinstance(out, BaseException) or out.finished:
            with lock:
                remaining[0] -= 1
                if not remaining[0]:
                    finished.set()

    engine.start()
    try:
        for i, r in enumerate(work[:32]):
            engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                               listener=listener, lora_request=adapters[i % NUM_ADAPTERS])
        time.sleep(0.5)  # they are running
        called = time.perf_counter()
        engine.add_lora(extra)
        engine.add_request(work[0].prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           listener=lambda out: listener(out, timed=True), lora_request=extra)
        finished.wait(600)
    finally:
        engine.shutdown()
    return {"seconds_to_first_token": first_token[0] - called if first_token else None, "failed": len(errors),
            "requests": 33}


def reference_len(model) -> int:
    return model.config.max_position_embeddings


def targets(rows: list[dict[str, Any]], vllm_reference: dict[str, Any], size_185m: dict[str, Any],
            runtime_load: dict[str, Any]) -> list[dict[str, Any]]:
    by_run = {row["run"]: row for row in rows}
    uniform = by_run["LoRA engine, 8 adapters uniform"]
    peft = by_run[PEFT_ROW]
    big = {row["run"]: row for row in size_185m["rows"]}["LoRA engine, 8 adapters uniform"]
    found = [
        {"name": "8 adapters (uniform) / base engine tok/s, reference target", "goal": ">= 0.85",
         "value": uniform["vs_base_compiled"], "met": uniform["vs_base_compiled"] >= 0.85},
        {"name": "8 adapters (uniform) / base engine tok/s, 185M", "goal": ">= 0.85",
         "value": big["vs_base_compiled"], "met": big["vs_base_compiled"] >= 0.85},
        {"name": "8 adapters (uniform) / peft's mixed-adapter generate tok/s", "goal": ">= 5",
         "value": uniform["tok_s"] / peft["tok_s"], "met": uniform["tok_s"] / peft["tok_s"] >= 5},
    ]
    for label, side in (("reference target", vllm_reference), ("185M", size_185m["vllm"])):
        if "rows" in side:
            ratio = side["rows"]["uniform"]["hf_accel_vs_vllm"]
            found.append({"name": f"8 adapters (uniform) / vLLM CPU enable_lora tok/s, {label}", "goal": ">= 1.2",
                          "value": ratio, "met": ratio >= 1.2})
    seconds = runtime_load["seconds_to_first_token"]
    found.append({"name": "runtime add_lora under load: seconds to the new adapter's first token (failed requests)",
                  "goal": "<= 2 (0)", "value": seconds,
                  "met": seconds is not None and seconds <= 2 and runtime_load["failed"] == 0})
    return found


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['hardware']['cpu']}; reference target, one thread; {report['requests']} requests "
             f"({report['tokens']} generated tokens, greedy), {report['adapters']} random rank-{report['rank']} peft "
             f"adapters on {', '.join(report['targets'])}.", "",
             "| run | tok/s | vs base engine (compiled) | vs base engine (eager) | identical to peft |",
             "| --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        same = "-" if row["identical_to_peft"] is None else f"{row['identical_to_peft']} of {report['requests']}"
        lines.append(f"| {row['run']} | {row['tok_s']:.0f} | {row['vs_base_compiled']:.2f}x | "
                     f"{row['vs_base_eager']:.2f}x | {same} |")
    lines += ["", "An engine with `lora=` compiles its step as the base's does, the LoRA kernel one node per adapted "
              "projection, the adapters' stacked weights and each token's slot graph inputs (as the base's packed "
              "Linears are); "
              "\"identical to peft\" counts requests whose greedy tokens equal peft's `generate` with the same "
              "adapter (fp32; a near-tie can part them).", "",
              "A decode step of B sequences, by batch size (one token each; `benchmarks/lora_step_times.py`):", "",
              *render_step_times(report["step_times"], report["adapters"]), "",
              "185M random-weight Llama (bench_size.py's), the same requests and 8 rank-16 adapters of its own:", "",
              "| run | tok/s | vs base engine (compiled) |", "| --- | --- | --- |"]
    lines += [f"| {row['run']} | {row['tok_s']:.0f} | {row['vs_base_compiled']:.2f}x |"
              for row in report["size_185m"]["rows"]]
    lines += ["", "A decode step of B sequences on the 185M Llama:", "",
              *render_step_times(report["size_185m"]["step_times"], report["adapters"])]
    lines += ["", "Side by side with vLLM's CPU build (`enable_lora=True`, the same adapter folders and requests):", "",
              "| model | requests | hf_accel tok/s | vLLM tok/s | hf_accel / vLLM | identical outputs |",
              "| --- | --- | --- | --- | --- | --- |"]
    for label, side in (("reference target", report["vllm_reference"]), ("185M", report["size_185m"]["vllm"])):
        if "rows" not in side:
            lines.append(f"| {label} | skipped: {side['skipped']} | | | | |")
            continue
        for kind, row in side["rows"].items():
            lines.append(f"| {label} | {'base' if kind == 'base' else '8 adapters uniform'} | "
                         f"{row['hf_accel_tok_s']:.0f} | {row['vllm_tok_s']:.0f} | {row['hf_accel_vs_vllm']:.2f}x | "
                         f"{row['identical']} of {report['requests']} |")
    load = report["runtime_load"]
    seconds = "-" if load["seconds_to_first_token"] is None else f"{load['seconds_to_first_token']:.2f} s"
    lines += ["", f"Runtime load under load (reference target): `add_lora` of a ninth adapter while 32 adapter "
              f"requests run; its request's first token {seconds} after the call; {load['failed']} of "
              f"{load['requests']} requests failed.", "", *target_table(report["targets_met"]), "",
              f"From `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
