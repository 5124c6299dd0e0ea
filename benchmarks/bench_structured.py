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
  9 interleaved runs a side, the median of their ratios; the host time per masked row;
- jump-forward + speculation: the extraction workload at batch 1 and 8, constrained plain decoding against
  jump-forward (with the forced text's spellings learned in the warm-up run, and forgotten before each run),
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
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import torch
from transformers import CompileConfig

import hf_accel
from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutput, reference
from hf_accel.bench.output import hardware, run_benchmark, target_table
from hf_accel.bench.timing import time_interleaved
from hf_accel.structured.forced_spelling import forget_spellings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_generate_jump import generate_jump_forward, render_generate_jump_forward  # noqa: E402
from structured_schemas import SCHEMAS, extraction_prompt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_structured"
COMMAND = ".venv/bin/python benchmarks/bench_structured.py"
MAX_TOKENS = 160
FIRST_SIGHT = "jump-forward, schemas not seen before"  # no learned spellings (`forced_spelling.py`) at its start
OVERHEAD_REPEATS = 3  # runs per side and repeat of the plan for the mask's cost: a 5% line needs more than 3 here
COMPILE_REPEATS = 3  # runs with a large compile (and without) per repeat of the plan: each ratio is noisy here
FULL = {"batches": (1, 8, 64), "generate_batches": (1, 8, 64), "repeats": 3, "samples": 2, "peer": True}
QUICK = {"batches": (1, 8), "generate_batches": (1,), "repeats": 1, "samples": 1, "peer": False}


def prompts_for(tokenizer, batch: int) -> list[tuple[str, str]]:
    """`batch` (schema name, prompt) pairs: the extraction prompt of each schema in turn (its variant `i // 8`)."""
    names = list(SCHEMAS)
    return [(names[i % len(names)], extraction_prompt(names[i % len(names)], i // len(names))) for i in range(batch)]


def check(name: str, text: str, finish: str | None) -> str:
    """"valid", "invalid" or "unfinished" (cut by max_tokens)."""
    if finish != "stop":
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name]["schema"])
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def tally(verdicts: list[str]) -> dict[str, int]:
    return {kind: verdicts.count(kind) for kind in ("valid", "invalid", "unfinished")}


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


class MaskClock:
    """Host seconds spent filling (and, in the engine, applying) grammar masks, and the rows masked (wraps the
    engine's `mask_rows` and the generate processor's `allowed`; compiled greedy generate applies the mask in its
    step)."""

    def __init__(self) -> None:
        self.seconds, self.rows = 0.0, 0

    def __enter__(self) -> MaskClock:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        self._saved = (sampler.mask_rows, StructuredLogitsProcessor.allowed)
        clock = self

        def mask_rows(logits, matchers):
            start = time.perf_counter()
            sampler_mask(logits, matchers)
            clock.seconds += time.perf_counter() - start
            clock.rows += sum(m is not None for m in matchers)

        def allowed(processor, input_ids, lengths=None, **options):
            start = time.perf_counter()
            out = processor_fill(processor, input_ids, lengths, **options)
            clock.seconds += time.perf_counter() - start
            clock.rows += input_ids.shape[0]
            return out

        sampler_mask, processor_fill = self._saved
        sampler.mask_rows, StructuredLogitsProcessor.allowed = mask_rows, allowed
        return self

    def __exit__(self, *exc: Any) -> None:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        sampler.mask_rows, StructuredLogitsProcessor.allowed = self._saved

    @property
    def microseconds_per_row(self) -> float | None:
        return 1e6 * self.seconds / self.rows if self.rows else None


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
            if mode == FIRST_SIGHT:
                forget_spellings()
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
    """Mean step time of 4 decoding requests while a large new schema compiles, against the same steps of a run
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


def vllm_side_by_side(model, tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    """The engine and vLLM's CPU build on the same constrained requests, on the reference target."""
    peer = _peer(plan)
    if isinstance(peer, str):
        return {"skipped": peer}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return side_by_side(folder, tokenizer, peer, Path(scratch))


def vllm_side_by_side_185m(model, tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    """The same at a real size: bench_size.py's 185M-parameter random-weight Llama (the reference tokenizer)."""
    import bench_size

    peer = _peer(plan)
    if isinstance(peer, str):
        return {"skipped": peer}
    size = next(size for size in bench_size.FULL.sizes if size.name == "185M")
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_size.model_folder(size, Path(scratch) / "model")
        return side_by_side(folder, tokenizer, peer, Path(scratch))


def _peer(plan: dict[str, Any]) -> Path | str:
    """vLLM's python, or why its rows are skipped."""
    from bench_vllm_peer import DEFAULT_VENV
    from hf_accel.bench.peer import venv_python

    peer = venv_python(DEFAULT_VENV, "vllm")
    if peer is None:
        return f"no vLLM venv at {DEFAULT_VENV} (bench_vllm_peer.py --setup creates it)"
    return peer if plan["peer"] else "--quick"


def side_by_side(folder: Path, tokenizer, peer: Path, scratch: Path) -> dict[str, Any]:
    """16 constrained requests (two per schema) answered by each side in its own process from `folder`."""
    from hf_accel.bench.peer import run_job

    jobs = prompts_for(tokenizer, 16)
    requests = [[tokenizer(prompt, add_special_tokens=False)["input_ids"], MAX_TOKENS] for _, prompt in jobs]
    schemas = [SCHEMAS[name]["schema"] for name, _ in jobs]
    results = {}
    for side, python in (("hf_accel", Path(sys.executable)), ("vllm", peer)):
        job = {"side": side, "model": str(folder), "max_model_len": 512, "max_num_seqs": 16,
               "max_num_batched_tokens": None, "requests": requests, "warmup": 2, "sequential": False,
               "json_schemas": schemas}
        worker = [str(python), str(Path(__file__).resolve().parent / "vllm_peer_worker.py")]
        results[side] = run_job(worker, job, side_env(side), scratch / side, timeout=1800)
    summary = {}
    for side, result in results.items():
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result["outputs"]]
        finished = [tokenizer.eos_token_id in ids or len(ids) < MAX_TOKENS for ids in result["outputs"]]
        verdicts = [check(name, text, "stop" if done else "length")
                    for (name, _), text, done in zip(jobs, texts, finished)]
        tokens = sum(len(ids) for ids in result["outputs"])
        summary[side] = {"tok_s": tokens / result["seconds"], "seconds": result["seconds"], "tokens": tokens,
                         **tally(verdicts)}
    identical = sum(a == b for a, b in zip(results["hf_accel"]["outputs"], results["vllm"]["outputs"]))
    return {"requests": len(jobs), "sides": summary, "identical": identical,
            "ratio": summary["hf_accel"]["tok_s"] / summary["vllm"]["tok_s"]}


def side_env(side: str) -> dict[str, str]:
    from bench_vllm_peer import side_env as peer_env

    return peer_env(side)


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


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    invalid = sum(row["invalid"] for row in report["validity"])
    found.append({"name": "invalid finished outputs (every mode, schema, prompt)", "goal": "= 0", "value": invalid,
                  "met": invalid == 0})
    for row in report["engine_overhead"] + report["generate_overhead"]:
        if not row["jump_forward"] and row["batch"] in (1, 8):
            found.append({"name": f"{row['where']} constrained / unconstrained tok/s, batch {row['batch']}",
                          "goal": ">= 0.95", "value": row["ratio"], "met": row["ratio"] >= 0.95})
    compile_row = report["compile_beside_decoding"]
    found.append({"name": "step time while a large schema compiles / without", "goal": "<= 1.05",
                  "value": compile_row["ratio"], "met": compile_row["ratio"] <= 1.05})
    for where, key in (("engine", "jump_forward"), ("generate", "generate_jump_forward")):
        for row in report[key]:
            if row["mode"] == "jump-forward + suffix":
                found.append({"name": f"{where} jump-forward + suffix / constrained plain, batch {row['batch']}",
                              "goal": ">= 1.5", "value": row["vs_constrained_plain"],
                              "met": row["vs_constrained_plain"] >= 1.5})
    for key, where in (("vllm", "reference target"), ("vllm_185M", "185M Llama")):
        peer = report.get(key, {})
        found.append({"name": f"engine json_schema / vLLM CPU build tok/s, {where}", "goal": ">= 1.0",
                      "value": peer.get("ratio"), "met": None if "ratio" not in peer else peer["ratio"] >= 1.0})
    return found


def render(report: dict[str, Any]) -> str:
    lines = ["# Structured outputs: validity, mask cost, jump-forward, vLLM", "",
             f"{report['hardware']['cpu']}; reference target, one thread, JSON schemas: "
             f"{', '.join(report['schemas'])}; at most {report['max_tokens']} tokens.", "",
             "## Validity (finished outputs parse and validate)", "",
             "| mode | valid | invalid | cut by max_tokens |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['valid']} | {r['invalid']} | {r['unfinished']} |" for r in report["validity"]]
    lines += ["", "## Cost of the mask (same tokens decoded on both sides)", "",
              "| where | batch | jump-forward | constrained tok/s | unconstrained tok/s | ratio | mask us / row |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["engine_overhead"] + report["generate_overhead"]:
        mask = "-" if r["mask_us_per_row"] is None else f"{r['mask_us_per_row']:.0f}"
        lines.append(f"| {r['where']} | {r['batch']} | {'on' if r['jump_forward'] else 'off'} | "
                     f"{r['constrained_tok_s']:.0f} | {r['unconstrained_tok_s']:.0f} | {r['ratio']:.2f}x | {mask} |")
    lines += ["", "## Jump-forward and speculation on JSON extraction (Engine, greedy)", "",
              "| batch | mode | tok/s | vs constrained plain | identical | forced tokens | accepted / drafted |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['mode']} | {r['tok_s']:.0f} | {r['vs_constrained_plain']:.2f}x | "
              f"{'yes' if r['identical'] else 'no'} | {r['forced_tokens']} | "
              f"{r['accepted_tokens']} / {r['draft_tokens']} |" for r in report["jump_forward"]]
    lines += ["", "The suffix cache is emptied before each run (it learns from the run's own earlier requests "
                  "only). Jump-forward drafts forced text as the model spelled it before (`forced_spelling.py`): "
                  "the warm-up run taught those spellings, as earlier requests with the same schema would; the "
                  f"\"{FIRST_SIGHT}\" rows forget them before each run. Forced tokens per step: up to 4 at batch 1, "
                  "2 at batch 8."]
    lines += [""] + render_generate_jump_forward(report["generate_jump_forward"])
    c = report["compile_beside_decoding"]
    lines += ["", f"A large schema (200 nested properties) compiling beside 4 decoding requests: their step "
                  f"{c['step_ms_while_compiling']:.2f} ms during the compile ({c['steps']:.0f} steps), "
                  f"{c['step_ms']:.2f} ms without ({c['ratio']:.2f}x).", ""]
    for key, where in (("vllm", "the reference target"), ("vllm_185M", "the 185M random-weight Llama")):
        lines += _peer_lines(report.get(key, {"skipped": "not run"}), where)
    lines += target_table(report["targets"])
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def _peer_lines(peer: dict[str, Any], where: str) -> list[str]:
    if "skipped" in peer:
        return [f"vLLM side by side on {where}: skipped ({peer['skipped']}).", ""]
    lines = [f"## Against vLLM's CPU build, {where} ({peer['requests']} constrained requests, greedy)", "",
             "| side | tok/s | valid | invalid | cut by max_tokens |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {side} | {s['tok_s']:.0f} | {s['valid']} | {s['invalid']} | {s['unfinished']} |"
              for side, s in peer["sides"].items()]
    return lines + ["", f"hf_accel / vLLM: {peer['ratio']:.2f}x; identical greedy outputs: {peer['identical']} of "
                        f"{peer['requests']}. Both on xgrammar without free whitespace, but vLLM's grammar writes "
                        "compact separators (`,` `:`) where hf_accel's writes `, ` and `: ` (as `json.dumps` and the "
                        "prompts' examples do), so greedy outputs part at the first separator.", ""]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
