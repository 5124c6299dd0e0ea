"""hf_accel's quantized KV cache against DynamicCache and transformers' QuantizedCache (quanto), in one process.

Measures (a) KV bytes vs a 16-bit DynamicCache at a 2,048-token context, scales, minima and residual included (mean
and worst over the decode steps, and at the end); (b) decode tok/s at 256 and 2,048 context, batch 1, vs DynamicCache
and vs quanto at the same bits (interleaved, paired ratios); (c) held-out perplexity of the reference target when
every next-token prediction is decoded through the cache (teacher forcing), and greedy agreement with the fp cache.
hf_accel rows keep the default 4 full-precision sinks (each row's first tokens); "no fp sinks" rows set
`num_fp_sink_tokens=0` and quantize them too (int4 in (a) and (b), int4 and int2 in (c)).
Method (hf_accel.bench): seed, one warm-up round, strategies interleaved, median of repeats, paired ratios;
decode time = time(N new tokens) - time(1 new token).

Regenerate benchmarks/results/bench_quantized_kv.json and docs/bench_quantized_kv.md:
    .venv/bin/python benchmarks/bench_quantized_kv.py
Smoke run (tiny random model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_quantized_kv.py --quick
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StoppingCriteria

from hf_accel import QuantizedKVCache, bench, reference
from hf_accel.bench.output import run_benchmark
from hf_accel.display import format_bytes, format_table

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_quantized_kv.py"
BITS = (8, 4, 2)
TARGETS = {"kv_ratio": {4: 0.30, 2: 0.20}, "vs_quanto": 3.0, "vs_dynamic": 0.8, "ppl_increase": {4: 0.01, 2: 0.05}}
HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


@dataclass(frozen=True, slots=True)
class Plan:
    group_size: int
    residual_length: int
    memory_context: int
    memory_new_tokens: int
    speed_contexts: tuple[int, ...]
    speed_new_tokens: int
    repeats: int
    ppl_rows: int
    ppl_seq_len: int
    ppl_prompt_len: int
    agreement_prompt_len: int
    agreement_new_tokens: int


FULL = Plan(64, 128, 2048, 128, (256, 2048), 192, 3, 8, 512, 64, 256, 128)  # 192 new tokens: every cache flushes
QUICK = Plan(16, 32, 128, 16, (32, 128), 8, 1, 2, 64, 16, 32, 8)


NO_SINKS = " no fp sinks"  # name suffix of the rows with num_fp_sink_tokens=0
NO_SINKS_BITS = {"memory": (4,), "speed": (4,), "quality": (4, 2)}  # where the no-sink rows are measured


def quantized_kwargs(plan: Plan, nbits: int, num_fp_sink_tokens: int = 4) -> dict[str, Any]:
    config = {"backend": "hf_accel", "nbits": nbits, "group_size": plan.group_size,
              "residual_length": plan.residual_length, "num_fp_sink_tokens": num_fp_sink_tokens}
    return {"cache_implementation": "quantized", "cache_config": config}


def quantized_variants(part: str) -> list[tuple[str, int, int]]:
    """(row name, bits, num_fp_sink_tokens) of the hf_accel rows of one part: every bit width with the default 4
    sinks, then the no-sink rows of `NO_SINKS_BITS[part]`."""
    return [(f"hf_accel int{n}", n, 4) for n in BITS] + [
        (f"hf_accel int{n}{NO_SINKS}", n, 0) for n in NO_SINKS_BITS[part]]


def strategies(plan: Plan) -> list[bench.Strategy]:
    """DynamicCache, hf_accel at each bit width, then quanto at 4 and 2 bits when optimum-quanto is installed (not in
    the quick plan: quanto builds its kernels on first use)."""
    rows = [bench.Strategy("DynamicCache", "transformers default (baseline)", lambda model, max_len: {})]
    for name, nbits, sinks in quantized_variants("speed"):
        rows.append(bench.Strategy(name, f"group {plan.group_size}, residual {plan.residual_length}, {sinks} fp sinks",
                                   lambda model, max_len, n=nbits, s=sinks: quantized_kwargs(plan, n, s)))
    for nbits in (4, 2) if HAS_QUANTO and plan is not QUICK else ():
        config = {"backend": "quanto", "nbits": nbits, "q_group_size": plan.group_size,
                  "residual_length": plan.residual_length}
        rows.append(bench.Strategy(f"quanto int{nbits}", "transformers QuantizedCache, optimum-quanto",
                                   lambda model, max_len, c=config: {"cache_implementation": "quantized",
                                                                     "cache_config": c}))
    return rows


class _RecordBytes(StoppingCriteria):
    """Never stops; records the cache's bytes after every generated token."""

    def __init__(self, cache: QuantizedKVCache | DynamicCache):
        self.cache, self.samples = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.samples.append(bench.kv_bytes(self.cache))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure_memory(model: LlamaForCausalLM, plan: Plan) -> dict[str, Any]:
    """KV bytes of each bit width over a greedy generation from a `memory_context`-token prompt, model in bf16: the
    same bytes as fp16 (2 per element, scales and minima included), and fast on CPU where fp16 matmuls are not."""
    half = model.to(torch.bfloat16)
    inputs = bench.make_prompts([plan.memory_context], model.config.vocab_size, seed=3)
    caches = {"DynamicCache 16-bit": DynamicCache(config=half.config)}
    caches |= {name: QuantizedKVCache(half.config, n, plan.group_size, plan.residual_length, sinks)
               for name, n, sinks in quantized_variants("memory")}
    samples = {}
    for name, cache in caches.items():
        recorder = _RecordBytes(cache)
        with torch.inference_mode():
            half.generate(**inputs, past_key_values=cache, max_new_tokens=plan.memory_new_tokens, do_sample=False,
                          min_new_tokens=plan.memory_new_tokens, stopping_criteria=[recorder])
        samples[name] = recorder.samples
    model.to(torch.float32)
    base = samples["DynamicCache 16-bit"]
    rows = [{"name": name, "end_bytes": s[-1], "end_ratio": s[-1] / base[-1],
             "mean_ratio": sum(a / b for a, b in zip(s, base)) / len(s), "max_ratio": max(a / b for a, b in zip(s, base))}
            for name, s in samples.items()]
    return {"context": plan.memory_context, "new_tokens": plan.memory_new_tokens, "dtype": "bfloat16", "results": rows}


