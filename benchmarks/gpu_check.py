"""The GPU check: what hf_accel's engine does on a CUDA device, for the day one is lent (never in CI).

On CUDA: the reference target in fp32 and bf16, the engine with CUDA graphs for its decode steps (the default) against
the same engine with `enforce_eager=True`: greedy tokens of held-out requests compared with sequential `generate`,
graph capture seconds, and decode-step time at 1, 8 and 32 sequences (interleaved, after a warm-up) with the speed-up
of the graphs; compiled `generate` (`cache_implementation="paged"` + `compile_config`, whose default
`mode="reduce-overhead"` replays one captured CUDA graph of the compiled step per call) against eager `DynamicCache`
and transformers' `StaticCache` + `compile_config`: identical tokens, first-call (compile) seconds and milliseconds
per token at batch 1 and 8; and, in fp32, compiled speculative `generate` against plain greedy (`--speculative`:
`draft_generate` with the reference draft by default; `ngram_generate`, `eagle_generate` with the reference EAGLE head,
chain or EAGLE-2 tree); and, in fp32, LoRA adapters in the engine (`--sections lora`, needs peft): 3 random peft
adapters and the base in one mixed batch, greedy tokens against each adapter's merged model, and decode-step time of
the LoRA engine (8 sequences over the adapters) against the base engine; and hf_accel's weight-only int8 / int4 at
~1B parameters against bf16 (`--sections weights`, `gpu_weights.py`). Without CUDA it says so and measures
nothing, unless `--device cpu` asks for the same comparison on the CPU (compiled step against eager: the script's
own check, used by its test). `--dtype fp32` or `bf16`, `--sections` (engine, generate, speculative, lora, weights) and
`--batches` check a part (shorter runs, for a device that limits a command's time); each side's first-call seconds
are printed as it finishes.

    .venv/bin/python benchmarks/gpu_check.py            (writes benchmarks/results/gpu_check.json, docs/gpu_check.md)
    .venv/bin/python benchmarks/gpu_check.py --dtype fp32 --sections speculative --speculative ngram,eagle,eagle_tree
    .venv/bin/python benchmarks/gpu_check.py --quick --device cpu
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from transformers import CompileConfig, StaticCache

from hf_accel import (EagleTree, Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, draft_generate,
                      eagle_generate, ngram_generate, reference)
from hf_accel.bench import torch_threads
from hf_accel.bench.output import benchmark_parser, hardware, output_root, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "gpu_check"
COMMAND = ".venv/bin/python benchmarks/gpu_check.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decoding_engine(model, prompts: list[list[int]], enforce_eager: bool, steps: int) -> Engine:
    """An engine with the prompts prefilled and decoding (one request each, `steps` + 8 tokens to go)."""
    engine = Engine(model, config=EngineConfig(max_num_seqs=max(len(prompts), 2), enforce_eager=enforce_eager))
    return start_decoding(engine, prompts, steps)


def start_decoding(engine: Engine, prompts: list[list[int]], steps: int,
                   adapters: list[LoRARequest] | None = None) -> Engine:
    """`engine` with the prompts prefilled and decoding, as `decoding_engine` leaves its own; with `adapters`,
    request `i` runs with adapter `i % len(adapters)`."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
                           lora_request=None if adapters is None else adapters[i % len(adapters)])
    engine.step()
    while engine.core.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.core.scheduler.running):
        engine.step()
    return engine


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Sequential greedy `generate` of one prompt (the reference every engine output is compared with)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def step_ms(engine: Engine, steps: int, device: torch.device) -> float:
    """Milliseconds per decode step over `steps` steps (the device synchronised before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps * 1e3


def check_dtype(model, tokenizer, device: torch.device, quick: bool) -> dict[str, Any]:
    """Identical tokens and step times, default engine against eager, for one model."""
    rows = reference.held_out_sequences(tokenizer, 64, max_rows=32)
    prompts = [row[: 8 + 7 * i].tolist() for i, row in enumerate(rows[: 4 if quick else 8])]
    params = SamplingParams(max_tokens=8 if quick else 32, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    default = Engine(model, config=EngineConfig(max_num_seqs=8))
    start_seconds = time.perf_counter() - started
    outputs = [out.outputs[0].token_ids for out in default.generate(prompts, params)]
    expected = [greedy(model, prompt, params.max_tokens) for prompt in prompts]
    forward = default.core.runner.forward
    result: dict[str, Any] = {
        "graphs": forward.graphs is not None, "compiled": forward.compiled, "start_seconds": round(start_seconds, 2),
        "identical": sum(a == b for a, b in zip(outputs, expected)), "requests": len(prompts), "steps": {}}
    steps = 4 if quick else 32
    for num_seqs in ((1, 4) if quick else (1, 8, 32)):
        batch = [row[:48].tolist() for row in rows[:num_seqs]]
        engines = {"default": decoding_engine(model, batch, False, 3 * steps),
                   "eager": decoding_engine(model, batch, True, 3 * steps)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(3):  # interleaved
            for name, engine in engines.items():
                times[name].append(step_ms(engine, steps, device))
        default_ms, eager_ms = statistics.median(times["default"]), statistics.median(times["eager"])
        result["steps"][str(num_seqs)] = {"default_ms": round(default_ms, 3), "eager_ms": round(eager_ms, 3),
                                          "speedup": round(eager_ms / default_ms, 3)}
    return result


def generate_ms(model, inputs: dict[str, torch.Tensor], new_tokens: int, device: torch.device,
                **kwargs) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy `generate` of exactly `new_tokens` (EOS off; the device synchronised) and its output."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, out


def check_generate(model, tokenizer, device: torch.device, quick: bool,
                   batches: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    """Compiled paged `generate` against eager DynamicCache and StaticCache + compile, batch 1 and 8."""
    config = compile_config()
    rows = reference.held_out_sequences(tokenizer, 64, max_rows=8)
    sides = {"dynamic": {}, "paged + compile": {"cache_implementation": "paged", "compile_config": config},
             "static + compile": {"compile_config": config, "past_key_values": None}}
    return {str(batch): compare_sides(model, rows[:batch], 8 if quick else 64, device, sides)
            for batch in ((2,) if quick else batches)}


SPECULATIVE = ("draft", "ngram", "eagle", "eagle_tree")


def check_speculative(model, tokenizer, device: torch.device, quick: bool,
                      methods: tuple[str, ...] = ("draft",)) -> dict[str, Any]:
    """Compiled speculative `generate` (each of `methods`: `draft_generate` with the reference draft,
    `ngram_generate`, `eagle_generate` with the reference EAGLE head, chain or EAGLE-2 tree; drafting and verify
    forwards compiled, captured in CUDA graphs on a GPU but for the trees) against plain greedy `generate`, eager and
    compiled (the paged cache), batch 1."""
    rows = reference.held_out_sequences(tokenizer, 64, max_rows=1)
    config = compile_config()
    sides = {"plain": {}, "plain + compile": {"cache_implementation": "paged", "compile_config": config}}
    if "draft" in methods:
        draft = reference.load("draft", dtype=model.dtype)[0].to(device)
        sides["draft + compile"] = {"custom_generate": draft_generate, "draft_model": draft, "compile_config": config}
    if "ngram" in methods:
        sides["ngram + compile"] = {"custom_generate": ngram_generate, "compile_config": config}
    if "eagle" in methods or "eagle_tree" in methods:
        head = reference.load_head("eagle", model=model, dtype=model.dtype).to(device)
        eagle = {"custom_generate": eagle_generate, "eagle_head": head, "compile_config": config}
        if "eagle" in methods:
            sides["eagle + compile"] = eagle
        if "eagle_tree" in methods:
            sides["eagle tree + compile"] = {**eagle, "eagle_tree": EagleTree()}
    return compare_sides(model, rows, 8 if quick else 64, device, sides)


def compile_config() -> CompileConfig:
    config = CompileConfig()  # mode="reduce-overhead": CUDA graphs on a GPU
    config._compile_all_devices = True  # lets transformers' own loop compile StaticCache off CUDA too
    return config


def compare_sides(model, prompts: torch.Tensor, new_tokens: int, device: torch.device,
                  sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy `generate` of `prompts` `[rows, tokens]` with each side's kwargs: whether every output equals the first
    side's, the first call's seconds (compilation) and the median milliseconds per token of three interleaved calls."""
    inputs = {"input_ids": prompts.to(device), "attention_mask": torch.ones_like(prompts).to(device)}
    first, outputs, errors = {}, {}, {}
    for name, kwargs in sides.items():
        try:  # a side that fails is reported, not fatal: the other rows still measure
            first[name], outputs[name] = generate_ms(model, inputs, new_tokens, device,
                                                     **fresh_kwargs(model, kwargs, new_tokens))
        except Exception as error:  # noqa: BLE001 (the check reports any failure)
            errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
        print(f"  {name}: first call {f'{first[name]:.1f} s' if name in first else errors[name]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in outputs}
    for _ in range(3):
        for name in outputs:
            times[name].append(generate_ms(model, inputs, new_tokens, device,
                                           **fresh_kwargs(model, sides[name], new_tokens))[0])
    reference_side = next(iter(sides))
    same = ({name: torch.equal(out, outputs[reference_side]) for name, out in outputs.items()}
            if reference_side in outputs else {})
    return {"identical": not errors and len(same) == len(sides) and all(same.values()), "identical_sides": same,
            "first_call_s": {name: round(t, 1) for name, t in first.items()},
            "ms_per_token": {name: round(statistics.median(t) / new_tokens * 1e3, 3) for name, t in times.items()},
            "errors": errors}


def fresh_kwargs(model, kwargs: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """`kwargs` for one generate call, with a new StaticCache where the side passes one."""
    fresh = dict(kwargs)
    if "past_key_values" in fresh:
        fresh["past_key_values"] = StaticCache(config=model.config, max_cache_len=64 + new_tokens)
    return fresh


SECTIONS = ("engine", "generate", "speculative", "lora", "weights")


def random_adapters(model, scratch: str, count: int = 3) -> tuple[list[LoRARequest], list]:
    """`count` random rank-8 peft adapters on every projection of `model`, saved under `scratch`, and each one's
    merged model."""
    import copy

    from peft import LoraConfig, get_peft_model

    adapters, merged = [], []
    for i in range(count):
        torch.manual_seed(i)
        tuned = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                                  target_modules="all-linear"))
        with torch.no_grad():
            for name, param in tuned.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.1)
        tuned.save_pretrained(f"{scratch}/adapter{i}")
        adapters.append(LoRARequest(f"adapter{i}", i + 1, f"{scratch}/adapter{i}"))
        merged.append(tuned.merge_and_unload().eval())
    return adapters, merged


