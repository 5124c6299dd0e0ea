"""Speculative decoding benchmark: hf_accel's draft-model and model-free paths against plain generate and
transformers' assisted decoding and prompt lookup, on the project's reference pair (target 7.3M parameters, draft
0.7M, same tokenizer).

Workloads (`WORKLOADS`), at batch 1 and batch 4 (left-padded held-out prompts): open continuation of held-out code
(greedy and sampling); copy-heavy: a held-out code block, a blank line, then the block's first 16 tokens again (the
prompt begins to repeat it, as in editing a file); nothing repeats: open continuation with `no_repeat_ngram_size=2`
for every method (no bigram of the output occurred before, so no draft copied from the context can be accepted:
the off-switch's case). `hf_accel ngram + suffix cache` drafts from a `SuffixCache` warmed by earlier requests
(greedy outputs for other held-out prompts); each timed call gets a copy of it as warmed, never its own outputs.

Every method of a measurement runs in one process, interleaved, after a warm-up
(`hf_accel.bench.compare_strategies`: decode time = time(N tokens) - time(1 token), median of per-repeat paired
ratios). One more untimed run per method counts target forwards and, where the method reports them, accepted drafts
per position. Tokens per target forward has `SpeculativeStats`' definition: tokens a row gains per verification
forward, the prefill not counted (plain decoding is 1.0); from the method's stats where it keeps them, else from the
forwards counted (exact at batch 1 and for plain decoding).

`hf_accel eagle` decodes with the reference target's committed EAGLE head (`reference.load_head("eagle")`); its
"analytic x plain" is tokens per target forward / (1 + mean draft length x c), c the measured cost of one head pass
relative to one plain decode step of the target (batch 1): the speed-up if a verification forward of k + 1 tokens
cost what a one-token step does. `hf_accel eagle tree` drafts EAGLE-2 dynamic trees (`hf_accel.EagleTree()`); its
analytic figure is tokens per target forward / (v + p x c), v the measured cost of its verification forward (root
and `total_tokens` nodes, a 4-D mask, hidden states) over a plain step, p the head passes per round. `--eagle` runs
only the open-continuation cases with plain generate and EAGLE, each also with `compile_config` (greedy and
sampling: plain compiled decoding is the paged cache's compiled loop, EAGLE's is `hf_accel/compiled/eagle_loop.py`,
greedy trees' `hf_accel/compiled/eagle_tree_loop.py`; "x plain + compile" compares with the former; every row with EOS
off, since generate's min-length processors keep compiled loops eager), and writes them as `bench_speculative_eagle` (its own JSON, page and section
of docs/speculative.md).

Add a method (Medusa heads, ...) by writing a function `(pair, case) -> Method | None` and listing it in `METHODS`.
Regenerate benchmarks/results/bench_speculative.json, docs/bench_speculative.md and the tables in docs/speculative.md
with:
    .venv/bin/python benchmarks/bench_speculative.py        (--quick: small lengths, prints only unless --out)
    .venv/bin/python benchmarks/bench_speculative.py --eagle   (the EAGLE rows alone; --no-compile: eager rows only)
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_accel
from hf_accel import bench, reference
from hf_accel.bench.output import benchmark_parser, output_root, write_results
from hf_accel.display import format_table

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_speculative"
COMMAND = ".venv/bin/python benchmarks/bench_speculative.py"
MODES = {"greedy": {"do_sample": False},
         "sampling": {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}}
WORKLOADS = {"open": {}, "copy-heavy": {}, "nothing repeats": {"no_repeat_ngram_size": 2}}  # -> generate kwargs
CASES = (("open", "greedy"), ("open", "sampling"), ("copy-heavy", "greedy"), ("nothing repeats", "greedy"))
COPY_PREFIX = 16  # tokens of the block the copy-heavy prompt repeats
NGRAM_ROWS = ("hf_accel ngram", "hf_accel ngram + suffix cache")
PLAIN_COMPILED = "plain + compile"
# (row, what it is compared with, workloads and modes where checked (None: all), batch sizes, goal)
TARGETS = (("hf_accel draft", "x_plain", ("open",), None, (1, 4), 2.0),
           ("hf_accel draft", "x_stock_assisted", ("open",), None, (1,), 1.2),
           *((row, "x_plain", ("copy-heavy",), ("greedy",), (1,), 2.5) for row in NGRAM_ROWS),
           *((row, "x_prompt_lookup", ("open", "copy-heavy"), ("greedy",), (1,), 1.2) for row in NGRAM_ROWS),
           *((row, "x_plain", ("nothing repeats",), ("greedy",), (1, 4), 0.95) for row in NGRAM_ROWS),
           ("hf_accel eagle", "x_plain", ("open",), ("greedy",), (1,), 2.0),
           ("hf_accel eagle + compile", "x_plain", ("open",), ("greedy",), (1,), 2.0),
           ("hf_accel eagle tree + compile", "x_plain", ("open",), ("greedy",), (1,), 2.0),
           ("hf_accel eagle", "tokens_per_target_forward", ("open",), ("greedy",), (1,), 3.0))


@dataclass(frozen=True, slots=True)
class Plan:
    prompt_lengths: dict[int, list[int]]  # batch size -> prompt lengths (copy-heavy: block lengths)
    new_tokens: int
    repeats: int
    warmup: int
    num_earlier_requests: int  # requests that warm the suffix cache


FULL = Plan({1: [128], 4: [128, 112, 96, 80]}, new_tokens=128, repeats=5, warmup=1, num_earlier_requests=32)
QUICK = Plan({1: [32], 4: [32, 24, 28, 20]}, new_tokens=16, repeats=1, warmup=1, num_earlier_requests=2)


@dataclass(frozen=True, slots=True)
class Case:
    """One measurement: a workload, a decoding mode, a batch size."""

    workload: str
    mode: str
    batch_size: int
    eos_off: bool = False  # every row decodes with `eos_token_id=None` (the --eagle run: compiled loops apply no
    # min-length processor, which generate adds when EOS is on)

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        return {**MODES[self.mode], **WORKLOADS[self.workload], **({"eos_token_id": None} if self.eos_off else {})}


@dataclass(frozen=True, slots=True)
class Pair:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    description: str
    warm_cache: hf_accel.SuffixCache  # earlier requests' outputs
    eagle_head: hf_accel.EagleHead | None  # the target's committed EAGLE head (None: not trained yet)
    eagle_cost: float  # one head pass / one plain decode step of the target, batch 1


@dataclass(frozen=True, slots=True)
class Method:
    """One row: how to generate, and (optional) a fresh stats object handed to generate as `stats_kwarg`, with a
    function reading acceptance figures out of it."""

    strategy: bench.Strategy
    stats_kwarg: str | None = None
    make_stats: Callable[[], Any] | None = None
    read_stats: Callable[[Any], dict[str, Any]] | None = None
    plain: bool = False  # plain decoding: one target forward per token (a compiled loop's forwards cannot be counted
    # by hooks, which the compiled graph does not run)


def load_pair(plan: Plan, eagle_only: bool = False) -> Pair:
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    has_head = (reference.ASSETS_DIR / "eagle" / "eagle_config.json").is_file()
    head = reference.load_head("eagle", target) if has_head else None
    cache = hf_accel.SuffixCache() if eagle_only else warm_cache(target, tokenizer, plan)
    return Pair(target, draft, tokenizer,
                f"reference target ({bench.describe_model(target)}), draft ({bench.describe_model(draft)}), fp32",
                cache, head, head_cost(target, head) if head is not None else 0.0)


@torch.no_grad()
def head_cost(target: torch.nn.Module, head: hf_accel.EagleHead, context: int = 128, repeats: int = 50) -> float:
    """Median time of one EAGLE draft step (head pass + LM-head readout) over a plain decode step of the target,
    batch 1, `context` tokens cached by each."""
    from hf_accel.speculative.eagle_head import token_embeddings

    ids = torch.randint(1, 1000, (1, context + 1))
    target_cache, head_cache = transformers.DynamicCache(), transformers.DynamicCache()
    out = target(input_ids=ids[:, :-1], past_key_values=target_cache, output_hidden_states=True)
    features = head.fuse(out.hidden_states)
    head(features, token_embeddings(target, ids[:, 1:]), torch.arange(context)[None], None, head_cache)
    position = torch.tensor([[context]])

    def target_step():
        target(input_ids=ids[:, -1:], past_key_values=target_cache, position_ids=position)
        target_cache.crop(-1)

    def head_step():
        hidden = head(features[:, -1:], token_embeddings(target, ids[:, -1:]), position, None, head_cache)
        head.logits(target, hidden)
        head_cache.crop(-1)

    return _median_seconds(head_step, repeats) / _median_seconds(target_step, repeats)


def _median_seconds(step: Callable[[], Any], repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def warm_cache(target: torch.nn.Module, tokenizer: Any, plan: Plan) -> hf_accel.SuffixCache:
    """A `SuffixCache` holding the greedy outputs of `plan.num_earlier_requests` earlier requests: held-out rows
    from row 100 on (every 8th), far from the benchmark's prompts (the first rows)."""
    rows = reference.held_out_sequences(tokenizer, max(plan.prompt_lengths[1]))[100 :: 8][: plan.num_earlier_requests]
    cache = hf_accel.SuffixCache()
    for chunk in rows.split(8):
        target.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=plan.new_tokens,
                        do_sample=False, custom_generate=hf_accel.ngram_generate, suffix_cache=cache)
    return cache


