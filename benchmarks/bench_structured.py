"""Structured outputs: validity over real-world JSON schemas, the cost of the grammar mask, jump-forward and
speculation on a JSON-extraction workload, and vLLM's CPU build on the same constrained requests.

On the reference target (7.3M parameters), one thread, greedy unless said otherwise:
- validity: 8 schemas of the kind applications send (a person, an address, a product, an event, an order, a
  config, a tool call, a book), each after a few-shot extraction prompt and a bare one; `generate` (plain, sampled,
  ngram speculation) and the Engine (plain, sampled, suffix speculation): every output that finished must parse
  and validate (jsonschema); outputs cut by max_tokens are counted apart;
- mask cost: the Engine's tok/s with the constraint against the same requests unconstrained, each request held to
  the length its constrained output had (so both sides decode the same tokens), at batch 1 / 8 / 64, jump-forward
  off (the mask's cost alone) and on; compiled `generate` (paged cache + compile_config) likewise at batch 1 / 8 / 64;
  15 interleaved runs a side, the median of their ratios; the host time per masked row;
- jump-forward + speculation: the extraction workload at batch 1 and 8, constrained plain decoding against
  jump-forward (with the forced text's spellings learned in the warm-up run, and without them, in runs that put
  back what they knew after: `spellings_forgotten`),
  jump-forward + suffix (its cache emptied before each run) and jump-forward + ngram (outputs identical); in
  `generate` likewise (`structured_generate_jump.py`);
- a large schema compiling while other requests decode: their step time with and without the compile;
- vLLM's CPU build (its venv, as bench_vllm_peer.py) with the same schemas on the same requests (xgrammar, no free
  whitespace), on the reference target and the 185M random-weight Llama of bench_size.py: tok/s, validity, identical
  greedy outputs; skipped with a message without the venv.

Regenerate benchmarks/results/bench_structured.json and docs/bench_structured.md:
    .venv/bin/python benchmarks/bench_structured.py
Smoke run (fewer rows, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_structured.py --quick
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig

import hf_accel
from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutput, reference
from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.bench.timing import time_interleaved
from hf_accel.structured.forced_spelling import spellings_forgotten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_generate_jump import generate_jump_forward  # noqa: E402
from structured_mask_clock import MaskClock  # noqa: E402
from structured_peer import vllm_side_by_side, vllm_side_by_side_185m  # noqa: E402
from structured_report import FIRST_SIGHT, render, targets  # noqa: E402
from structured_schemas import MAX_TOKENS, SCHEMAS, check, extraction_prompt, prompts_for, tally  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_structured"
COMMAND = ".venv/bin/python benchmarks/bench_structured.py"
OVERHEAD_REPEATS = 5  # runs per side and repeat of the plan for the mask's cost: a 5% line needs more than 3 here (a
# batch-1 run is ~0.1 s on an AVX-512 EPYC: 9 pairs still moved its median ratio by 0.03 from run to run)
COMPILE_REPEATS = 3  # runs with a large compile (and without) per repeat of the plan: each ratio is noisy here
FULL = {"batches": (1, 8, 64), "generate_batches": (1, 8, 64), "repeats": 3, "samples": 2, "peer": True}
QUICK = {"batches": (1, 8), "generate_batches": (1,), "repeats": 1, "samples": 1, "peer": False}


def validity(model, tokenizer, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode, how many outputs over every schema and prompt were valid, invalid or cut by max_tokens."""
    jobs = [(name, prompt) for name in SCHEMAS for prompt in (extraction_prompt(name), "data = ")]
    rows = []
    for mode, kwargs in (("generate", {}), ("generate sampled", {"do_sample": True, "temperature": 1.0}),
                         ("generate + ngram", {"custom_generate": hf_accel.ngram_generate})):
        verdicts = []
        for name, prompt in jobs:
            torch.manual_seed(0)
            ids = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, tokenizer=tokenizer,
                                 structured_output=StructuredOutput(json=SCHEMAS[name]["schema"]), **kwargs)
            tokens = out[0, ids["input_ids"].shape[1]:].tolist()
            eos = model.generation_config.eos_token_id
            stopped = eos in tokens
            text = tokenizer.decode(tokens[: tokens.index(eos)] if stopped else tokens)
            verdicts.append(check(name, text, "stop" if stopped else "length"))
        rows.append({"mode": mode, **tally(verdicts)})
    for mode, speculative, temperature in (("engine", None, 0.0), ("engine sampled", None, 1.0),
                                           ("engine + suffix", "suffix", 0.0),
                                           ("engine + suffix sampled", "suffix", 1.0)):
        engine = make_engine(model, tokenizer, speculative=speculative)
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=1, n=plan["samples"],
                                 structured_outputs=StructuredOutput(json=SCHEMAS[name]["schema"]))
                  for name, _ in jobs]
        outs = engine.generate([prompt for _, prompt in jobs], params)
        verdicts = [check(name, sample.text, sample.finish_reason)
                    for (name, _), out in zip(jobs, outs) for sample in out.outputs]
        rows.append({"mode": mode, **tally(verdicts)})
    return rows