def check_lora(model, tokenizer, device: torch.device, quick: bool) -> dict[str, Any]:
    """3 random rank-8 peft adapters on every projection: a batch mixing them with the base against each adapter's
    merged model's sequential `generate`, and decode-step ms of a LoRA engine (8 sequences over the adapters)
    against the base engine (the default engine each: CUDA graphs where they apply)."""
    import copy
    import tempfile

    rows = reference.held_out_sequences(tokenizer, 64, max_rows=16)
    prompts = [row[: 8 + 5 * i].tolist() for i, row in enumerate(rows[:4])]
    params = SamplingParams(max_tokens=8 if quick else 24, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as scratch:
        adapters, merged = random_adapters(model, scratch)
        jobs = [(prompt, k) for prompt in prompts for k in (None, 0, 1, 2)]
        engine = Engine(copy.deepcopy(model), config=EngineConfig(max_num_seqs=16), lora=LoRAConfig(max_loras=3))
        outs = engine.generate([p for p, _ in jobs], params,
                               lora_request=[None if k is None else adapters[k] for _, k in jobs])
        expected = [greedy(model if k is None else merged[k], p, params.max_tokens) for p, k in jobs]
        result: dict[str, Any] = {"identical": sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected)),
                                  "requests": len(jobs), "compiled": engine.core.runner.forward.compiled}
        steps, batch = (4 if quick else 32), [row[:48].tolist() for row in rows[:8]]
        engines = {"base": decoding_engine(model, batch, False, 3 * steps),
                   "lora": start_decoding(engine, batch, 3 * steps, adapters)}  # (one compile fewer)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(3):  # interleaved
            for name, decoding in engines.items():
                times[name].append(step_ms(decoding, steps, device))
    base_ms, lora_ms = statistics.median(times["base"]), statistics.median(times["lora"])
    result.update(base_ms=round(base_ms, 3), lora_ms=round(lora_ms, 3), lora_vs_base=round(base_ms / lora_ms, 3))
    return result


