"""GGUF files kept packed: do `hf_accel.load_gguf`'s Q8_0 / Q4_0 models say what llama.cpp says, and run as fast as
hf_accel's own int8 / int4 weights?

Two measurements, both on files made by llama.cpp's own converter and `llama-quantize` (`llama_cpp_peer.py`; the
benchmark stops with a message where no llama.cpp build is found: `--build-llama-cpp` builds one):
- agreement, on the reference target (trained, so most greedy choices have margins): for held-out prompts, the text
  of 32 greedy tokens from `llama-simple`, from hf_accel and from transformers' own GGUF loader on the same file,
  compared character for character (F32, Q8_0, Q4_0 files);
- speed, on the reference target and the 755M random-weight Llama of bench_size.py: compiled paged decode (batch 1, 1 and 2 threads) of the
  GGUF Q8_0 / Q4_0 files loaded by `load_gguf`, of hf_accel's own int8 and int4 (group 32, the files' granularity)
  quantized from the same float weights, and llama.cpp's `llama-bench` on the same files; interleaved repeats after a
  warm-up round, medians of per-repeat ratios. A Q8_0 file quantizes the untied output layer too (hf_accel's own
  int8 keeps it float); a Q4_0 file stores it as Q6_K, which `load_gguf` dequantizes. The bytes column says what each
  row reads per token.

Regenerate benchmarks/results/bench_gguf.json and docs/bench_gguf.md:
    .venv/bin/python benchmarks/bench_gguf.py
Smoke run (a tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_gguf.py --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import hf_accel
from hf_accel import reference
from hf_accel.bench.output import benchmark_parser, hardware, run_benchmark
from hf_accel.bench.timing import torch_threads
from hf_accel.display import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_size  # noqa: E402
import llama_cpp_peer  # noqa: E402
from bench_weight_quant import reference_folder, reference_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_gguf"
COMMAND = ".venv/bin/python benchmarks/bench_gguf.py"
KINDS = {"Q8_0": "int8 g32", "Q4_0": "int4 g32"}  # GGUF type -> hf_accel's own format of the same granularity
OWN = {"int8 g32": hf_accel.WeightOnlyConfig(bits=8, group_size=32),
       "int4 g32": hf_accel.WeightOnlyConfig(bits=4, group_size=32)}
FULL = {"sizes": (bench_size.FULL.sizes[0], bench_size.FULL.sizes[-1]), "threads": (1, 2), "new_tokens": 17,
        "repeats": 3, "prompts": 16}  # the reference target and the 755M Llama
QUICK = {"sizes": bench_size.QUICK.sizes, "threads": (1,), "new_tokens": 5, "repeats": 1, "prompts": 2}


def gguf_files(llama: llama_cpp_peer.LlamaCpp, folder: Path, scratch: Path) -> dict[str, Path]:
    """Q8_0 and Q4_0 files of the checkpoint `folder`: llama.cpp's converter to f32, then `llama-quantize`."""
    source = llama.convert(folder, scratch, "f32")
    return {kind: llama.quantized(source, kind) for kind in KINDS}


