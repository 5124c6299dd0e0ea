"""Decode speed at the sizes people run: hf_accel's fp32 / bf16 / int8 / int4 weights against llama.cpp's f32 / bf16 /
Q8_0 / Q4_0 of the same weights, and both against the memory's bandwidth limit.

At 0.2-1B parameters a decode step reads every weight once, so tokens/s is at most the read bandwidth divided by the
bytes of weights read per token (the input embedding's one row aside). Measured here, batch 1:
- models: the reference target (7.3M), and random-weight Llamas of 185M and 755M parameters (built from a config into a
  temp folder with the reference tokenizer; never downloaded, never kept);
- hf_accel: `generate` eager (DynamicCache) and compiled (`cache_implementation="paged"` + `compile_config`), int8
  (per channel) and int4 (groups of 64, the default: 4.5 bits a weight, as Q4_0's 4-bit codes with an fp16 scale per
  32) through `hf_accel.quantize`'s kernels, with the output layer in int8 per channel (`module_formats`), as
  llama.cpp's files hold theirs in Q8_0 / Q6_K (hf_accel's default keeps it fp32, 4x the int8 bytes;
  docs/weight-quantization.md gives its perplexity cost);
- llama.cpp (`llama-bench -p 0 -n N`, batch 1) on GGUF files made by its own converter and `llama-quantize` from the
  same checkpoint (`llama_cpp_peer.py`; rows skipped with a message where no build is found: `--build-llama-cpp`
  builds one from the `llama-cpp-python` sdist);
- at 1 and 2 threads (torch's intra-op threads; llama.cpp's `-t`), with the read bandwidth measured at each
  (`read_bandwidth.py`: a probe, or an fp32 decode where it reads faster).
Timing: every variant once per repeat, interleaved (order alternating, llama.cpp's rows between ours) after a warm-up
round (which compiles); hf_accel's decode time is from its first new token to its last (a streamer stamps each), so it
times N - 1 decode steps and never the prefill; ratios are medians of per-repeat ratios.

Regenerate benchmarks/results/bench_size.json, docs/bench_size.md and docs/bench_size.png:
    .venv/bin/python benchmarks/bench_size.py
Smoke run (a tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_size.py --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_accel
from hf_accel import reference
from hf_accel.bench.output import benchmark_parser, hardware, output_root, run_benchmark, target_table
from hf_accel.bench.timing import torch_threads
from hf_accel.display import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer  # noqa: E402
import read_bandwidth  # noqa: E402
from bench_weight_quant import _TokenClock, reference_folder, reference_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_size"
COMMAND = ".venv/bin/python benchmarks/bench_size.py"
OUTPUT_INT8 = {"lm_head": {"bits": 8}}  # the output layer quantized, as llama-quantize does (Q8_0 / Q6_K)
FORMATS = {  # name -> (dtype, hf_accel weight-only config)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.float32, hf_accel.WeightOnlyConfig(bits=8, module_formats=OUTPUT_INT8)),
    # groups of 64: Q4_0's 4.5 bits a weight
    "int4": (torch.float32, hf_accel.WeightOnlyConfig(bits=4, module_formats=OUTPUT_INT8)),
}
MODES = {"eager": {}, "compiled": {"cache_implementation": "paged", "compile_config": CompileConfig(fullgraph=True)}}
TARGETS = {"int8_vs_llama_cpp": 1.2, "int4_vs_llama_cpp": 1.2, "int8_bandwidth_share": 0.8}


@dataclass(frozen=True, slots=True)
class Size:
    name: str
    shape: dict[str, int] | None  # LlamaConfig fields; None: the reference target itself


@dataclass(frozen=True, slots=True)
class Plan:
    sizes: tuple[Size, ...]
    threads: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int  # measured repeats after the warm-up round


FULL = Plan((Size("reference", None),
             Size("185M", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                               num_key_value_heads=4)),
             Size("755M", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8))),
            threads=(1, 2), prompt_len=32, new_tokens=33, repeats=3)
QUICK = Plan((Size("tiny", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2)),),
             threads=(1,), prompt_len=8, new_tokens=5, repeats=1)


def model_folder(size: Size, scratch: Path) -> Path:
    """A checkpoint folder of `size` (weights and the reference tokenizer) for both tools."""
    if size.shape is None:
        return reference_folder(scratch)[0]
    tokenizer = reference_tokenizer()
    config = LlamaConfig(**size.shape, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    return scratch


def load(folder: Path, fmt: str) -> torch.nn.Module:
    dtype, quant = FORMATS[fmt]
    model = hf_accel.load_model(str(folder), quant=quant, dtype=dtype, device_map="cpu").eval()
    model.generation_config.eos_token_id = None  # time exactly N tokens
    model.generation_config.pad_token_id = 0
    return model


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter and buffer in the kernels' current layouts (the
    panels and fp16 group parameters of int4 and grouped int8, not the checkpoint's fp32 ones), the input embedding
    aside."""
    embedding = model.get_input_embeddings().weight
    total, seen = 0, {embedding.data_ptr()}
    for module in model.modules():
        for tensor in tensors_read(module):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.nbytes
    return total