def prompts(pair: Pair, workload: str, lengths: list[int]) -> dict[str, torch.Tensor]:
    if workload == "copy-heavy":
        return bench.copy_heavy_prompts(pair.tokenizer, lengths, COPY_PREFIX)
    return bench.text_prompts(pair.tokenizer, lengths)


def plain_method(pair: Pair, case: Case) -> Method:
    return Method(bench.Strategy("plain generate", "model.generate, DynamicCache (baseline)",
                                 lambda model, max_len: case.generate_kwargs))


def plain_compiled_method(pair: Pair, case: Case) -> Method | None:
    return Method(bench.Strategy(PLAIN_COMPILED, "cache_implementation='paged', compile_config (hf_accel's compiled "
                                 "loop)", lambda model, max_len: {**case.generate_kwargs, **_compiled("paged")}),
                  plain=True)


def _compiled(cache: str | None = None) -> dict[str, Any]:
    return {"compile_config": transformers.CompileConfig(fullgraph=True)} | (
        {"cache_implementation": cache} if cache else {})


def stock_assisted_method(pair: Pair, case: Case) -> Method | None:
    if case.batch_size != 1 or case.workload != "open":
        return None  # transformers' assisted decoding supports batch size 1 only
    return Method(bench.Strategy("transformers assisted", "assistant_model=draft (stock heuristic draft length)",
                                 lambda model, max_len: {**case.generate_kwargs, "assistant_model": pair.draft}))


