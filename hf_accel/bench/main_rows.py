"""The rows `hf-accel bench` compares: the stock options a user would reach for first, then hf_accel's best per
feature, each run the way it is fastest.

Stock: eager `DynamicCache` (transformers' default: the baseline every ratio is paired against) and `StaticCache` +
`compile_config` (transformers' fastest on CPU, where it compiles only when told: `CompileConfig._compile_all_devices`).
hf_accel: compiled generate with its paged cache and its int4 KV cache; EAGLE speculation (the
reference target's trained head, compiled) and n-gram speculation (no second model); the continuous-batching
`Engine` (compiled step); int8 and int4 weights (`quantize_model`). Every row decodes with EOS off
(`eos_token_id=None`: generate's min-length processor would keep the compiled loops eager), so all decode the same
number of tokens. `quick` keeps one row per kind (stock compile, compiled paged, n-gram, the Engine): a one-minute
run once kernels and graphs are cached. Not here: the sink cache, whose point is generation past a window far longer
than these runs (benchmarks/bench_sink.py), and the draft model (`--draft`), which on a CPU costs more than it saves
at the reference pair's sizes (benchmarks/bench_speculative.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import CompileConfig, PreTrainedModel, StaticCache

from ..kernels.build import is_built
from ..speculative.eagle import eagle_generate
from ..speculative.ngram import ngram_generate
from ..speculative.eagle_head import EagleHead
from .models import BenchModel
from .strategies import Strategy, engine_strategy, quantized_int4, weight_quantized

BASELINE = "DynamicCache"
STOCK_BEST = "StaticCache + compile"
PAGED = {"cache_implementation": "paged", "cache_config": {"block_size": 16}}
COMPILING = "compiling its decode step (first run only; seconds once cached)"
WARM_UP = "warm-up run (untimed)"


def compile_config(stock: bool) -> CompileConfig:
    """`fullgraph=True`; `stock` sets transformers' private switch that lets its own loop compile on CPU (a CPU user
    must); hf_accel's compiled loops compile on every device."""
    config = CompileConfig(fullgraph=True)
    if stock:
        config._compile_all_devices = True
    return config


def row(name: str, description: str, kwargs: Callable[[PreTrainedModel, int], dict[str, Any]], *,
        compiled_cache: bool = False, **fields: Any) -> Strategy:
    """A row with EOS off; `compiled_cache`: its K/V bytes are measured by one eager run of the same cache (the
    compiled loops hold the same blocks and return no cache)."""
    eager = (lambda model, max_len: {"eos_token_id": None, **kwargs(model, max_len)}) if compiled_cache else None
    ours = compile_config(stock=False)
    return Strategy(name, description, lambda model, max_len: {
        "eos_token_id": None, **kwargs(model, max_len), **({"compile_config": ours} if compiled_cache else {})},
        kv_kwargs=eager, **fields)


def main_rows(bench_model: BenchModel, quick: bool = False) -> tuple[tuple[Strategy, ...], list[str]]:
    """The rows (the baseline first) and notes on what was left out and why."""
    rows, notes = [*_stock_rows(), _paged_row()], []
    if quick:
        rows += [_ngram_row(), engine_strategy()]
        notes.append("--quick: the int4 KV, EAGLE and weight rows are left out (run without --quick for all)")
    else:
        rows.append(row("hf_accel int4 KV + compile", 'cache_implementation="quantized" (hf_accel, 4 bits) + '
                        "compile_config", lambda m, n: quantized_int4(m), compiled_cache=True, lossy=True,
                        gains="K/V in 4 bits", first_run=COMPILING))
        if bench_model.eagle_head is not None:
            rows.append(_eagle_row(bench_model.eagle_head))
        else:
            notes.append("left out: EAGLE (no trained head for this model; `hf-accel train-eagle` makes one)")
        rows += [_ngram_row(), engine_strategy()]
        if getattr(bench_model.model.config, "quantization_config", None) is None:
            rows += [_weight_row(bits) for bits in (8, 4)]
        else:  # a pre-quantized model (a GGUF file, a quantized checkpoint): its own weights are the baseline's
            notes.append("left out: the int8 / int4 weight rows (the model's weights are quantized already)")
    notes.append("not here: the sink cache (its point is generation far past its window: benchmarks/bench_sink.py) "
                 "and the eager caches (benchmarks/bench_paged.py, bench_compile.py)")
    return tuple(rows), notes


def _stock_rows() -> tuple[Strategy, Strategy]:
    stock = compile_config(stock=True)
    return (row(BASELINE, "transformers default, eager (the baseline)", lambda m, n: {}, first_run=WARM_UP),
            row(STOCK_BEST, "transformers StaticCache + compile_config: the fastest stock option on CPU",
                lambda m, n: {"past_key_values": StaticCache(config=m.config, max_cache_len=n),
                              "compile_config": stock}, first_run=COMPILING))


def _paged_row() -> Strategy:
    """The first hf_accel row: its first run also builds the C++ kernels, unless they are built already."""
    kernels = "" if is_built() else "building hf_accel's C++ kernels (first run only, about half a minute), then "
    return row("hf_accel paged + compile", 'cache_implementation="paged" + compile_config: hf_accel\'s compiled loop',
               lambda m, n: PAGED, compiled_cache=True, first_run=kernels + COMPILING)


def _eagle_row(head: EagleHead) -> Strategy:
    return row("hf_accel EAGLE + compile", "custom_generate=hf_accel.eagle_generate with the reference target's "
               "EAGLE head, paged cache + compile_config",
               lambda m, n: {**PAGED, "custom_generate": eagle_generate, "eagle_head": head,
                             "compile_config": compile_config(stock=False)},
               first_run="compiling its draft and verify steps (first run only; seconds once cached)")


def _ngram_row() -> Strategy:
    return row("hf_accel n-gram", "custom_generate=hf_accel.ngram_generate (drafts from the prompt, no second model), "
               "paged cache", lambda m, n: {**PAGED, "custom_generate": ngram_generate}, first_run=WARM_UP)


def _weight_row(bits: int) -> Strategy:
    layout, share = ("per output channel", "a quarter") if bits == 8 else ("in groups of 64", "an eighth")
    return row(f"hf_accel int{bits} weights", f"Linear weights int{bits} {layout} (hf_accel.quantize_model), "
               "DynamicCache", lambda m, n: {}, model_variant=weight_quantized(bits), lossy=True,
               first_run=f"quantizing the weights to int{bits}, then a {WARM_UP}",
               gains=f"Linear weights in {share} of fp32's bytes (decode at 0.5B+ parameters reads fewer bytes)")