def tensors_read(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of `module` itself (not its children's) that its forward reads at a decode step."""
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    return [tensor for name, tensor in tensors if tensor is not None and not _unread(module, name)]


def _unread(module: torch.nn.Module, name: str) -> bool:
    if name in ("inv_freq", "original_inv_freq"):
        return True
    if isinstance(module, hf_accel.Int4Linear) and module.layout == "panels":
        return name == "weight_qparams"  # the kernel reads weight_qpanels instead
    # grouped int8: the kernel reads weight_scale_panels instead
    return isinstance(module, hf_accel.Int8Linear) and module.weight_scale_panels is not None and name == "weight_scale"


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, mode: str) -> float:
    """Seconds from the first new token to the last: `new_tokens - 1` decode steps, the prefill excluded."""
    clock = _TokenClock()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                   **MODES[mode])
    stamps = clock.stamps[1:]  # stamps[0]: the prompt
    if len(stamps) != new_tokens:
        raise RuntimeError(f"generate streamed {len(stamps)} new tokens, expected {new_tokens}")
    return stamps[-1] - stamps[0]


def gguf_bytes_per_token(path: Path, source: Path) -> int:
    """The GGUF file's tensor bytes but the token embedding's (read one row per token)."""
    sys.path.insert(0, str(source / "gguf-py"))
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name != "token_embd.weight")


def llama_cpp_files(llama: llama_cpp_peer.LlamaCpp, folder: Path, scratch: Path) -> dict[str, Path]:
    """GGUF per format: converted from `folder` by llama.cpp's converter, quantized by `llama-quantize`."""
    files, converted = {}, {}
    for fmt, (outtype, kind) in llama_cpp_peer.GGUF_TYPES.items():
        if outtype not in converted:
            converted[outtype] = llama.convert(folder, scratch, outtype)
        files[fmt] = converted[outtype] if kind is None else llama.quantized(converted[outtype], kind)
    return files