def measure(device_name: str, quick: bool, dtypes: tuple[str, ...] = tuple(DTYPES),
            sections: tuple[str, ...] = SECTIONS, methods: tuple[str, ...] = ("draft",),
            batches: tuple[int, ...] = (1, 8)) -> dict[str, Any] | None:
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    report: dict[str, Any] = {"benchmark": NAME, "command": COMMAND, "hardware": hardware(), "device": str(device),
                              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                              "results": {}}
    reference_sections = set(sections) - {"weights"}  # the weights section builds its own model
    for name in (("fp32",) if quick else dtypes) if reference_sections else ():
        model, tokenizer = reference.load("target", dtype=DTYPES[name])
        model.to(device)
        result = report["results"][name] = {}
        if "engine" in sections:
            result.update(check_dtype(model, tokenizer, device, quick))
        if "generate" in sections:
            result["generate"] = check_generate(model, tokenizer, device, quick, batches)
        if "speculative" in sections and name == "fp32":
            result["speculative"] = check_speculative(model, tokenizer, device, quick, methods)
        if "lora" in sections and name == "fp32":
            result["lora"] = check_lora(model, tokenizer, device, quick)
    if "weights" in sections:
        report["weights"] = gpu_weights.check_weights(device, quick, compare_sides, compile_config)
    return report


