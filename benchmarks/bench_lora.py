"""Many LoRA adapters in one Engine: the same 64 requests on the base model, on one adapter and spread over 8
adapters, against peft's mixed-adapter `generate`.

On the reference target (7.3M parameters), one thread, greedy: 8 random rank-16 peft adapters on every linear
projection (attention and MLP), saved as peft folders in a temp folder (never kept). 64 held-out prompts of 16-96
tokens, each generating 16-64 tokens (EOS ignored; `hf_accel.bench.workload.serving_requests`). Rows, interleaved
with warm-up, tok/s of generated tokens:
- the base model in the Engine, compiled (its default) and eager (`enforce_eager=True`);
- the Engine with `lora=LoRAConfig(max_loras=8)`, compiled (its default): every request on one adapter, the 8 adapters uniformly (request i
  on adapter i % 8), and skewed (adapter k with weight 1 / (k + 1));
- peft: a `PeftModel` holding the 8 adapters, `generate(adapter_names=...)` over the same requests in batches of 16
  (left-padded, each batch as long as its longest request), the mixed-adapter path peft offers.
Each LoRA row's outputs are compared with peft's greedy outputs of the same requests (identical count).

Regenerate benchmarks/results/bench_lora.json and docs/bench_lora.md:
    .venv/bin/python benchmarks/bench_lora.py
Smoke run (fewer requests, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_lora.py --quick
"""

from __future__ import annotations

import copy
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, reference
from hf_accel.bench.output import hardware, run_benchmark, target_table
from hf_accel.bench.timing import time_interleaved
from hf_accel.bench.workload import Request, serving_requests

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_lora"
COMMAND = ".venv/bin/python benchmarks/bench_lora.py"
NUM_ADAPTERS, RANK = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL = {"requests": 64, "repeats": 3, "peft_batch": 16}
QUICK = {"requests": 16, "repeats": 1, "peft_batch": 16}
PEFT_ROW = "peft generate(adapter_names), 8 adapters uniform"


def make_adapters(model, folder: Path) -> list[LoRARequest]:
    """8 random rank-16 peft adapters on every projection of `model`, saved under `folder`."""
    from peft import LoraConfig, get_peft_model

    requests = []
    for i in range(NUM_ADAPTERS):
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
        reference_outputs = {kind: peft_run(peft_model, work, kinds[kind], plan["peft_batch"])[1]
                             for kind in ("one", "uniform", "skewed")}
    rows = []
    base_s = statistics.median(timings.seconds["base, compiled"])
    eager_s = statistics.median(timings.seconds["base, eager"])
    for key in runs:
        seconds = statistics.median(timings.seconds[key])
        kind = engines[key][1] if key in engines else None
        same = None
        if kind in reference_outputs and engines[key][0] is served:
            same = sum(a == b for a, b in zip(timings.outputs[key], reference_outputs[kind]))
        rows.append({"run": key, "tok_s": tokens / seconds, "vs_base_compiled": base_s / seconds,
                     "vs_base_eager": eager_s / seconds, "identical_to_peft": same})
    return {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(), "requests": len(work),
            "tokens": tokens, "adapters": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS, "rows": rows,
            "total_seconds": time.perf_counter() - started, "targets_met": targets(rows)}


def reference_len(model) -> int:
    return model.config.max_position_embeddings


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_run = {row["run"]: row for row in rows}
    uniform = by_run["LoRA engine, 8 adapters uniform"]
    peft = by_run[PEFT_ROW]
    return [
        {"name": "8 adapters (uniform) / base engine tok/s", "goal": ">= 0.85",
         "value": uniform["vs_base_compiled"], "met": uniform["vs_base_compiled"] >= 0.85},
        {"name": "8 adapters (uniform) / peft's mixed-adapter generate tok/s", "goal": ">= 5",
         "value": uniform["tok_s"] / peft["tok_s"], "met": uniform["tok_s"] / peft["tok_s"] >= 5},
    ]


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
              "projection, the adapters' stacked weights and each token's slot graph inputs (the base weights frozen); "
              "\"identical to peft\" counts requests whose greedy tokens equal peft's `generate` with the same "
              "adapter (fp32; a near-tie can part them).", "", *target_table(report["targets_met"]), "",
              f"From `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