def measure_size(size: Size, plan: Plan, llama: llama_cpp_peer.LlamaCpp | None) -> dict[str, Any]:
    """Every format x mode of hf_accel and every format of llama.cpp at one size, at every thread count."""
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        folder = model_folder(size, scratch / "model")
        tokenizer = reference_tokenizer()
        prompt = reference.held_out_sequences(tokenizer, plan.prompt_len, max_rows=1)
        models = {fmt: load(folder, fmt) for fmt in FORMATS}
        params = sum(p.numel() for p in models["fp32"].parameters())
        ours_bytes = {fmt: bytes_read_per_token(model) for fmt, model in models.items()}
        gguf = llama_cpp_files(llama, folder, scratch / "gguf") if llama else {}
        theirs_bytes = {fmt: gguf_bytes_per_token(path, llama.source) for fmt, path in gguf.items()}
        rows = []
        for threads in plan.threads:
            with torch_threads(threads):
                seconds, theirs = _interleaved(models, gguf, llama, prompt, plan, threads)
            for fmt in FORMATS:
                for mode in MODES:
                    rates = [(plan.new_tokens - 1) / s for s in seconds[fmt, mode]]
                    ratio = statistics.median(o / t for o, t in zip(rates, theirs[fmt])) if theirs.get(fmt) else None
                    rows.append({"size": size.name, "format": fmt, "tool": f"hf_accel {mode}", "threads": threads,
                                 "tokens_per_s": statistics.median(rates), "bytes_per_token": ours_bytes[fmt],
                                 "vs_llama_cpp": ratio})
                if theirs.get(fmt):
                    rows.append({"size": size.name, "format": fmt, "tool": "llama.cpp", "threads": threads,
                                 "tokens_per_s": statistics.median(theirs[fmt]), "bytes_per_token": theirs_bytes[fmt],
                                 "vs_llama_cpp": 1.0})
        del models
        gc.collect()
    return {"size": size.name, "parameters": params, "rows": rows}


def _interleaved(models, gguf, llama, prompt, plan, threads):
    """Decode seconds per (format, mode) and llama.cpp tokens/s per format, per repeat, after a warm-up round."""
    seconds: dict[tuple[str, str], list[float]] = {(fmt, mode): [] for fmt in models for mode in MODES}
    theirs: dict[str, list[float]] = {fmt: [] for fmt in gguf}
    cells = list(seconds)
    for repeat in range(1 + plan.repeats):
        for fmt, mode in (cells if repeat % 2 == 0 else cells[::-1]):
            elapsed = decode_seconds(models[fmt], prompt, plan.new_tokens, mode)
            if repeat:
                seconds[fmt, mode].append(elapsed)
            if repeat and mode == "compiled" and fmt in gguf:  # llama.cpp's row of this format, between ours
                theirs[fmt].append(llama.decode_tokens_per_second(gguf[fmt], threads, plan.new_tokens - 1, 1))
        print(f"threads {threads}: repeat {repeat}/{plan.repeats} done", flush=True)
    return seconds, theirs