def render(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = [f"hf_accel on {report['gpu'] or report['device']}, reference target.", ""]
    if any("steps" in r for r in results.values()):
        lines += ["The default engine (CUDA graphs for decode steps on a GPU; compiled step on CPU) against "
                  "`enforce_eager=True`:", "",
                  "| dtype | graphs | identical to generate | start s | decode step ms (default / eager / speed-up) |",
                  "| --- | --- | --- | --- | --- |"]
        for name, r in results.items():
            if "steps" in r:
                steps = "; ".join(f"{n} seq: {s['default_ms']:.2f} / {s['eager_ms']:.2f} / {s['speedup']:.2f}x"
                                  for n, s in r["steps"].items())
                lines.append(f"| {name} | {r['graphs']} | {r['identical']}/{r['requests']} | {r['start_seconds']} "
                             f"| {steps} |")
        lines.append("")
    if any("generate" in r for r in results.values()):
        lines += ["Compiled `generate` (paged + compile_config, reduce-overhead) against eager DynamicCache and "
                  "StaticCache + compile_config:", "",
                  "| dtype | batch | identical | first call s (paged+compile / static+compile) | ms per token "
                  "(dynamic / paged+compile / static+compile) |", "| --- | --- | --- | --- | --- |"]
        for name, r in results.items():
            for batch, g in r.get("generate", {}).items():
                first, ms = g["first_call_s"], g["ms_per_token"]
                cells = [f"{ms[side]:.2f}" if side in ms else "failed"
                         for side in ("dynamic", "paged + compile", "static + compile")]
                lines.append(f"| {name} | {batch} | {g['identical']} | {first.get('paged + compile', 'failed')} / "
                             f"{first.get('static + compile', 'failed')} | {' / '.join(cells)} |")
                lines += [f"| | | {side} failed: {error} | | |" for side, error in g.get("errors", {}).items()]
        lines.append("")
    for name, r in results.items():
        if "speculative" in r:
            g = r["speculative"]
            lines += ["Compiled speculative `generate` (batch 1, 64 held-out prompt tokens) against plain greedy "
                      f"`generate`, {name}:", "", "| side | identical to plain | first call s | ms per token | "
                      "x plain + compile |", "| --- | --- | --- | --- | --- |"]
            compiled = g["ms_per_token"].get("plain + compile")
            for side in [*g["first_call_s"], *(side for side in g["errors"] if side not in g["first_call_s"])]:
                ms = g["ms_per_token"].get(side)
                ratio = f"{compiled / ms:.2f}x" if ms and compiled else "-"
                lines.append(f"| {side} | {g['identical_sides'].get(side, 'failed')} | "
                             f"{g['first_call_s'].get(side, 'failed')} | {f'{ms:.2f}' if ms else 'failed'} | {ratio} |")
            lines += [f"| {side} failed: {error} | | | | |" for side, error in g["errors"].items()]
            lines.append("")
    lines += [line for name, r in results.items() if "lora" in r for line in _lora_lines(name, r["lora"])]
    lines += gpu_weights.render(report["weights"]) if "weights" in report else []
    notes = "".join(f"- {note}\n" for note in report.get("notes", []))  # added by hand to a run's JSON
    return "\n".join(lines) + f"\nFrom `{report['command']}`.\n" + (f"\nNotes:\n\n{notes}" if notes else "")


def _lora_lines(name: str, g: dict[str, Any]) -> list[str]:
    """The LoRA section's table for dtype `name`."""
    return [f"LoRA adapters in the engine, {name}: 3 random rank-8 adapters and the base in one batch; decode step "
            "of 8 sequences over the adapters:", "",
            "| identical to merged generate | compiled step | step ms (base / LoRA) | LoRA / base speed |",
            "| --- | --- | --- | --- |",
            f"| {g['identical']}/{g['requests']} | {g['compiled']} | {g['base_ms']:.2f} / {g['lora_ms']:.2f} | "
            f"{g['lora_vs_base']:.2f}x |", ""]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = benchmark_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the same check on the CPU)")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], default="all", help="the model dtypes checked")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--speculative", default="draft",
                        help=f"comma-separated compiled speculative methods checked, of {SPECULATIVE}")
    parser.add_argument("--batches", default="1,8", help="batch sizes of the compiled generate section")
    args = parser.parse_args(argv)
    sections, methods = tuple(args.sections.split(",")), tuple(args.speculative.split(","))
    if not set(sections) <= set(SECTIONS) or not set(methods) <= set(SPECULATIVE):
        parser.error(f"--sections takes {SECTIONS}, --speculative {SPECULATIVE}; got {args.sections!r}, "
                     f"{args.speculative!r}")
    with torch_threads(args.threads):
        report = measure(args.device, args.quick, tuple(DTYPES) if args.dtype == "all" else (args.dtype,),
                         sections, methods, tuple(int(b) for b in args.batches.split(",")))
    if report is None:
        print("gpu_check: no CUDA device here; nothing measured (run it where one is, or with --device cpu)")
        return None
    text = render(report)
    print("\n" + text)
    out = output_root(args, ROOT)
    if out is not None:
        write_results(out, NAME, report, text)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