def make_engine(model, tokenizer, speculative: str | None = None, jump_forward: bool = True,
                max_num_seqs: int = 64) -> Engine:
    spec = None if speculative is None else SpeculativeConfig(speculative, num_speculative_tokens=8)
    return Engine(model, tokenizer, config=EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
                                                        structured_jump_forward=jump_forward), speculative=spec)


def engine_run(engine: Engine, jobs: list[tuple[str, str]], lengths: list[int] | None) -> tuple[float, Any]:
    """Seconds and outputs of one `generate` over `jobs`: constrained (`lengths` None) or unconstrained, each held
    to `lengths[i]` tokens."""
    if lengths is None:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                 structured_outputs=StructuredOutput(json=SCHEMAS[name]["schema"]))
                  for name, _ in jobs]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = engine.generate([prompt for _, prompt in jobs], params)
    return time.perf_counter() - start, outs


def engine_overhead(model, tokenizer, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Constrained against unconstrained tok/s in the Engine at each batch size, jump-forward off and on."""
    rows = []
    for jump_forward in (False, True):
        engine = make_engine(model, tokenizer, jump_forward=jump_forward)
        for batch in plan["batches"]:
            jobs = prompts_for(tokenizer, batch)
            _, outs = engine_run(engine, jobs, None)  # warm-up, and the lengths both sides decode
            lengths = [len(out.outputs[0].token_ids) for out in outs]
            with MaskClock() as clock:
                timings = time_interleaved(["constrained", "unconstrained"], lambda key: engine_run(
                    engine, jobs, None if key == "constrained" else lengths), OVERHEAD_REPEATS * plan["repeats"],
                    warmup=0)
            tokens = sum(lengths)
            ratios = [u / c for c, u in zip(timings.seconds["constrained"], timings.seconds["unconstrained"])]
            verdicts = [check(name, out.outputs[0].text, out.outputs[0].finish_reason)
                        for (name, _), out in zip(jobs, outs)]
            rows.append({"where": "engine", "batch": batch, "jump_forward": jump_forward, "tokens": tokens,
                         "constrained_tok_s": tokens / statistics.median(timings.seconds["constrained"]),
                         "unconstrained_tok_s": tokens / statistics.median(timings.seconds["unconstrained"]),
                         "ratio": statistics.median(ratios), "mask_us_per_row": clock.microseconds_per_row,
                         **tally(verdicts)})
        engine.shutdown()
    return rows


def generate_overhead(model, tokenizer, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Constrained against unconstrained tok/s of compiled `generate` (paged cache), the same number of steps."""
    rows = []
    compiled = {"cache_implementation": "paged", "compile_config": CompileConfig(fullgraph=True)}
    tokenizer.padding_side = "left"
    for batch in plan["generate_batches"]:
        name = "order"  # one constraint per generate call: every row extracts an order (prompt variants)
        prompts = [extraction_prompt(name, variant) for variant in range(batch)]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        constraint = StructuredOutput(json=SCHEMAS[name]["schema"])
        first = model.generate(**inputs, max_new_tokens=MAX_TOKENS, structured_output=constraint,
                               tokenizer=tokenizer, do_sample=False, pad_token_id=tokenizer.pad_token_id, **compiled)
        steps = first.shape[1] - inputs["input_ids"].shape[1]
        free = copy.deepcopy(model.generation_config)  # no EOS: exactly `steps` tokens, as the constrained call took
        free.update(eos_token_id=None, max_new_tokens=steps, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    **compiled)

        def run(key: str) -> tuple[float, Any]:
            start = time.perf_counter()
            if key == "constrained":
                out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, structured_output=constraint,
                                     tokenizer=tokenizer, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                     **compiled)
            else:
                out = model.generate(**inputs, generation_config=free)
            return time.perf_counter() - start, out

        with MaskClock() as clock:
            timings = time_interleaved(["constrained", "unconstrained"], run, OVERHEAD_REPEATS * plan["repeats"])
        tokens = steps * batch
        ratios = [u / c for c, u in zip(timings.seconds["constrained"], timings.seconds["unconstrained"])]
        rows.append({"where": "compiled generate", "batch": batch, "jump_forward": False, "tokens": tokens,
                     "constrained_tok_s": tokens / statistics.median(timings.seconds["constrained"]),
                     "unconstrained_tok_s": tokens / statistics.median(timings.seconds["unconstrained"]),
                     "ratio": statistics.median(ratios), "mask_us_per_row": clock.microseconds_per_row})
    return rows