def measure_speed(model: LlamaForCausalLM, plan: Plan, tokenizer=None) -> list[dict[str, Any]]:
    """Decode speed per context length; prompts of held-out text when there is a tokenizer, else random ids."""
    out = []
    for context in plan.speed_contexts:
        inputs = (bench.text_prompts(tokenizer, [context]) if tokenizer is not None
                  else bench.make_prompts([context], model.config.vocab_size, seed=1))
        results = bench.compare_strategies(model, inputs, plan.speed_new_tokens, strategies(plan),
                                           repeats=plan.repeats, warmup=1)
        print(f"\ncontext {context}\n{bench.results_table(results)}", flush=True)
        out.append({"context": context, "new_tokens": plan.speed_new_tokens, "repeats": plan.repeats,
                    "results": [r.as_dict() for r in results]})
    return out


@torch.inference_mode()
def decoded_perplexity(model: LlamaForCausalLM, rows: torch.Tensor, prompt_len: int, cache) -> float:
    """exp(mean NLL) of tokens `prompt_len + 1 ..` of `rows` `[batch, seq]`, each predicted by a decode step
    through `cache` after prefilling `prompt_len` tokens (teacher forcing: the true token is fed back)."""
    logits = [model(input_ids=rows[:, :prompt_len], past_key_values=cache).logits[:, -1]]
    for t in tqdm(range(prompt_len, rows.shape[1] - 1), desc="perplexity", unit="token", leave=False):
        logits.append(model(input_ids=rows[:, t : t + 1], past_key_values=cache).logits[:, -1])
    predicted = torch.stack(logits, 1).float()  # [batch, seq - prompt_len, vocab]
    nll = torch.nn.functional.cross_entropy(predicted.flatten(0, 1), rows[:, prompt_len:].flatten())
    return math.exp(nll.item())


