"""Weight quantization on CPU: weight bytes, decode tok/s and held-out perplexity of fp32 / bf16, hf_accel int8 /
int4, bitsandbytes int8 / nf4 and optimum-quanto int8 / int4, all loaded from one checkpoint into one process.

Model: the reference target (`hf_accel.reference.load("target")`) when its assets exist, else a random-weight Llama
of the same shape (then perplexity says nothing about quality). Speed: batch 1, a held-out prompt, greedy; every
variant timed once per repeat, interleaved (order alternating), after a warm-up; decode time = time(N new tokens) -
time(1 new token); ratios are medians of per-repeat ratios. Perplexity: held-out corpus rows (hf_accel.reference).

Regenerate benchmarks/results/bench_weight_quant.json and docs/bench_weight_quant.md (+ docs/weight-quantization.md):
    .venv/bin/python benchmarks/bench_weight_quant.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hf_accel
from hf_accel import bench, reference
from hf_accel.reference import corpus, evaluate
from hf_accel.reference.presets import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_weight_quant.py"
TARGETS = {"int8_vs_fp32": 1.5, "int8_vs_bnb_int8": 3.0, "int8_ppl": 0.01, "int4_ppl": 0.05}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    quant: str | None  # preset name (hf_accel.list_quantization_presets), None for plain float
    dtype: torch.dtype


VARIANTS = (
    Variant("fp32", None, torch.float32), Variant("bf16", None, torch.bfloat16),
    Variant("hf_accel int8", "int8", torch.float32), Variant("hf_accel int4", "int4", torch.float32),
    Variant("bnb int8", "bnb-int8", torch.float32), Variant("bnb nf4", "nf4", torch.float32),
    Variant("quanto int8", "quanto-int8", torch.float32), Variant("quanto int4", "quanto-int4", torch.float32),
)


def model_folder(scratch: Path) -> tuple[Path, str]:
    """The checkpoint every variant loads, and what it is."""
    folder = reference.ASSETS_DIR / "target"
    if (folder / "config.json").is_file():
        return folder, "hf_accel reference target (trained; weights stored in bf16)"
    tokenizer = reference_tokenizer()
    config = MODEL_PRESETS["target"].to_config(len(tokenizer), tokenizer.eos_token_id or 0)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(config).save_pretrained(scratch)
    return scratch, "random-weight Llama of the reference target's shape (reference assets missing): perplexity " \
                    "is that of random weights, only its relative change means anything"


def reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    for folder in (reference.ASSETS_DIR / "target", reference.ASSETS_DIR / "tokenizer"):
        if (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raise FileNotFoundError(f"no tokenizer in {reference.ASSETS_DIR}; run: {reference.TRAIN_COMMAND}")


def held_out_rows(num_rows: int, seq_len: int) -> torch.Tensor:
    """`[num_rows, seq_len]` token ids of the held-out split, packed."""
    tokenizer = reference_tokenizer()
    ids = corpus.tokenize(corpus.load_split("held_out").texts, tokenizer)
    rows = corpus.pack_sequences(ids, tokenizer.eos_token_id or 0, seq_len)
    return rows[:num_rows]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor in the state dict, tied tensors once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start
    return timed(new_tokens) - timed(1)


def measure_speed(models: dict[str, torch.nn.Module], prompt: torch.Tensor, new_tokens: int,
                  repeats: int) -> dict[str, list[float]]:
    """Decode seconds per variant per repeat, interleaved with alternating order, after one warm-up round."""
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(1 + repeats):
        order = list(models) if repeat % 2 == 0 else list(reversed(models))
        for name in order:
            elapsed = decode_seconds(models[name], prompt, new_tokens)
            if repeat:
                seconds[name].append(elapsed)
        print(f"repeat {repeat}/{repeats} done", flush=True)
    return seconds


def paired_ratio(base: list[float], other: list[float]) -> float:
    """Median over repeats of base time / other time: how many times faster `other` is."""
    return statistics.median(b / o for b, o in zip(base, other))


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder, description = model_folder(Path(scratch))
        models = {v.name: hf_accel.load_model(str(folder), quant=v.quant, dtype=v.dtype, device_map="cpu").eval()
                  for v in VARIANTS}
    rows = held_out_rows(args.ppl_rows, args.seq_len)
    prompt = rows[:1, : args.prompt_len]
    for model in models.values():
        model.generation_config.eos_token_id = None  # time exactly N tokens
        model.generation_config.pad_token_id = 0
    perplexity = {name: evaluate.perplexity(model, rows, batch_size=4) for name, model in models.items()}
    seconds = measure_speed(models, prompt, args.new_tokens, args.repeats)
    results = [{
        "name": v.name, "preset": v.quant, "dtype": str(v.dtype), "weight_bytes": weight_bytes(models[v.name]),
        "decode_tokens_per_s": (args.new_tokens - 1) / statistics.median(seconds[v.name]),
        "speed_vs_fp32": paired_ratio(seconds["fp32"], seconds[v.name]), "perplexity": perplexity[v.name],
        "decode_seconds": seconds[v.name]} for v in VARIANTS]
    return {"command": COMMAND, "hardware": bench.hardware(), "model": description,
            "model_summary": bench.describe_model(models["fp32"]), "settings": vars(args) | {"batch_size": 1},
            "int8_vs_bnb_int8": paired_ratio(seconds["bnb int8"], seconds["hf_accel int8"]),
            "results": results, "runtime_s": time.perf_counter() - start}


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    by_name = {r["name"]: r for r in report["results"]}
    base_ppl = by_name["fp32"]["perplexity"]
    int8, int4 = by_name["hf_accel int8"], by_name["hf_accel int4"]
    rise8, rise4 = int8["perplexity"] / base_ppl - 1, int4["perplexity"] / base_ppl - 1
    return [
        ["hf_accel int8 decode >= 1.5x fp32", f"{int8['speed_vs_fp32']:.2f}x",
         _yes(int8["speed_vs_fp32"] >= TARGETS["int8_vs_fp32"])],
        ["hf_accel int8 decode >= 3x bitsandbytes int8", f"{report['int8_vs_bnb_int8']:.2f}x",
         _yes(report["int8_vs_bnb_int8"] >= TARGETS["int8_vs_bnb_int8"])],
        ["hf_accel int8 perplexity increase <= 1%", f"{100 * rise8:+.2f}%", _yes(rise8 <= TARGETS["int8_ppl"])],
        ["hf_accel int4 perplexity increase <= 5%", f"{100 * rise4:+.2f}%", _yes(rise4 <= TARGETS["int4_ppl"])],
    ]


def results_table(report: dict[str, Any]) -> str:
    base = report["results"][0]
    rows = [[r["name"], bench.format_bytes(r["weight_bytes"]), f"{r['weight_bytes'] / base['weight_bytes']:.2f}x",
             f"{r['decode_tokens_per_s']:.1f}", f"{r['speed_vs_fp32']:.2f}x", f"{r['perplexity']:.3f}",
             f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%"] for r in report["results"]]
    headers = ["variant", "weight bytes", "x fp32", "decode tok/s", "speed x fp32 (paired)", "perplexity",
               "vs fp32"]
    return bench.format_table(headers, rows, markdown=True)


def markdown(report: dict[str, Any]) -> str:
    hw, settings = report["hardware"], report["settings"]
    return "\n".join([
        "# Weight quantization benchmark", "",
        f"Regenerate with `{COMMAND}` ({report['runtime_s']:.0f} s here).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; shared with a training job, so compare ratios, not absolutes",
        f"- model: {report['model']}; {report['model_summary']}",
        f"- decode: batch 1, a {settings['prompt_len']}-token held-out prompt, {settings['new_tokens']} new tokens, "
        f"greedy, median of {settings['repeats']} interleaved repeats after a warm-up",
        f"- perplexity: {settings['ppl_rows']} held-out rows of {settings['seq_len']} tokens",
        "", "## Targets", "", bench.format_table(["target", "measured", "met"], target_rows(report), True),
        "", "## All variants", "", results_table(report), "",
        "Weight bytes: every tensor of the state dict (embeddings, norms and the unquantized lm_head included).",
    ]) + "\n"


def update_marked_section(path: Path, text: str) -> None:
    start, end = "<!-- bench_weight_quant:start -->\n", "<!-- bench_weight_quant:end -->"
    doc = path.read_text() if path.exists() else ""
    if start in doc and end in doc:
        head, rest = doc.split(start, 1)
        path.write_text(head + start + text + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable when shared)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--ppl-rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write results and docs under")
    args = parser.parse_args(argv)
    out = args.out
    del args.out
    with bench.torch_threads(args.threads):
        report = run(args)
    text = markdown(report)
    print("\n" + text)
    (out / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    (out / "docs").mkdir(parents=True, exist_ok=True)
    (out / "benchmarks/results/bench_weight_quant.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "docs/bench_weight_quant.md").write_text(text)
    update_marked_section(out / "docs/weight-quantization.md",
                          bench.format_table(["target", "measured", "met"], target_rows(report), True) + "\n\n"
                          + results_table(report) + f"\n\nFrom `{COMMAND}`; details: [bench_weight_quant.md]"
                          "(bench_weight_quant.md).")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
