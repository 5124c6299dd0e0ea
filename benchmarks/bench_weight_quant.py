"""Weight quantization on CPU: weight bytes, decode tok/s and held-out perplexity of fp32 / bf16, hf_accel int8 /
int4, bitsandbytes int8 / nf4 and optimum-quanto int8 / int4; each model's variants load from one checkpoint into one
process.

Two models, because where decode time goes decides what weight quantization can win:
- the reference target (`hf_accel.reference`; a random-weight Llama of its shape when its assets are missing), 8.9M
  parameters: decode is bound by per-layer overhead, not by reading weights; speed, weight bytes and perplexity.
- a random-weight Llama of 220M parameters (hidden 1536, 8 layers, the reference vocabulary): decode reads every
  weight from memory, the regime weight-only quantization is for; speed and weight bytes only (the perplexity of
  random weights means nothing, so none is measured). Its variants are loaded after the reference ones are freed.
Speed: batch 1, a held-out prompt, greedy; every variant timed once per repeat, interleaved (order alternating), after
a warm-up; decode time = from the first new token's arrival to the last's (a streamer stamps each), so N new tokens
time N - 1 decode steps and never a prefill; ratios are medians of per-repeat ratios.

Regenerate benchmarks/results/bench_weight_quant.json and docs/bench_weight_quant.md (+ docs/weight-quantization.md):
    .venv/bin/python benchmarks/bench_weight_quant.py
Smoke run (tiny settings, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_weight_quant.py --quick
"""

from __future__ import annotations

import gc
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

import hf_accel
from hf_accel import bench, reference
from hf_accel.bench.output import benchmark_parser, output_root, write_results
from hf_accel.display import format_bytes, format_table
from hf_accel.reference import evaluate
from hf_accel.training.reference_presets import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_weight_quant"
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


@dataclass(frozen=True, slots=True)
class Scenario:
    prompt_len: int
    new_tokens: int
    repeats: int  # measured repeats after one warm-up round
    ppl_rows: int = 0  # held-out rows for perplexity; 0: none (random weights)
    seq_len: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    reference: Scenario
    large: Scenario
    large_hidden: int  # the large random Llama: `bench.random_llama(large_hidden, large_layers, vocab)`
    large_layers: int


# large: 10 new tokens, as quanto decodes ~1 token/s at 220M parameters on one thread and the run must stay ~5 min
FULL = Plan(Scenario(64, 32, repeats=5, ppl_rows=16, seq_len=256), Scenario(32, 10, repeats=4),
            large_hidden=1536, large_layers=8)
QUICK = Plan(Scenario(16, 4, repeats=1, ppl_rows=2, seq_len=32), Scenario(16, 4, repeats=1),
             large_hidden=192, large_layers=2)


def reference_folder(scratch: Path) -> tuple[Path, str]:
    """The reference target's checkpoint, or a random-weight Llama of its shape saved to `scratch`; and what it is."""
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


def large_folder(scratch: Path, plan: Plan) -> tuple[Path, str]:
    """A random-weight Llama big enough that decode reads its weights from memory, saved to `scratch`."""
    model = bench.random_llama(plan.large_hidden, plan.large_layers, vocab_size=len(reference_tokenizer()))
    model.save_pretrained(scratch)
    del model
    return scratch, "random-weight Llama (bench.random_llama): weight-bandwidth-bound decode; perplexity not " \
                    "measured (that of random weights means nothing)"


def reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    for folder in (reference.ASSETS_DIR / "target", reference.ASSETS_DIR / "tokenizer"):
        if (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raise FileNotFoundError(f"no tokenizer in {reference.ASSETS_DIR}; run: {reference.TRAIN_COMMAND}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor in the state dict, tied tensors once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


class _TokenClock(BaseStreamer):
    """Stamps the time each chunk reaches the streamer: the prompt first, then every new token (batch 1)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """Nothing: the last new token was stamped when it arrived."""


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds from the first new token to the last: `new_tokens - 1` decode steps, the prefill excluded.

    Timing the decode steps themselves (not time(N) - time(1) of two generate calls) keeps the figure positive when
    the machine's noise is larger than a short run.
    """
    clock = _TokenClock()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    new_token_stamps = clock.stamps[1:]  # stamps[0]: the prompt
    if len(new_token_stamps) != new_tokens:
        raise RuntimeError(f"generate streamed {len(new_token_stamps)} new tokens, expected {new_tokens}")
    return new_token_stamps[-1] - new_token_stamps[0]


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


def load_variants(folder: Path) -> dict[str, torch.nn.Module]:
    models = {v.name: hf_accel.load_model(str(folder), quant=v.quant, dtype=v.dtype, device_map="cpu").eval()
              for v in VARIANTS}
    for model in models.values():
        model.generation_config.eos_token_id = None  # time exactly N tokens
        model.generation_config.pad_token_id = 0
    return models


def measure(folder: Path, description: str, scenario: Scenario) -> dict[str, Any]:
    """One model's report: every variant's weight bytes, decode speed and (when `scenario.ppl_rows`) perplexity."""
    models = load_variants(folder)
    tokenizer = reference_tokenizer()
    prompt = reference.held_out_sequences(tokenizer, scenario.prompt_len, max_rows=1)
    perplexity: dict[str, float | None] = {name: None for name in models}
    if scenario.ppl_rows:
        rows = reference.held_out_sequences(tokenizer, scenario.seq_len, max_rows=scenario.ppl_rows)
        perplexity = {name: evaluate.perplexity(model, rows, batch_size=4) for name, model in models.items()}
    seconds = measure_speed(models, prompt, scenario.new_tokens, scenario.repeats)
    results = [{
        "name": v.name, "preset": v.quant, "dtype": str(v.dtype), "weight_bytes": weight_bytes(models[v.name]),
        "decode_tokens_per_s": (scenario.new_tokens - 1) / statistics.median(seconds[v.name]),
        "speed_vs_fp32": paired_ratio(seconds["fp32"], seconds[v.name]), "perplexity": perplexity[v.name],
        "decode_seconds": seconds[v.name]} for v in VARIANTS]
    return {"model": description, "model_summary": bench.describe_model(models["fp32"]),
            "num_params": sum(p.numel() for p in models["fp32"].parameters()),
            "settings": asdict(scenario) | {"batch_size": 1},
            "int8_vs_bnb_int8": paired_ratio(seconds["bnb int8"], seconds["hf_accel int8"]), "results": results}


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    start = time.perf_counter()
    report: dict[str, Any] = {"command": COMMAND + (" --quick" if quick else ""), "hardware": bench.hardware()}
    with tempfile.TemporaryDirectory() as scratch:
        report["reference"] = measure(*reference_folder(Path(scratch)), plan.reference)
    gc.collect()  # the reference variants are gone before the large ones load
    with tempfile.TemporaryDirectory() as scratch:
        report["large"] = measure(*large_folder(Path(scratch), plan), plan.large)
    report["runtime_s"] = time.perf_counter() - start
    return report


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    """Each issue target, per model where it applies: the speed targets on both, perplexity on the reference."""
    rows = []
    for key, label in (("reference", "reference target"), ("large", "random Llama")):
        scenario = report[key]
        label = f"{label}, {scenario['num_params'] / 1e6:.3g}M params"
        int8 = next(r for r in scenario["results"] if r["name"] == "hf_accel int8")
        rows += [[f"hf_accel int8 decode >= 1.5x fp32 ({label})", f"{int8['speed_vs_fp32']:.2f}x",
                  _yes(int8["speed_vs_fp32"] >= TARGETS["int8_vs_fp32"])],
                 [f"hf_accel int8 decode >= 3x bitsandbytes int8 ({label})", f"{scenario['int8_vs_bnb_int8']:.2f}x",
                  _yes(scenario["int8_vs_bnb_int8"] >= TARGETS["int8_vs_bnb_int8"])]]
    by_name = {r["name"]: r for r in report["reference"]["results"]}
    base = by_name["fp32"]["perplexity"]
    rise8, rise4 = by_name["hf_accel int8"]["perplexity"] / base - 1, by_name["hf_accel int4"]["perplexity"] / base - 1
    return rows + [
        ["hf_accel int8 perplexity increase <= 1% (reference target)", f"{100 * rise8:+.2f}%",
         _yes(rise8 <= TARGETS["int8_ppl"])],
        ["hf_accel int4 perplexity increase <= 5% (reference target)", f"{100 * rise4:+.2f}%",
         _yes(rise4 <= TARGETS["int4_ppl"])],
    ]


def results_table(scenario: dict[str, Any]) -> str:
    """One row per variant; perplexity columns only where it was measured."""
    results, base = scenario["results"], scenario["results"][0]
    with_ppl = base["perplexity"] is not None
    rows = []
    for r in results:
        row = [r["name"], format_bytes(r["weight_bytes"], decimals=1),
               f"{r['weight_bytes'] / base['weight_bytes']:.2f}x", f"{r['decode_tokens_per_s']:.1f}", f"{r['speed_vs_fp32']:.2f}x"]
        if with_ppl:
            row += [f"{r['perplexity']:.3f}", f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%"]
        rows.append(row)
    headers = ["variant", "weight bytes", "x fp32", "decode tok/s", "speed x fp32 (paired)"]
    return format_table(headers + (["perplexity", "vs fp32"] if with_ppl else []), rows, markdown=True)


def _scenario_lines(title: str, scenario: dict[str, Any], what: str) -> list[str]:
    settings = scenario["settings"]
    lines = [f"## {title}", "", f"- model: {scenario['model']}; {scenario['model_summary']}",
             f"- decode: batch 1, a {settings['prompt_len']}-token held-out prompt, {settings['new_tokens']} new "
             f"tokens, greedy, median of {settings['repeats']} interleaved repeats after a warm-up"]
    if settings["ppl_rows"]:
        lines.append(f"- perplexity: {settings['ppl_rows']} held-out rows of {settings['seq_len']} tokens")
    return lines + [f"- {what}", "", results_table(scenario), ""]


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    return "\n".join([
        "# Weight quantization benchmark", "",
        f"Regenerate with `{report['command']}` ({report['runtime_s']:.0f} s here).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; shared with a training job, so compare ratios, not absolutes", "",
        "## Targets", "", format_table(["target", "measured", "met"], target_rows(report), True), "",
        *_scenario_lines("Reference target (small: per-layer overhead bounds decode)", report["reference"],
                         "the weights fit in the CPU's caches: decode time is per-layer work (Python, small "
                         "kernels), which smaller weights do not shrink"),
        *_scenario_lines("Large random Llama (weight-bandwidth-bound decode)", report["large"],
                         "no perplexity: the model's weights are random"),
        "Weight bytes: every tensor of the state dict (embeddings, norms and the unquantized lm_head included).",
    ]) + "\n"


def headline(report: dict[str, Any]) -> str:
    """The text between the markers in docs/weight-quantization.md."""
    return "\n\n".join([
        format_table(["target", "measured", "met"], target_rows(report), True),
        f"Reference target ({report['reference']['model_summary']}):", results_table(report["reference"]),
        f"Large random Llama ({report['large']['model_summary']}), speed and bytes only (random weights):",
        results_table(report["large"]),
        f"From `{report['command']}`; details: [bench_weight_quant.md](bench_weight_quant.md).",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = benchmark_parser(__doc__.split("\n\n")[0], NAME).parse_args(argv)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a warning per int8 matmul otherwise
    with bench.torch_threads(args.threads):
        report = run(QUICK if args.quick else FULL, quick=args.quick)
    text = markdown(report)
    print("\n" + text)
    out = output_root(args, ROOT)
    if out is not None:
        write_results(out, NAME, report, text, {"docs/weight-quantization.md": headline(report)})
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
