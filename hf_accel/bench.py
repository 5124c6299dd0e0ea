"""Benchmark helpers: a benchmark model, prompts, a table of cache strategies, and same-process interleaved timing.

Rules every measurement here follows (shared by `hf-accel bench` and `benchmarks/`):
- all strategies run in one process on one model, interleaved (the order alternates every repeat), after warm-up;
- decode time = time(generate N new tokens) - time(generate 1 new token), so prefill is excluded;
- a strategy's decode time is the median over repeats; its speed ratio to the baseline (the first strategy) is the
  median of per-repeat ratios, each taken within one repeat, so slow drift in machine load cancels out.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel, QuantizedCache
from transformers.cache_utils import Cache

from .bench_inputs import (  # noqa: F401  re-exported: benchmarks and tests use them as bench.*
    RANDOM_MODEL_NOTE, BenchModel, describe_model, load_bench_model, make_prompts, random_llama, text_prompts,
)
from .bench_strategies import (  # noqa: F401  re-exported: benchmarks and tests use them as bench.*
    STRATEGIES, Strategy, quantized_int4, strategies_for, weight_quantized,
)
from .cache.paged import PagedCache
from .cache.quantized import QuantizedKVCache
from .cache.sink import SinkCache
from .display import format_bytes, format_table

def kv_bytes(cache: Cache) -> int | None:
    """Bytes held for K/V: an hf_accel cache's `memory_bytes()` (a paged cache's allocated pools; a quantized cache's
    codes, scales and residuals; a sink cache's window buffers and sinks), None for transformers' `QuantizedCache`
    (its backend's tensors are opaque) and for runs that return no cache (the engine), else the sum of every
    layer's keys and values."""
    if isinstance(cache, (PagedCache, QuantizedKVCache, SinkCache)):
        return cache.memory_bytes()
    if cache is None or isinstance(cache, QuantizedCache):
        return None
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def block_waste(cache: PagedCache) -> float:
    """1 - tokens stored / (used blocks * block_size) over all block-table groups; stored tokens include left padding
    (not tokens evicted from a sliding window), shared blocks count once."""
    stored, capacity = 0, 0
    for group in cache.groups:
        tables, size = group.tables, group.tables.block_size
        fill = {}  # block id -> tokens it holds (block j of a row holds positions j*block_size ..)
        for row in tables.rows:
            for j, block in enumerate(row, start=tables.first_block):
                fill[block] = min(size, tables.num_tokens - j * size) - max(tables.first_token - j * size, 0)
        stored += sum(fill.values())
        capacity += tables.pool.num_used_blocks * size
    return 1.0 - stored / capacity if capacity else 0.0


def run_generate(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], strategy: Strategy, new_tokens: int, **kwargs: Any
) -> tuple[float, Any]:
    """Seconds taken and the output (with `sequences` and `past_key_values`) for exactly `new_tokens`: the strategy's
    own `run` when it has one, else `generate` with its kwargs."""
    if strategy.run is not None:
        start = time.perf_counter()
        output = strategy.run(model, inputs, new_tokens)
        return time.perf_counter() - start, output
    max_len = inputs["input_ids"].shape[1] + new_tokens
    options = {"do_sample": False, **kwargs, **strategy.generate_kwargs(model, max_len)}
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True, **options
        )
    return time.perf_counter() - start, output