def measure_quality(model: LlamaForCausalLM, rows: torch.Tensor, plan: Plan) -> dict[str, Any]:
    """Teacher-forced decode perplexity per cache, and greedy agreement with DynamicCache on held-out prompts."""
    ppl = {"DynamicCache": decoded_perplexity(model, rows, plan.ppl_prompt_len, DynamicCache(config=model.config))}
    variants = quantized_variants("quality")
    for name, nbits, sinks in variants:
        cache = QuantizedKVCache(model.config, nbits, plan.group_size, plan.residual_length, sinks)
        ppl[name] = decoded_perplexity(model, rows, plan.ppl_prompt_len, cache)
    prompts = {"input_ids": rows[:, : plan.agreement_prompt_len]}
    options = dict(max_new_tokens=plan.agreement_new_tokens, min_new_tokens=plan.agreement_new_tokens, do_sample=False)
    with torch.inference_mode():
        base = model.generate(**prompts, **options)[:, plan.agreement_prompt_len :]
        agreement = {name: bench.token_agreement(
            model.generate(**prompts, **options, **quantized_kwargs(plan, n, s))[:, plan.agreement_prompt_len :], base)
            for name, n, s in variants}
    return {"rows": rows.shape[0], "seq_len": rows.shape[1], "prompt_len": plan.ppl_prompt_len, "perplexity": ppl,
            "agreement_prompt_len": plan.agreement_prompt_len, "agreement_new_tokens": plan.agreement_new_tokens,
            "greedy_agreement": agreement}


def load_model(quick: bool) -> tuple[LlamaForCausalLM, torch.Tensor | None, str]:
    """The reference target with held-out rows, or (quick) a tiny random Llama with random rows."""
    if quick:
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, eos_token_id=None, pad_token_id=0)
        model = LlamaForCausalLM(config).eval()
        return model, torch.randint(1, 256, (QUICK.ppl_rows, QUICK.ppl_seq_len)), bench.describe_model(model)
    model, tokenizer = reference.load("target")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = None  # fixed-length runs
    rows = reference.held_out_sequences(tokenizer, FULL.ppl_seq_len, FULL.ppl_rows)
    return model, rows, f"hf_accel reference target: {bench.describe_model(model)}"