def measure(quick: bool, build_llama_cpp: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    llama, skipped = _llama_cpp(build_llama_cpp, quick)
    probed = {threads: read_bandwidth.probe(threads) for threads in plan.threads}
    sizes = [measure_size(size, plan, llama) for size in plan.sizes]
    bandwidth = read_bandwidth.limits(probed, sizes)
    for row in (row for size in sizes for row in size["rows"]):  # the limit each row's bytes allow
        row["limit_tokens_per_s"] = bandwidth[row["threads"]] / row["bytes_per_token"]
        row["bandwidth_share"] = row["tokens_per_s"] / row["limit_tokens_per_s"]
    report = {
        "command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
        "llama_cpp": llama.version if llama else None, "llama_cpp_skipped": skipped,
        "bandwidth_bytes_per_s": {str(t): b for t, b in bandwidth.items()},
        "bandwidth_probe_bytes_per_s": {str(t): b for t, b in probed.items()},
        "new_tokens": plan.new_tokens, "prompt_len": plan.prompt_len, "repeats": plan.repeats, "sizes": sizes,
        "total_seconds": time.perf_counter() - started,
    }
    report["targets"] = targets(report)
    return report


def _llama_cpp(build: bool, quick: bool) -> tuple[llama_cpp_peer.LlamaCpp | None, str | None]:
    found = llama_cpp_peer.find()
    if found is None and build:
        found = llama_cpp_peer.build()
    if found is None:
        message = f"llama.cpp rows skipped: no build under {llama_cpp_peer.HOME} (--build-llama-cpp builds one)"
        print(message, flush=True)
        return None, message
    return found, None


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals at the largest size, the compiled rows, each thread count."""
    largest = report["sizes"][-1]["rows"]
    found = []
    for threads in sorted({row["threads"] for row in largest}):
        ours = {r["format"]: r for r in largest if r["tool"] == "hf_accel compiled" and r["threads"] == threads}
        for key, goal in TARGETS.items():
            fmt = key.split("_")[0]
            value = ours[fmt]["vs_llama_cpp"] if key.endswith("llama_cpp") else ours[fmt]["bandwidth_share"]
            found.append({"name": f"{key} ({threads} thread{'s' * (threads > 1)})", "goal": f">= {goal}",
                          "value": value, "met": None if value is None else value >= goal})
    return found


def render(report: dict[str, Any]) -> str:
    lines = ["# Decode speed by model size: hf_accel vs llama.cpp", "",
             f"{report['hardware']['cpu']}; batch 1, {report['prompt_len']}-token held-out prompt, "
             f"{report['new_tokens'] - 1} decode steps timed, median of {report['repeats']} interleaved repeats. "
             "int8 / int4: the output layer in int8 too, as llama.cpp's Q8_0 / Q4_0 files hold theirs in Q8_0 / Q6_K. "
             f"llama.cpp: {report['llama_cpp'] or report['llama_cpp_skipped']}. Read bandwidth, the limit's "
             "numerator (the faster of a sum and a matrix-vector product over 1 GiB on huge pages, as the quantized "
             "panels lie, and of the fp32 decodes of models past 1 GiB, which read only weights; an estimate from "
             "below): " +
             ", ".join(f"{b / 1e9:.1f} GB/s at {t} thread{'s' * (int(t) > 1)} (probe "
                       f"{report['bandwidth_probe_bytes_per_s'][t] / 1e9:.1f})"
                       for t, b in report["bandwidth_bytes_per_s"].items()) + ".", ""]
    for size in report["sizes"]:
        lines += [f"## {size['size']} ({size['parameters'] / 1e6:.0f}M parameters)", "",
                  "| weights | tool | threads | tok/s | bytes / token | bandwidth limit (tok/s) | share of limit | "
                  "vs llama.cpp |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in size["rows"]:
            ratio = "-" if row["vs_llama_cpp"] is None else f"{row['vs_llama_cpp']:.2f}x"
            lines.append(f"| {row['format']} | {row['tool']} | {row['threads']} | {row['tokens_per_s']:.2f} | "
                         f"{format_bytes(row['bytes_per_token'])} | {row['limit_tokens_per_s']:.1f} | "
                         f"{row['bandwidth_share']:.0%} | {ratio} |")
        lines.append("")
    lines += target_table(report["targets"])
    lines += ["", f"![tokens/s by model size]({NAME}.png)"]
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """tok/s against parameters per format and tool at one thread, with each format's bandwidth limit (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    sizes = report["sizes"]
    params = [size["parameters"] / 1e6 for size in sizes]
    for index, fmt in enumerate(FORMATS):
        color = f"C{index}"
        for tool, style in (("hf_accel compiled", "o-"), ("llama.cpp", "s--")):
            rates = [next((r["tokens_per_s"] for r in size["rows"] if r["format"] == fmt and r["tool"] == tool
                           and r["threads"] == 1), None) for size in sizes]
            if any(rate is not None for rate in rates):
                axis.plot(params, [r or float("nan") for r in rates], style, color=color, label=f"{fmt} {tool}")
        limits = [next(r["limit_tokens_per_s"] for r in size["rows"] if r["format"] == fmt and r["threads"] == 1)
                  for size in sizes]
        axis.plot(params, limits, ":", color=color, alpha=0.6, label=f"{fmt} bandwidth limit")
    axis.set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="decode tokens / s (batch 1, 1 thread)")
    axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--build-llama-cpp", action="store_true")
    known, rest = options.parse_known_args(argv)
    description = __doc__.split("\n\n")[0] + " Also: --build-llama-cpp."
    report = run_benchmark(rest, description, NAME, ROOT, lambda quick: measure(quick, known.build_llama_cpp), render)
    out = output_root(benchmark_parser(description, NAME).parse_args(rest), ROOT)
    if out is not None:  # docs/ exists: run_benchmark wrote the page there
        plot(report, out / "docs" / f"{NAME}.png")
    return report


if __name__ == "__main__":
    main()
