"""What a strategy measured (`StrategyResult`) and how it is summed up: K/V bytes a cache holds, block waste of a
paged cache, greedy token agreement with the baseline, and the comparison table `hf-accel bench` prints."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import QuantizedCache
from transformers.cache_utils import Cache

from ..cache.paged import PagedCache
from ..cache.quantized import QuantizedKVCache
from ..cache.sink import SinkCache
from ..display import format_bytes, format_table
from .strategies import Strategy


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


def summarize(
    strategies: Sequence[Strategy], seconds: dict[str, list[float]], outputs: dict[str, Any],
    inputs: dict[str, torch.Tensor], new_tokens: int,
) -> list[StrategyResult]:
    """One `StrategyResult` per strategy, compared with `strategies[0]`, from its decode seconds (one per measured
    repeat) and its last output (`sequences` `[rows, prompt_len + new_tokens]`, `past_key_values`); raises
    `RuntimeError` when a median decode time is not above zero (prefill time swamped it)."""
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


def results_table(results: Sequence[StrategyResult], markdown: bool = False) -> str:
    """One row per strategy: decode tok/s, speed and KV ratios to the baseline, KV bytes, greedy agreement."""
    base = results[0].name
    headers = ["strategy", "decode tok/s", f"x {base} (paired)", "KV bytes", f"KV x {base}", "greedy agreement"]
    rows = [
        [r.name, f"{r.decode_tokens_per_s:.1f}", f"{r.speed_ratio:.2f}x",
         "-" if r.kv_bytes is None else format_bytes(r.kv_bytes, decimals=1),
         "-" if r.kv_ratio is None else f"{r.kv_ratio:.2f}x", f"{100 * r.agreement:.1f}%"]
        for r in results
    ]
    return format_table(headers, rows, markdown=markdown)
