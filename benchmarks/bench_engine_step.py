"""Where one engine step's time goes, at 1, 8 and 64 decoding sequences (issue 24's "measure first").

Method: the reference target in fp32 on one thread; `n` held-out prompts of 256 tokens are added (DELTA outputs, as
the server asks) and prefilled, then `steps` decode steps are timed, every sequence decoding. Each stage is timed by
wrapping the function that does it (`time.perf_counter`, no profiler): scheduling, the runner's metadata (step
tensors and block tables), the model forward, and inside it the attention: the registered function's own glue
("attention call"), the gather (blocks copied out of the pool: only without the in-place kernel) and the K/V write plus
attention compute (one kernel call per layer with the in-place kernel); sampling (and
logprobs), appending tokens (stop rules, detokenization), the scheduler's postprocess, and the reports to listeners.
"other" is the step's time no stage claims. Stages are timed on an eager engine; the same steps then run on the
default, compiled engine as a whole (its forward is one graph: no stages inside).

Regenerate benchmarks/results/bench_engine_step.json and docs/bench_engine_step.md:
    .venv/bin/python benchmarks/bench_engine_step.py
Smoke run (tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_engine_step.py --quick
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface

from hf_accel import Engine, EngineConfig, RequestOutputKind, SamplingParams, bench, reference
from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.engine import commit
from hf_accel.runtime import attention

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_engine_step"
COMMAND = ".venv/bin/python benchmarks/bench_engine_step.py"
STAGES = ("schedule", "metadata", "forward", "attention call", "gather", "K/V write + attention", "sampling", "append",
          "postprocess", "outputs", "other")
FORWARD_PARTS = ("attention call", "gather", "K/V write + attention")  # inside "forward"


@dataclass(frozen=True, slots=True)
class Plan:
    batch_sizes: tuple[int, ...]
    prompt_len: int
    steps: int
    tiny: bool


FULL = Plan(batch_sizes=(1, 8, 64), prompt_len=256, steps=32, tiny=False)  # about the serving mix's mean context
QUICK = Plan(batch_sizes=(1, 4), prompt_len=16, steps=4, tiny=True)


class StageClock:
    """Seconds per stage, summed over wrapped calls (a call inside another stage counts only in the inner one)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - started
            self.seconds[name] += elapsed
            if self._stack:  # the enclosing stage does not count this time again
                self.seconds[self._stack[-1]] -= elapsed

    def wrap(self, name: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.stage(name):
                return function(*args, **kwargs)
        return timed


@contextlib.contextmanager
def instrumented(engine: Engine, clock: StageClock) -> Iterator[None]:
    """Wrap the functions behind each stage for the duration of the block."""
    core, runner = engine.core, engine.core.runner
    patches = [
        (core.scheduler, "schedule"), (core.scheduler, "postprocess"), (runner, "execute"),
        (runner.forward, "_forward"), (core.committer, "_append_all"), (engine, "_deliver"),
        (attention, "paged_attention"), (attention, "gather_blocks"), (runner.forward, "attend"),
        (commit, "sample"), (commit, "token_logprobs"),
    ]
    names = {"schedule": "schedule", "postprocess": "postprocess", "execute": "metadata", "_forward": "forward",
             "_append_all": "append", "_deliver": "outputs", "paged_attention": "attention call",
             "gather_blocks": "gather",
             "attend": "K/V write + attention", "sample": "sampling", "token_logprobs": "sampling"}
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in patches]
    for owner, attr, function in saved:
        setattr(owner, attr, clock.wrap(names[attr], function))
    # transformers' registry holds the function object: register the timed one for the block
    AttentionInterface.register(attention.ATTENTION_NAME, attention.paged_attention)
    try:
        yield
    finally:
        for owner, attr, function in saved:
            setattr(owner, attr, function)
        AttentionInterface.register(attention.ATTENTION_NAME, attention.paged_attention)


def decoding_engine(model, prompts: torch.Tensor, steps: int, enforce_eager: bool) -> Engine:
    """An engine with one request per prompt, all prefilled and one decode step past it (untimed)."""
    config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=max(512, prompts.numel()),
                          enforce_eager=enforce_eager)
    engine = Engine(model, config=config)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for row in prompts:
        engine.add_request(row.tolist(), params, output_kind=RequestOutputKind.DELTA)
    scheduler = engine.core.scheduler
    engine.step()  # the requests reach the scheduler (through the engine's inbox) and start their prefill
    while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
        engine.step()
    engine.step()  # one decode step untimed: every sequence decodes from here on
    return engine