def agreement(llama: llama_cpp_peer.LlamaCpp, plan: dict[str, Any], scratch: Path) -> list[dict[str, Any]]:
    """Per GGUF type (F32 too: llama.cpp's own arithmetic against transformers') and held-out prompt: the greedy text
    of llama-simple, of hf_accel (`load_gguf`) and of transformers' own GGUF loader (dequantized, fp32) on one file."""
    folder, _ = reference_folder(scratch / "reference")
    files = gguf_files(llama, folder, scratch / "reference-gguf")
    files["F32"] = files["Q8_0"].with_name("model-f32.gguf")
    tokenizer = reference_tokenizer()
    rows = reference.held_out_sequences(tokenizer, 24, max_rows=plan["prompts"])
    prompts = [tokenizer.decode(row) for row in rows]
    found = []
    for kind, path in files.items():
        models = {"hf_accel": hf_accel.load_gguf(path),
                  "transformers": AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                       dtype=torch.float32).eval()}
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            texts = {name: tokenizer.decode(model.generate(ids, max_new_tokens=32, do_sample=False,
                                                           pad_token_id=0)[0, ids.shape[1]:], skip_special_tokens=True)
                     for name, model in models.items()}
            texts["llama.cpp"] = llama.greedy_text(path, prompt, 32)
            texts = {name: text.rstrip("\n") for name, text in texts.items()}  # llama-simple ends with a newline
            found.append({"type": kind, "prompt": prompt, **texts,
                          "hf_accel_equals_llama_cpp": texts["hf_accel"] == texts["llama.cpp"],
                          "hf_accel_equals_transformers": texts["hf_accel"] == texts["transformers"],
                          "transformers_equals_llama_cpp": texts["transformers"] == texts["llama.cpp"]})
    return found


def speed(llama: llama_cpp_peer.LlamaCpp, plan: dict[str, Any], size: bench_size.Size,
          scratch: Path) -> dict[str, Any]:
    """Decode tokens/s of `size`'s GGUF files through `load_gguf`, hf_accel's own formats and llama.cpp, per thread
    count."""
    folder = bench_size.model_folder(size, scratch / "model")
    files = gguf_files(llama, folder, scratch / "gguf")
    models = {f"GGUF {kind}": hf_accel.load_gguf(path) for kind, path in files.items()}
    models |= {name: hf_accel.load_model(str(folder), quant=config, dtype=torch.float32)
               for name, config in OWN.items()}
    for model in models.values():
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    sizes = {name: bench_size.bytes_read_per_token(model) for name, model in models.items()}
    prompt = reference.held_out_sequences(reference_tokenizer(), 32, max_rows=1)
    rows = []
    for threads in plan["threads"]:
        with torch_threads(threads):
            rates, theirs = _interleaved(models, files, llama, prompt, plan, threads)
        for name, model_rates in rates.items():
            kind = name.split()[-1] if name.startswith("GGUF") else None
            own = rates.get(KINDS[kind]) if kind else None
            rows.append({"weights": name, "tool": "hf_accel compiled", "threads": threads,
                         "tokens_per_s": statistics.median(model_rates), "bytes_per_token": sizes[name],
                         "vs_own": _ratio(model_rates, own), "vs_llama_cpp": _ratio(model_rates, theirs.get(kind))})
        for kind, their_rates in theirs.items():
            rows.append({"weights": f"GGUF {kind}", "tool": "llama.cpp", "threads": threads,
                         "tokens_per_s": statistics.median(their_rates), "bytes_per_token": None, "vs_own": None,
                         "vs_llama_cpp": 1.0})
    with torch.device("meta"):  # parameters of the float model (a packed Linear's words are not its elements)
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(models["int4 g32"].config).parameters())
    del models
    gc.collect()
    return {"size": size.name, "rows": rows, "parameters": parameters}


def _ratio(ours: list[float], theirs: list[float] | None) -> float | None:
    return None if not theirs else statistics.median(a / b for a, b in zip(ours, theirs))


def _interleaved(models, files, llama, prompt, plan, threads):
    """tokens/s per model and llama.cpp's per GGUF type, per repeat, after a warm-up round (which compiles)."""
    new_tokens = plan["new_tokens"]
    rates: dict[str, list[float]] = {name: [] for name in models}
    theirs: dict[str, list[float]] = {kind: [] for kind in files}
    names = list(models)
    for repeat in range(1 + plan["repeats"]):
        for name in names if repeat % 2 == 0 else names[::-1]:
            seconds = bench_size.decode_seconds(models[name], prompt, new_tokens, "compiled")
            if repeat:
                rates[name].append((new_tokens - 1) / seconds)
            if repeat and name.startswith("GGUF"):
                kind = name.split()[-1]
                theirs[kind].append(llama.decode_tokens_per_second(files[kind], threads, new_tokens - 1, 1))
        print(f"threads {threads}: repeat {repeat}/{plan['repeats']} done", flush=True)
    return rates, theirs