def read_speculative_stats(stats: hf_accel.SpeculativeStats) -> dict[str, Any]:
    lengths = stats.draft_lengths
    return {"tokens_per_target_forward": stats.tokens_per_forward, "acceptance_rate": stats.acceptance_rate,
            "acceptance_by_position": stats.acceptance_by_position,
            "mean_draft_length": statistics.mean(lengths) if lengths else 0.0,
            "drafting_rounds": sum(n > 0 for n in lengths) / len(lengths) if lengths else 0.0}


def hf_accel_draft_method(pair: Pair, case: Case) -> Method | None:
    if case.workload != "open":
        return None

    def kwargs(model, max_len):
        return {**case.generate_kwargs, "custom_generate": hf_accel.draft_generate, "draft_model": pair.draft}

    return Method(bench.Strategy("hf_accel draft", "custom_generate=hf_accel.draft_generate, adaptive draft length",
                                 kwargs), "draft_stats", hf_accel.SpeculativeStats, read_speculative_stats)


def hf_accel_eagle_method(pair: Pair, case: Case, compiled: bool = False) -> Method | None:
    if case.workload != "open" or pair.eagle_head is None:
        return None

    def kwargs(model, max_len):
        return {**case.generate_kwargs, "custom_generate": hf_accel.eagle_generate, "eagle_head": pair.eagle_head,
                **(_compiled() if compiled else {})}

    def read(stats: hf_accel.SpeculativeStats) -> dict[str, Any]:
        found = read_speculative_stats(stats)
        if compiled:
            return found
        analytic = found["tokens_per_target_forward"] / (1 + found["mean_draft_length"] * pair.eagle_cost)
        return found | {"analytic_x_plain": analytic, "head_cost_per_step": pair.eagle_cost}

    name = "hf_accel eagle + compile" if compiled else "hf_accel eagle"
    description = "custom_generate=hf_accel.eagle_generate, reference EAGLE head, adaptive chain" + (
        ", compile_config (compiled/eagle_loop.py)" if compiled else "")
    return Method(bench.Strategy(name, description, kwargs), "eagle_stats", hf_accel.SpeculativeStats, read)