def profile_batch(model, prompts: torch.Tensor, steps: int) -> dict[str, Any]:
    """Time `steps` decode steps stage by stage on an eager engine (a compiled forward hides its stages), then the
    same steps on the default, compiled engine as a whole."""
    engine = decoding_engine(model, prompts, steps, enforce_eager=True)
    clock = StageClock()
    with instrumented(engine, clock):
        started = time.perf_counter()
        for _ in range(steps):
            with clock.stage("other"):
                engine.step()
        total = time.perf_counter() - started
    per_step = {stage: clock.seconds.get(stage, 0.0) / steps for stage in STAGES}
    compiled = decoding_engine(model, prompts, steps, enforce_eager=False)
    started = time.perf_counter()
    for _ in range(steps):
        compiled.step()
    compiled_total = time.perf_counter() - started
    return {"sequences": len(prompts), "steps": steps, "step_ms": total / steps * 1e3,
            "tokens_per_s": len(prompts) * steps / total,
            "stage_ms": {stage: round(seconds * 1e3, 3) for stage, seconds in per_step.items()},
            "compiled_step_ms": compiled_total / steps * 1e3, "compiled_tokens_per_s": len(prompts) * steps /
            compiled_total, "compile_seconds": compiled.stats().compile_seconds}


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    if plan.tiny:
        model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=512)
        prompts = bench.make_prompts([plan.prompt_len] * max(plan.batch_sizes), 512)["input_ids"]
        description, source = bench.describe_model(model), "random"
    else:
        model, tokenizer = reference.load("target")
        prompts = reference.held_out_sequences(tokenizer, plan.prompt_len, max_rows=max(plan.batch_sizes))
        description, source = f"hf_accel reference target: {bench.describe_model(model)}", "held-out"
    torch.manual_seed(0)
    results = [profile_batch(model, prompts[:n], plan.steps) for n in plan.batch_sizes]
    return {"benchmark": NAME, "command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
            "model": description, "plan": {"prompt_len": plan.prompt_len, "steps": plan.steps, "prompts": source},
            "results": results}


def render(report: dict[str, Any]) -> str:
    results = report["results"]
    header = "| stage (ms per step) | " + " | ".join(f"{r['sequences']} seq" for r in results) + " |"
    lines = [f"One engine decode step by stage: {report['model']}, prompts of {report['plan']['prompt_len']} "
             f"{report['plan']['prompts']} tokens, {report['plan']['steps']} decode steps timed after the prefill, "
             "fp32, "
             f"{report['hardware']['torch_threads']} torch thread(s) ({report['hardware']['cpu']}). Stages inside "
             "the model forward are indented; \"forward\" is the rest of it (the model's own layers).", "",
             header, "| --- |" + " --- |" * len(results)]
    for stage in STAGES:
        label = f"&nbsp;&nbsp;{stage}" if stage in FORWARD_PARTS else stage
        cells = [f"{r['stage_ms'][stage]:.2f} ({r['stage_ms'][stage] / r['step_ms']:.0%})" for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{r['step_ms']:.2f}**" for r in results) + " |")
    lines.append("| generated tok/s | " + " | ".join(f"{r['tokens_per_s']:.0f}" for r in results) + " |")
    lines.append("| **step, compiled** | " + " | ".join(f"**{r['compiled_step_ms']:.2f}**" for r in results) + " |")
    lines.append("| generated tok/s, compiled | " + " | ".join(f"{r['compiled_tokens_per_s']:.0f}" for r in results)
                 + " |")
    lines[0] += (" The stages are timed on an eager engine (`enforce_eager=True`: a compiled forward hides them); the "
                 "compiled rows run the same steps on the default engine, whose forward is compiled once at start "
                 f"({', '.join(format(r['compile_seconds'], '.1f') for r in results)} s).")
    return "\n".join(lines) + f"\n\nFrom `{report['command']}`.\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render,
                         lambda report: {"docs/serving.md": render(report)})


if __name__ == "__main__":
    main(sys.argv[1:])
