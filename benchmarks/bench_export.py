"""Accuracy of `hf-accel export --format vllm` checkpoints: the reference target exported in bf16, int8 and int4
(compressed-tensors, loaded back through transformers), against the float model and hf_accel's own quantized model of
the same bits (int8 per channel; int4 with the export's group size, 128), on held-out text.

Per variant: logit differences (max abs, max abs / max |float logit|, mean abs), greedy top-1 agreement, held-out
perplexity, and the bytes of the exported safetensors. hf_accel's quantized models run as hf_accel runs them (the
CPU int8 / int4 kernels take bf16 activations); the "hf_accel weights, fp32" rows put hf_accel's dequantized weights
into a float model to separate the schemes from the kernels' activation rounding. Accuracy only, no timings: vLLM
itself needs a GPU.

Regenerate benchmarks/results/bench_export.json and docs/bench_export.md:
    .venv/bin/python benchmarks/bench_export.py
Smoke run (two short rows, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_export.py --quick
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_accel import Int4Linear, Int8Linear, WeightOnlyConfig, bench, quantize_model, reference
from hf_accel.bench.output import run_benchmark
from hf_accel.export import VLLM_VERSION, compressed, export_vllm
from hf_accel.reference import evaluate

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_export"
COMMAND = ".venv/bin/python benchmarks/bench_export.py"
HF_ACCEL_CONFIGS = {"int8": WeightOnlyConfig(bits=8), "int4": WeightOnlyConfig(bits=4, group_size=128)}


def logits_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=batch).logits.float() for batch in rows.split(4)])


def compare(ours: torch.Tensor, theirs: torch.Tensor, float_scale: float) -> dict[str, float]:
    """Max / relative / mean absolute logit difference and top-1 agreement of two `[rows, seq, vocab]` logits."""
    diff = (ours - theirs).abs()
    return {"max_abs": round(diff.max().item(), 4), "max_rel": round(diff.max().item() / float_scale, 4),
            "mean_abs": round(diff.mean().item(), 4),
            "top1_agreement": round((ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(), 4)}


def with_dequantized_weights(float_model: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """A float copy of `float_model` holding `quantized`'s dequantized weights (fp32)."""
    model = copy.deepcopy(float_model)
    for name, module in quantized.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            model.get_submodule(name).weight.data = module.dequantized_weight(torch.float32)
    return model


def int8_code_agreement(folder: Path, hf_accel_int8: torch.nn.Module) -> float:
    """Fraction of the exported int8 codes equal to `Int8Linear`'s for the same weights."""
    tensors, equal, total = load_file(folder / "model.safetensors"), 0, 0
    for name, module in hf_accel_int8.named_modules():
        if isinstance(module, Int8Linear):
            ours = compressed.unpack_codes(tensors[f"{name}.weight_packed"], 8, tensors[f"{name}.weight_shape"])
            theirs = (module.dequantized_weight() / module.weight_scale.float()[:, None]).round()
            equal, total = equal + (ours.float() == theirs).sum().item(), total + ours.numel()
    return equal / total


def variant_row(name: str, model: torch.nn.Module, rows: torch.Tensor, reference_logits: dict[str, torch.Tensor],
                float_scale: float, weight_bytes: int | None = None) -> dict[str, Any]:
    logits = logits_of(model, rows)
    return {"variant": name, "weight_bytes": weight_bytes, "perplexity": round(evaluate.perplexity(model, rows), 4),
            **{f"vs_{key}": compare(logits, other, float_scale) for key, other in reference_logits.items()}}