def hf_accel_eagle_compiled_method(pair: Pair, case: Case) -> Method | None:
    return hf_accel_eagle_method(pair, case, compiled=True)


def hf_accel_eagle_tree_method(pair: Pair, case: Case, compiled: bool = False) -> Method | None:
    if case.workload != "open" or pair.eagle_head is None or (compiled and case.mode != "greedy"):
        return None  # compiled trees are greedy (sampled ones decode eagerly)
    tree = hf_accel.EagleTree()

    def kwargs(model, max_len):
        return {**case.generate_kwargs, "custom_generate": hf_accel.eagle_generate, "eagle_head": pair.eagle_head,
                "eagle_tree": tree, **(_compiled() if compiled else {})}

    def read(stats: hf_accel.SpeculativeStats) -> dict[str, Any]:
        # a round: one verify forward of the root and `total_tokens` nodes, plus the head's passes
        found = read_speculative_stats(stats)
        if compiled:
            return found
        passes = stats.num_draft_forwards / max(stats.num_target_forwards, 1)
        verify = verify_cost(pair.target, tree.total_tokens + 1)
        analytic = found["tokens_per_target_forward"] / (verify + passes * pair.eagle_cost)
        return found | {"analytic_x_plain": analytic, "head_cost_per_step": pair.eagle_cost,
                        "head_passes_per_round": passes, "verify_cost": verify}

    description = (f"custom_generate=hf_accel.eagle_generate, reference EAGLE head, eagle_tree=EagleTree("
                   f"total_tokens={tree.total_tokens}, depth={tree.depth}, top_k={tree.top_k}) (EAGLE-2 dynamic tree)")
    if compiled:
        description += ", compile_config (compiled/eagle_tree_loop.py)"
    return Method(bench.Strategy("hf_accel eagle tree" + (" + compile" if compiled else ""), description, kwargs),
                  "eagle_stats", hf_accel.SpeculativeStats, read)


def hf_accel_eagle_tree_compiled_method(pair: Pair, case: Case) -> Method | None:
    return hf_accel_eagle_tree_method(pair, case, compiled=True)


@functools.cache
def verify_cost(target: torch.nn.Module, num_tokens: int, context: int = 128, repeats: int = 30) -> float:
    """Median time of a forward of `num_tokens` new tokens with a 4-D mask and hidden states (a tree verification)
    over a plain decode step, batch 1, `context` tokens cached."""
    ids = torch.randint(1, 1000, (1, context + num_tokens))
    cache = transformers.DynamicCache()
    target(input_ids=ids[:, :context], past_key_values=cache)
    mask = torch.zeros(1, 1, num_tokens, context + num_tokens)
    positions = torch.arange(context, context + num_tokens)[None]

    def verify():
        target(input_ids=ids[:, context:], past_key_values=cache, position_ids=positions, attention_mask=mask,
               output_hidden_states=True)
        cache.crop(-num_tokens)

    def step():
        target(input_ids=ids[:, context : context + 1], past_key_values=cache, position_ids=positions[:, :1])
        cache.crop(-1)

    return _median_seconds(verify, repeats) / _median_seconds(step, repeats)


def stock_prompt_lookup_method(pair: Pair, case: Case) -> Method | None:
    if case.batch_size != 1:
        return None  # transformers' prompt lookup (assisted decoding) supports batch size 1 only
    return Method(bench.Strategy("transformers prompt lookup", "prompt_lookup_num_tokens=10",
                                 lambda model, max_len: {**case.generate_kwargs, "prompt_lookup_num_tokens": 10}))


def hf_accel_ngram_methods(pair: Pair, case: Case) -> list[Method]:
    def kwargs(shared: bool):
        extra = {"suffix_cache": copy.deepcopy(pair.warm_cache)} if shared else {}  # untimed: built before the clock
        return {**case.generate_kwargs, "custom_generate": hf_accel.ngram_generate, **extra}

    return [Method(bench.Strategy(name, description, lambda model, max_len, shared=shared: kwargs(shared)),
                   "ngram_stats", hf_accel.SpeculativeStats, read_speculative_stats)
            for name, description, shared in (
                ("hf_accel ngram", "custom_generate=hf_accel.ngram_generate (prompt lookup)", False),
                ("hf_accel ngram + suffix cache", "suffix_cache=SuffixCache warmed by earlier requests", True))]