def token_agreement(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions where `tokens` equals `reference` (same shape: `[rows, new_tokens]`)."""
    return (tokens == reference).float().mean().item()


@dataclass(slots=True)
class StrategyResult:
    """What one strategy measured; speeds in generated tokens per second over all rows, bytes of K/V."""

    name: str
    decode_tokens_per_s: float
    speed_ratio: float  # median over repeats of (baseline decode time / this decode time) within the repeat
    kv_bytes: int | None  # None where it cannot be measured (see `kv_bytes`)
    kv_ratio: float | None  # kv_bytes / baseline kv_bytes
    agreement: float  # greedy token agreement with the baseline over generated tokens
    decode_seconds: list[float]  # one per measured repeat

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_strategies(
    model: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    new_tokens: int,
    strategies: Sequence[Strategy] = STRATEGIES,
    repeats: int = 3,
    warmup: int = 1,
    on_step: Callable[[str], None] | None = None,
    progress: bool = True,
) -> list[StrategyResult]:
    """Time decode of every strategy, interleaved, and compare with `strategies[0]`; `on_step` after each run pair,
    a `tqdm.auto` bar over the runs unless `progress=False`. A strategy with a `model_variant` runs on that variant of
    `model`, built once before any timing."""
    if new_tokens < 2:
        raise ValueError(f"`new_tokens` must be at least 2 to measure decode, got {new_tokens}")
    models = {s.name: model if s.model_variant is None else s.model_variant(model) for s in strategies}
    seconds: dict[str, list[float]] = {s.name: [] for s in strategies}
    outputs: dict[str, Any] = {}
    bar = tqdm(total=(warmup + repeats) * len(strategies), desc="compare", unit="run", leave=False, disable=not progress)
    for repeat in range(warmup + repeats):
        order = strategies if repeat % 2 == 0 else list(reversed(strategies))
        for strategy in order:
            prefill_time, _ = run_generate(models[strategy.name], inputs, strategy, 1)
            total_time, outputs[strategy.name] = run_generate(models[strategy.name], inputs, strategy, new_tokens)
            if repeat >= warmup:
                seconds[strategy.name].append(total_time - prefill_time)
            bar.update()
            if on_step is not None:
                on_step(strategy.name)
    bar.close()
    return _summarize(strategies, seconds, outputs, inputs, new_tokens)


def _summarize(
    strategies: Sequence[Strategy], seconds: dict[str, list[float]], outputs: dict[str, Any],
    inputs: dict[str, torch.Tensor], new_tokens: int,
) -> list[StrategyResult]:
    rows, prompt_len = inputs["input_ids"].shape
    noisy = [name for name, times in seconds.items() if statistics.median(times) <= 0]
    if noisy:
        raise RuntimeError(f"Decode time of {noisy} is not above prefill time: the machine is too noisy for "
                           f"{new_tokens} new tokens; generate more tokens or use more repeats")
    base = strategies[0].name
    base_bytes = kv_bytes(outputs[base].past_key_values)
    base_tokens = outputs[base].sequences[:, prompt_len:]
    results = []
    for strategy in strategies:
        name, output = strategy.name, outputs[strategy.name]
        num_bytes = kv_bytes(output.past_key_values)
        results.append(StrategyResult(
            name=name,
            decode_tokens_per_s=rows * (new_tokens - 1) / statistics.median(seconds[name]),
            speed_ratio=statistics.median(b / s for b, s in zip(seconds[base], seconds[name])),
            kv_bytes=num_bytes,
            kv_ratio=None if num_bytes is None or not base_bytes else num_bytes / base_bytes,
            agreement=token_agreement(output.sequences[:, prompt_len:], base_tokens),
            decode_seconds=seconds[name],
        ))
    return results


@contextlib.contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """Run the block with `num` torch CPU threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def hardware() -> dict[str, Any]:
    """CPU model (from /proc/cpuinfo where present), torch threads, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def results_table(results: Sequence[StrategyResult], markdown: bool = False) -> str:
    """One row per strategy: decode tok/s, speed and KV ratios to the baseline, KV bytes, greedy agreement."""
    base = results[0].name
    headers = ["strategy", "decode tok/s", f"x {base} (paired)", "KV bytes", f"KV x {base}", "greedy agreement"]
    rows = [
        [r.name, f"{r.decode_tokens_per_s:.1f}", f"{r.speed_ratio:.2f}x",
         "-" if r.kv_bytes is None else format_bytes(r.kv_bytes, decimals=1), "-" if r.kv_ratio is None else f"{r.kv_ratio:.2f}x",
         f"{100 * r.agreement:.1f}%"]
        for r in results
    ]
    return format_table(headers, rows, markdown=markdown)
