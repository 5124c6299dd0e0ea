"""One line per row of `hf-accel bench` that says what the numbers mean: speed against the baseline and against the
fastest stock option (both paired per repeat), whether the greedy tokens are the baseline's, what the row buys
besides speed, and the K/V it holds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .results import StrategyResult
from .strategies import Strategy

SAME = 0.05  # speed ratios within 5% of 1 read "as fast as": below the machine's run-to-run noise


def paired_ratio(result: StrategyResult, other: StrategyResult) -> float:
    """Median over repeats of other's decode time / result's, each pair from the same interleaved round."""
    return statistics.median(o / r for r, o in zip(result.decode_seconds, other.decode_seconds))


def speed_words(ratio: float, name: str) -> str:
    if abs(ratio - 1) <= SAME:
        return f"as fast as {name} ({ratio:.2f}x)"
    return f"{ratio:.2f}x {name}" + (" (faster)" if ratio > 1 else " (slower)")


def verdict(strategy: Strategy, result: StrategyResult, baseline: StrategyResult,
            stock_best: StrategyResult | None) -> str:
    """The row's verdict (see the module docstring)."""
    if result is baseline:
        return f"{result.name}: the baseline, transformers' default"
    parts = [speed_words(result.speed_ratio, baseline.name)]
    if stock_best is not None and result is not stock_best:
        parts.append(speed_words(paired_ratio(result, stock_best), stock_best.name))
    if result.agreement == 1.0:
        parts.append("same greedy tokens")
    elif strategy.lossy:
        parts.append(f"{result.agreement:.0%} of greedy tokens equal (lossy by design)")
    else:
        parts.append(f"{result.agreement:.0%} of greedy tokens equal (differs at near ties of the logits)")
    if strategy.gains:
        parts.append(strategy.gains)
    if result.kv_ratio is not None and result.kv_ratio < 1 - SAME:
        parts.append(f"K/V {result.kv_ratio:.2f}x the baseline's bytes")
    return f"{result.name}: " + "; ".join(parts)


def verdicts(strategies: Sequence[Strategy], results: Sequence[StrategyResult], stock_best: str | None) -> list[str]:
    """One verdict per row, in order; `stock_best` names the fastest stock row (None: none is compared)."""
    by_name = {r.name: r for r in results}
    best = by_name.get(stock_best) if stock_best is not None else None
    return [verdict(s, by_name[s.name], results[0], best) for s in strategies]