def measure(quick: bool, build_llama_cpp: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    llama = llama_cpp_peer.find() or (llama_cpp_peer.build() if build_llama_cpp else None)
    if llama is None:
        raise SystemExit(f"bench_gguf compares with llama.cpp and found no build under {llama_cpp_peer.HOME}: "
                         "run with --build-llama-cpp")
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        agree = agreement(llama, plan, scratch)
        timed = [speed(llama, plan, size, scratch / size.name) for size in plan["sizes"]]
    return {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(), "llama_cpp": llama.version,
            "new_tokens": plan["new_tokens"], "repeats": plan["repeats"], "agreement": agree, "speed": timed,
            "total_seconds": time.perf_counter() - started}


def render(report: dict[str, Any]) -> str:
    agree = report["agreement"]
    lines = ["# GGUF files kept packed: agreement with llama.cpp and speed", "",
             f"{report['hardware']['cpu']}; llama.cpp {report['llama_cpp']} (its converter, `llama-quantize`, "
             "`llama-simple`, `llama-bench`).", "", "## Greedy text on the reference target's GGUF files", "",
             "Each cell: prompts (of the row's count) whose 32 greedy tokens read the same text in both. llama.cpp "
             "keeps its KV cache in fp16 and quantizes activations for its quantized matmuls (the tied output layer "
             "included); transformers' loader dequantizes every tensor to fp32; hf_accel keeps the Q8_0 / Q4_0 codes "
             "and quantizes activations per 32 inputs. The F32 row is the baseline: the same weights, only the tools' "
             "arithmetic differs.", "",
             "| file | prompts | hf_accel = llama.cpp | hf_accel = transformers | transformers = llama.cpp |",
             "| --- | --- | --- | --- | --- |"]
    for kind in ("F32", *KINDS):
        rows = [row for row in agree if row["type"] == kind]
        counts = [sum(row[key] for row in rows) for key in
                  ("hf_accel_equals_llama_cpp", "hf_accel_equals_transformers", "transformers_equals_llama_cpp")]
        lines.append(f"| {kind} | {len(rows)} | " + " | ".join(map(str, counts)) + " |")
    for timed in report["speed"]:
        lines += _speed_table(timed, report)
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def _speed_table(timed: dict[str, Any], report: dict[str, Any]) -> list[str]:
    lines = ["", f"## Decode speed, {timed['size']} ({timed['parameters'] / 1e6:.1f}M parameters), compiled paged, "
             f"batch 1, {report['new_tokens'] - 1} steps, median of {report['repeats']} interleaved repeats", "",
             "| weights | tool | threads | tok/s | bytes / token | vs hf_accel's own format | vs llama.cpp |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in timed["rows"]:
        own = "-" if row["vs_own"] is None else f"{row['vs_own']:.2f}x"
        theirs = "-" if row["vs_llama_cpp"] is None else f"{row['vs_llama_cpp']:.2f}x"
        size = "-" if row["bytes_per_token"] is None else format_bytes(row["bytes_per_token"])
        lines.append(f"| {row['weights']} | {row['tool']} | {row['threads']} | {row['tokens_per_s']:.2f} | {size} | "
                     f"{own} | {theirs} |")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--build-llama-cpp", action="store_true")
    known, rest = options.parse_known_args(argv)
    description = __doc__.split("\n\n")[0] + " Also: --build-llama-cpp."
    benchmark_parser(description, NAME)  # the common options (--quick, --out, --threads)
    return run_benchmark(rest, description, NAME, ROOT, lambda quick: measure(quick, known.build_llama_cpp), render)


if __name__ == "__main__":
    main()