def _result(scenario: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in scenario["results"] if r["name"] == name), None)


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    memory = {r["name"]: r for r in report["memory"]["results"]}
    for nbits, limit in TARGETS["kv_ratio"].items():
        got = memory[f"hf_accel int{nbits}"]
        rows.append([f"KV bytes <= {limit:.2f}x 16-bit DynamicCache at {nbits} bits ({report['memory']['context']} ctx, "
                     "mean over decode)", f"{got['mean_ratio']:.3f}x (max {got['max_ratio']:.3f}x)",
                     _yes(got["mean_ratio"] <= limit)])
    longest = report["speed"][-1]
    ours = _result(longest, "hf_accel int4")
    rows.append([f"decode >= {TARGETS['vs_dynamic']}x DynamicCache at {longest['context']} ctx (int4)",
                 f"{ours['speed_ratio']:.2f}x", _yes(ours["speed_ratio"] >= TARGETS["vs_dynamic"])])
    for nbits in (4, 2):
        quanto = _result(longest, f"quanto int{nbits}")
        if quanto is None:
            rows.append([f"decode >= {TARGETS['vs_quanto']}x quanto int{nbits}", "optimum-quanto not installed", "-"])
            continue
        ratio = _result(longest, f"hf_accel int{nbits}")["speed_ratio"] / quanto["speed_ratio"]
        rows.append([f"decode >= {TARGETS['vs_quanto']}x quanto at {nbits} bits ({longest['context']} ctx)",
                     f"{ratio:.1f}x", _yes(ratio >= TARGETS["vs_quanto"])])
    ppl = report["quality"]["perplexity"]
    for nbits, limit in TARGETS["ppl_increase"].items():
        increase = ppl[f"hf_accel int{nbits}"] / ppl["DynamicCache"] - 1
        rows.append([f"perplexity increase <= {100 * limit:.0f}% at {nbits} bits", f"{100 * increase:+.2f}%",
                     _yes(increase <= limit)])
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(report: dict[str, Any]) -> str:
    hw, quality, memory = report["hardware"], report["quality"], report["memory"]
    lines = [
        "# Quantized KV cache benchmark", "",
        f"Regenerate with `{COMMAND}` ({report['runtime_s']:.0f} s here; `--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, "
        f"transformers {hw['transformers']}; a shared machine, so compare ratios, not absolutes",
        f"- model: {report['model']}; speed in fp32, memory in bf16, batch 1, greedy",
        f"- hf_accel settings: group {report['group_size']}, residual {report['residual_length']}, 4 full-precision "
        f"sinks (rows '{NO_SINKS.strip()}': `num_fp_sink_tokens=0`); quanto: "
        f"{'optimum-quanto ' + report['quanto_version'] if report['quanto_version'] else 'not installed'}, same "
        "bits, group and residual", f"- method: {report['method']}", "",
        "## Targets", "", format_table(["target", "measured", "met"], target_rows(report), markdown=True), "",
        f"## KV memory, {memory['context']}-token prompt + {memory['new_tokens']} generated tokens, 16-bit model", "",
        "Model in bf16: the same bytes as fp16 (2 per element); codes, scales, minima, sinks and residual all "
        "counted.", "",
        format_table(["cache", "bytes at the end", "x 16-bit DynamicCache (end)", "mean over decode", "max"],
                     [[r["name"], format_bytes(r["end_bytes"], decimals=1), f"{r['end_ratio']:.3f}x",
                       f"{r['mean_ratio']:.3f}x", f"{r['max_ratio']:.3f}x"] for r in memory["results"]], True),
        "", "## Decode speed",
    ]
    for scenario in report["speed"]:
        results = [bench.StrategyResult(**r) for r in scenario["results"]]
        lines += ["", f"### context {scenario['context']}, {scenario['new_tokens']} new tokens, median of "
                      f"{scenario['repeats']} repeats", "", bench.results_table(results, markdown=True)]
    rows = [[name, f"{value:.3f}", f"{100 * (value / quality['perplexity']['DynamicCache'] - 1):+.2f}%",
             "-" if name == "DynamicCache" else f"{100 * quality['greedy_agreement'][name]:.1f}%"]
            for name, value in quality["perplexity"].items()]
    lines += ["", f"## Quality: {quality['rows']} held-out rows of {quality['seq_len']} tokens", "",
              f"Perplexity of tokens {quality['prompt_len'] + 1}-{quality['seq_len']}, each predicted by a decode step "
              f"through the cache after a {quality['prompt_len']}-token prefill (teacher forcing). Greedy agreement: "
              f"{quality['agreement_new_tokens']} tokens generated from the first {quality['agreement_prompt_len']} "
              "tokens of each row, position by position against DynamicCache.", "",
              format_table(["cache", "perplexity", "vs DynamicCache", "greedy agreement"], rows, True)]
    return "\n".join(lines) + "\n"


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    start = time.perf_counter()
    model, rows, description = load_model(quick)
    quanto = importlib.metadata.version("optimum-quanto") if HAS_QUANTO else None
    report: dict[str, Any] = {
        "command": COMMAND + (" --quick" if quick else ""), "hardware": bench.hardware(), "seed": 0,
        "model": description, "group_size": plan.group_size, "residual_length": plan.residual_length,
        "quanto_version": quanto,
        "method": "one warm-up round, then the median of the repeats, strategies interleaved (order alternating), "
                  "same process; decode tok/s = (N - 1) / (time(N new tokens) - time(1)); speed ratio = median of "
                  "per-repeat ratios to DynamicCache (paired within a repeat)",
    }
    print(f"{description}\n{report['hardware']}", flush=True)
    report["memory"] = measure_memory(model, plan)
    report["quality"] = measure_quality(model, rows, plan)
    print(json.dumps(report["quality"], indent=1), flush=True)
    report["speed"] = measure_speed(model, plan, None if quick else reference.load("target")[1])
    report["runtime_s"] = time.perf_counter() - start
    return report


def headlines(report: dict[str, Any]) -> dict[str, str]:
    table = format_table(["target", "measured", "met"], target_rows(report), markdown=True)
    return {"docs/caches.md": f"{table}\n\nFrom `{COMMAND}`; all tables: [bench_quantized_kv.md](bench_quantized_kv.md)."}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], "bench_quantized_kv", ROOT,
                                      lambda quick: run(QUICK if quick else FULL, quick), markdown, headlines)


if __name__ == "__main__":
    main(sys.argv[1:])