def measure(quick: bool) -> dict[str, Any]:
    model, tokenizer = reference.load("target")
    rows = reference.held_out_sequences(tokenizer, seq_len=64 if quick else 256, max_rows=2 if quick else 16)
    float_logits = logits_of(model, rows)
    float_scale = float_logits.abs().max().item()
    results = [variant_row("float (bf16 weights, fp32 compute)", model, rows, {"float": float_logits}, float_scale)]
    with tempfile.TemporaryDirectory() as scratch:
        for quant in (None, "int8", "int4"):
            folder = export_vllm(Path(scratch) / (quant or "bf16"), quant=quant)
            exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            compared = {"float": float_logits}
            if quant is not None:
                hf_accel_model = quantize_model(model, HF_ACCEL_CONFIGS[quant])
                compared[f"hf_accel_{quant}"] = logits_of(hf_accel_model, rows)
                dequantized = with_dequantized_weights(model, hf_accel_model)
                compared[f"hf_accel_{quant}_weights_fp32"] = logits_of(dequantized, rows)
                results.append(variant_row(f"hf_accel {quant}", hf_accel_model, rows, {"float": float_logits},
                                           float_scale))
                results.append(variant_row(f"hf_accel {quant} weights, fp32", dequantized, rows,
                                           {"float": float_logits}, float_scale))
                if quant == "int8":
                    code_agreement = round(int8_code_agreement(folder, hf_accel_model), 5)
            size = (folder / "model.safetensors").stat().st_size
            results.append(variant_row(f"export {quant or 'bf16'}", exported, rows, compared, float_scale, size))
    return {"model": "hf_accel reference target", "vllm_version": VLLM_VERSION, "hardware": bench.hardware(),
            "rows": list(rows.shape), "max_abs_float_logit": round(float_scale, 4),
            "int8_codes_equal_to_hf_accel": code_agreement, "results": results}


def render(report: dict[str, Any]) -> str:
    lines = [f"# Export accuracy ({report['model']}, for vLLM {report['vllm_version']})", "",
             f"Held-out text, {report['rows'][0]} rows of {report['rows'][1]} tokens; max |float logit| = "
             f"{report['max_abs_float_logit']}; exported int8 codes equal to hf_accel's `Int8Linear` codes: "
             f"{report['int8_codes_equal_to_hf_accel']:.3%} (the rest one step apart). Generated by `{COMMAND}`.", "",
             "| variant | safetensors bytes | perplexity | compared with | max abs | max rel | mean abs | top-1 |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in report["results"]:
        for key, stats in ((k, v) for k, v in row.items() if k.startswith("vs_")):
            size = "" if row["weight_bytes"] is None else f"{row['weight_bytes']:,}"
            lines.append(f"| {row['variant']} | {size} | {row['perplexity']} | {key[3:]} | {stats['max_abs']} | "
                         f"{stats['max_rel']} | {stats['mean_abs']} | {stats['top1_agreement']} |")
    return "\n".join(lines)


def headline(report: dict[str, Any]) -> dict[str, str]:
    """The export rows, for docs/export.md."""
    lines = [f"Reference target, {report['rows'][0]} held-out rows of {report['rows'][1]} tokens (max |float logit| "
             f"{report['max_abs_float_logit']}); logits of the export loaded through transformers:", "",
             "| export | bytes | perplexity | vs | max abs | max rel | mean abs | top-1 |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in (r for r in report["results"] if r["variant"].startswith("export")):
        for key, stats in ((k, v) for k, v in row.items() if k.startswith("vs_")):
            lines.append(f"| {row['variant'][7:]} | {row['weight_bytes']:,} | {row['perplexity']} | {key[3:]} | "
                         f"{stats['max_abs']} | {stats['max_rel']} | {stats['mean_abs']} | {stats['top1_agreement']} |")
    floats = [r for r in report["results"] if r["variant"].startswith("hf_accel") and "fp32" not in r["variant"]]
    lines += ["", "hf_accel's own quantized models against the float model: " + "; ".join(
        f"{r['variant']}: max abs {r['vs_float']['max_abs']}, mean abs {r['vs_float']['mean_abs']}, perplexity "
        f"{r['perplexity']}" for r in floats) + f" (float: {report['results'][0]['perplexity']}).",
        f"Exported int8 codes equal to `Int8Linear`'s: {report['int8_codes_equal_to_hf_accel']:.3%}."]
    return {"docs/export.md": "\n".join(lines)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render, headline)


if __name__ == "__main__":
    main(sys.argv[1:])