METHODS: tuple[Callable[[Pair, Case], Method | list[Method] | None], ...] = (
    plain_method, stock_assisted_method, hf_accel_draft_method, hf_accel_eagle_method, hf_accel_eagle_tree_method,
    stock_prompt_lookup_method,
    hf_accel_ngram_methods)
EAGLE_METHODS = (plain_method, plain_compiled_method, hf_accel_eagle_method, hf_accel_eagle_tree_method,
                 hf_accel_eagle_compiled_method, hf_accel_eagle_tree_compiled_method)
EAGLE_EAGER_METHODS = (plain_method, hf_accel_eagle_method, hf_accel_eagle_tree_method)


def profile(pair: Pair, method: Method, inputs: dict[str, torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """Target forwards and acceptance of one untimed run."""
    stats = method.make_stats() if method.make_stats else None
    extra = {method.stats_kwarg: stats} if stats is not None else {}
    max_len = inputs["input_ids"].shape[1] + new_tokens
    options = {**method.strategy.generate_kwargs(pair.target, max_len), **extra}
    torch.manual_seed(0)
    run = functools.partial(pair.target.generate, **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            **options)
    if stats is not None:  # the method counts its own forwards (a forward hook would make compiled loops recompile)
        run()
        forwards = stats.num_target_forwards + 1  # and the prefill
    else:
        forwards = new_tokens if method.plain else bench.count_forwards(pair.target, run)
    found = {"tokens_per_target_forward": (new_tokens - 1) / max(forwards - 1, 1), "target_forwards": forwards}
    return found | (method.read_stats(stats) if stats is not None else {})


def measure(pair: Pair, case: Case, plan: Plan, makers=METHODS) -> dict[str, Any]:
    made = [make(pair, case) for make in makers]
    methods = [m for item in made for m in (item if isinstance(item, list) else [item]) if m is not None]
    lengths = plan.prompt_lengths[case.batch_size]
    inputs = prompts(pair, case.workload, lengths)
    label = f"{case.workload}, {case.mode}, batch {case.batch_size}"
    torch.manual_seed(0)
    results = bench.compare_strategies(pair.target, inputs, plan.new_tokens, [m.strategy for m in methods],
                                       repeats=plan.repeats, warmup=plan.warmup,
                                       on_step=lambda name: print(f"  {label}: {name}", flush=True))
    seconds = {r.name: r.decode_seconds for r in results}
    rows = []
    for method, result in zip(methods, results):
        row = {"name": result.name, "description": method.strategy.description,
               "decode_tokens_per_s": result.decode_tokens_per_s, "x_plain": result.speed_ratio,
               "greedy_agreement": result.agreement if case.mode == "greedy" else None,
               "decode_seconds": result.decode_seconds}
        for key, other in (("x_stock_assisted", "transformers assisted"),
                           ("x_prompt_lookup", "transformers prompt lookup"), ("x_plain_compiled", PLAIN_COMPILED)):
            if other in seconds:
                row[key] = statistics.median(a / s for a, s in zip(seconds[other], seconds[result.name]))
        rows.append(row | profile(pair, method, inputs, plan.new_tokens))
    return {"workload": case.workload, "mode": case.mode, "batch_size": case.batch_size,
            "prompt_lengths": inputs["attention_mask"].sum(1).tolist(), "new_tokens": plan.new_tokens,
            "generate_kwargs": case.generate_kwargs, "rows": rows}


def run(plan: Plan, eagle_only: bool = False, compiled: bool = True) -> dict[str, Any]:
    pair = load_pair(plan, eagle_only)
    chosen = [(w, m) for w, m in CASES if w == "open"] if eagle_only else CASES
    cases = [Case(workload, mode, batch, eos_off=eagle_only)
             for workload, mode in chosen for batch in plan.prompt_lengths]
    makers = (EAGLE_METHODS if compiled else EAGLE_EAGER_METHODS) if eagle_only else METHODS
    measurements = [measure(pair, case, plan, makers) for case in cases]
    return {"command": COMMAND, "model": pair.description, "hardware": bench.hardware(),
            "prompts": "held-out text (reference corpus split never trained on), left-padded",
            "suffix_cache": "not used (--eagle)" if eagle_only else (
                f"warmed by {plan.num_earlier_requests} earlier requests ({pair.warm_cache.num_tokens} tokens of "
                "greedy output for other held-out prompts)"),
            "repeats": plan.repeats, "warmup": plan.warmup, "measurements": measurements,
            "targets": targets(measurements)}


def targets(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row_name, key, workloads, modes, batch_sizes, goal in TARGETS:
        for m in measurements:
            wanted = m["workload"] in workloads and (not modes or m["mode"] in modes) and m["batch_size"] in batch_sizes
            if not wanted:
                continue
            row = next((r for r in m["rows"] if r["name"] == row_name and key in r), None)
            if row is not None:
                found.append({"target": f"{row_name} {key.replace('_', ' ')} >= {goal}x ({m['workload']}, {m['mode']}, "
                                        f"batch {m['batch_size']})", "measured": row[key], "met": row[key] >= goal})
    return found


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def table(measurement: dict[str, Any]) -> str:
    compiled = any("x_plain_compiled" in r for r in measurement["rows"])
    headers = ["method", "decode tok/s", "x plain (paired)", *(["x plain + compile (paired)"] if compiled else []),
               "x stock assisted (paired)", "x stock prompt lookup (paired)", "tokens / target forward", "acceptance",
               "acceptance by draft position", "mean draft length", "drafting rounds", "analytic x plain",
               "greedy agreement"]
    rows = [[r["name"], f"{r['decode_tokens_per_s']:.1f}", f"{r['x_plain']:.2f}x",
             *([_cell(r, "x_plain_compiled", "{:.2f}x")] if compiled else []), _cell(r, "x_stock_assisted", "{:.2f}x"),
             _cell(r, "x_prompt_lookup", "{:.2f}x"), f"{r['tokens_per_target_forward']:.2f}",
             _cell(r, "acceptance_rate", "{:.0%}"),
             " ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])[:8]) or "-",
             _cell(r, "mean_draft_length", "{:.1f}"), _cell(r, "drafting_rounds", "{:.0%}"),
             _cell(r, "analytic_x_plain", "{:.2f}x"), _cell(r, "greedy_agreement", "{:.1%}")]
            for r in measurement["rows"]]
    return format_table(headers, rows, markdown=True)


def markdown(report: dict[str, Any]) -> str:
    parts = [f"Model: {report['model']}. Hardware: {report['hardware']['cpu']}, {report['hardware']['torch_threads']} "
             f"torch thread(s), torch {report['hardware']['torch']}, transformers {report['hardware']['transformers']}. "
             f"Prompts: {report['prompts']}. Suffix cache: {report['suffix_cache']}. Median of {report['repeats']} "
             f"interleaved repeats after "
             f"{report['warmup']} warm-up; ratios are medians of per-repeat paired ratios. From `{report['command']}`."]
    for m in report["measurements"]:
        parts.append(f"### {m['workload']}, {m['mode']}, batch {m['batch_size']} (prompts {m['prompt_lengths']}, "
                     f"{m['new_tokens']} new tokens, {m['generate_kwargs']})\n\n{table(m)}")
    rows = [[t["target"], f"{t['measured']:.2f}" + ("" if "forward" in t["target"] else "x"),
             "yes" if t["met"] else "**no**"] for t in report["targets"]]
    parts.append("### Targets\n\n" + format_table(["target", "measured", "met"], rows, markdown=True))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--eagle", action="store_true", help="only plain generate and EAGLE, open continuation")
    parser.add_argument("--no-compile", action="store_true",
                        help="with --eagle: leave out the compile_config rows (each compiles its graphs first)")
    args = parser.parse_args(argv)
    if not reference.has_assets():
        raise SystemExit(f"the reference pair is missing; create it with: {reference.TRAIN_COMMAND}")
    name = f"{NAME}_eagle" if args.eagle else NAME
    with bench.torch_threads(args.threads):
        report = run(QUICK if args.quick else FULL, args.eagle, compiled=not args.no_compile)
    text = markdown(report)
    print("\n" + text)
    out = output_root(args, ROOT)
    if out is not None:  # docs/speculative.md quotes the tables between its bench_speculative markers
        write_results(out, name, report, "# Speculative decoding benchmark\n\n" + text,
                      {"docs/speculative.md": text.rstrip("\n")})
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