def jump_forward(model, tokenizer, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The extraction workload: constrained plain decoding against jump-forward and jump-forward + speculation."""
    modes = {"constrained plain": (None, False), "jump-forward": (None, True),
             "jump-forward + suffix": ("suffix", True), "jump-forward + ngram": ("ngram", True)}
    rows = []
    for batch in (1, 8):
        jobs = prompts_for(tokenizer, batch)
        engines = {mode: make_engine(model, tokenizer, speculative, jf) for mode, (speculative, jf) in modes.items()}
        engines[FIRST_SIGHT] = make_engine(model, tokenizer, None, True)

        def run(mode: str) -> tuple[float, Any]:
            if mode == FIRST_SIGHT:  # nothing learned before; nor does the next run lose what it learned
                with spellings_forgotten():
                    return engine_run(engines[mode], jobs, None)
            if "suffix" in mode:  # empty, as configured: a repeat never drafts from its own earlier outputs
                proposer = engines[mode].core.proposer
                proposer.shared = hf_accel.SuffixCache(proposer.shared.max_depth, proposer.shared.max_sequences)
            return engine_run(engines[mode], jobs, None)

        timings = time_interleaved([*modes, FIRST_SIGHT], run, plan["repeats"])
        token_ids = {mode: [out.outputs[0].token_ids for out in outs] for mode, outs in timings.outputs.items()}
        tokens = sum(len(ids) for ids in token_ids["constrained plain"])
        base = timings.seconds["constrained plain"]
        for mode in [*modes, FIRST_SIGHT]:
            stats = engines[mode].stats()
            rows.append({"batch": batch, "mode": mode, "tok_s": tokens / statistics.median(timings.seconds[mode]),
                         "vs_constrained_plain": statistics.median(
                             b / s for b, s in zip(base, timings.seconds[mode])),
                         "identical": token_ids[mode] == token_ids["constrained plain"],
                         "forced_tokens": stats.jump_forward_tokens,
                         "accepted_tokens": stats.spec_decode_num_accepted_tokens,
                         "draft_tokens": stats.spec_decode_num_draft_tokens})
        for engine in engines.values():
            engine.shutdown()
    return rows


def large_schema(prefix: str) -> dict[str, Any]:
    """A schema of 200 nested objects whose property names start with `prefix` (its grammar compiles in about a
    second here, on one thread)."""
    properties = {f"{prefix}{i}": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[a-z]{2,8}"}, "b": {"enum": [f"v{j}" for j in range(30)]},
        "c": {"type": "array", "items": {"type": "integer"}, "maxItems": 5}}, "required": ["a", "b", "c"]}
        for i in range(200)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def compile_beside_decoding(model, tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    """Mean step time of 4 decoding requests while a large new schema compiles (the steps that began before the
    grammar was taken; the one that takes it also admits the request), against the same number of steps of a run
    without the compile (interleaved runs, alternating which goes first)."""
    engine = make_engine(model, tokenizer)

    def steps(compile_one: int | None, count: int | None) -> list[float]:
        """Step seconds: while the compile runs (`count` None), or `count` steps without one."""
        for i in range(4):
            engine.add_request(f"def f{i}(x):\n", SamplingParams(max_tokens=480, temperature=0, ignore_eos=True),
                               request_id=f"decode-{i}")
        for _ in range(5):
            engine.step()
        if compile_one is not None:  # a grammar no earlier run compiled (xgrammar's cache keys the grammar, and
            schema = large_schema(f"f{compile_one}_")  # a schema's title is not part of it: the names must differ)
            engine.add_request("x", SamplingParams(max_tokens=1, structured_outputs=StructuredOutput(json=schema)),
                               request_id="big")
        seconds = []
        while (not seconds or engine.core.grammars.has_pending) if count is None else len(seconds) < count:
            start = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - start)
        if compile_one is not None and len(seconds) > 1:
            seconds.pop()  # the step that took the compiled grammar: it admits the request (its prefill), after the
            # compile, as any new request's first step does
        for request_id in [*(f"decode-{i}" for i in range(4)), "big"]:
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        return seconds

    rows = []
    for repeat in range(COMPILE_REPEATS * plan["repeats"]):
        if repeat % 2:  # steps of a run without the compile first, as many as the last run with one took
            without = steps(None, rows[-1]["steps"])
            during = steps(repeat, None)
        else:
            during = steps(repeat, None)
            without = steps(None, len(during))
        rows.append({"steps": len(during), "step_ms_while_compiling": 1000 * statistics.mean(during),
                     "step_ms": 1000 * statistics.mean(without)})
    engine.shutdown()
    return {"runs": rows, "steps": statistics.median(r["steps"] for r in rows),
            "step_ms": statistics.median(r["step_ms"] for r in rows),
            "step_ms_while_compiling": statistics.median(r["step_ms_while_compiling"] for r in rows),
            "ratio": statistics.median(r["step_ms_while_compiling"] / r["step_ms"] for r in rows)}


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    model, tokenizer = reference.load("target")
    report: dict[str, Any] = {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
                              "max_tokens": MAX_TOKENS, "schemas": list(SCHEMAS)}
    steps: list[tuple[str, Callable[..., Any]]] = [
        ("validity", validity), ("engine_overhead", engine_overhead), ("generate_overhead", generate_overhead),
        ("jump_forward", jump_forward),
        ("generate_jump_forward", lambda m, t, p: generate_jump_forward(m, t, MAX_TOKENS, p["repeats"])),
        ("compile_beside_decoding", compile_beside_decoding),
        ("vllm", vllm_side_by_side), ("vllm_185M", vllm_side_by_side_185m)]
    for key, step in steps:
        print(f"[{NAME}] {key} ...", flush=True)
        report[key] = step(model, tokenizer, plan)
    report["total_seconds"] = time.perf_counter() - started
    report["targets"] = targets(report)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
