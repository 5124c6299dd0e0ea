"""Quality and speed checks of the fine-tune path: each side's greedy decoding of the same prompts, timed
interleaved in one process (`hf_accel.bench.timing.time_interleaved`), compared with the first side (plain
`generate` on the float model).

    sides = [Side("float", merged), Side("int8 + Medusa", quantized, heads)]
    speeds = compare_speed(sides, prompts, new_tokens=64, repeats=2)   # prompts: [n, prompt_len] ids

Rules: batch 1 (each prompt is its own call), `eos_token_id=None` and `min_new_tokens` so every side makes
exactly `new_tokens` tokens; one warm-up round, then `repeats` rounds in which every prompt runs on every side in
turn (the order reversed every other round), so load on a shared machine hits all sides alike. A side's speed is
its new tokens over its total seconds (prefill included); its ratio is the median over (repeat, prompt) of baseline
seconds / its seconds. Agreement is the fraction of generated positions equal to the baseline's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..bench.results import token_agreement
from ..bench.timing import time_interleaved
from ..reference.evaluate import perplexity
from ..speculative.medusa import medusa_generate
from ..speculative.medusa_heads import MedusaHeads
from ..speculative.stats import SpeculativeStats


@dataclass(slots=True)
class Side:
    """One way of decoding: a model, with Medusa heads or without (plain `generate`)."""

    name: str
    model: PreTrainedModel
    medusa_heads: MedusaHeads | None = None


@dataclass(slots=True)
class SpeedResult:
    """What one side measured (seconds per call, over repeats x prompts)."""

    name: str
    tokens_per_s: float
    speed_ratio: float
    agreement: float
    tokens_per_step: float | None
    seconds: list[float] = field(default_factory=list)

    def as_row(self) -> dict[str, object]:
        """The side's numbers for a table (no raw timings)."""
        return {"side": self.name, "tokens_per_s": round(self.tokens_per_s, 1),
                "speed_ratio": round(self.speed_ratio, 3), "greedy_agreement": round(self.agreement, 4),
                "tokens_per_step": None if self.tokens_per_step is None else round(self.tokens_per_step, 2)}


def greedy_tokens(side: Side, prompt: torch.Tensor, new_tokens: int,
                  stats: SpeculativeStats | None = None) -> torch.Tensor:
    """`[1, new_tokens]` greedy tokens of `side` after `prompt` `[1, prompt_len]`."""
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "eos_token_id": None,
               "pad_token_id": 0}
    if side.medusa_heads is not None:
        options.update(custom_generate=medusa_generate, medusa_heads=side.medusa_heads, medusa_stats=stats)
    with torch.inference_mode():
        out = side.model.generate(prompt.to(side.model.device), attention_mask=torch.ones_like(prompt), **options)
    return out[:, prompt.shape[1]:].cpu()


def compare_speed(sides: list[Side], prompts: torch.Tensor, new_tokens: int = 64,
                  repeats: int = 2) -> list[SpeedResult]:
    """Time every side on every prompt (see the module docstring); the first side is the baseline."""
    if not sides or prompts.dim() != 2 or prompts.shape[0] == 0:
        raise ValueError("need at least one side and a non-empty [n, prompt_len] `prompts`")
    if new_tokens < 1 or repeats < 1:
        raise ValueError(f"`new_tokens` and `repeats` must be >= 1, got {new_tokens}, {repeats}")
    stats = {side.name: SpeculativeStats() for side in sides}  # warm-up included: greedy repeats every step exactly

    def call(key: tuple[int, int]) -> tuple[float, torch.Tensor]:  # key: (prompt index, side index)
        side = sides[key[1]]
        started = time.perf_counter()
        tokens = greedy_tokens(side, prompts[key[0]][None], new_tokens, stats[side.name])
        return time.perf_counter() - started, tokens

    rows = range(prompts.shape[0])
    timings = time_interleaved([(row, index) for row in rows for index in range(len(sides))], call, repeats)
    # per side, in (repeat, prompt) order: the pairs the baseline ratio is taken over
    seconds = {side.name: [timings.seconds[(row, index)][repeat] for repeat in range(repeats) for row in rows]
               for index, side in enumerate(sides)}
    tokens = {side.name: torch.cat([timings.outputs[(row, index)] for row in rows]) for index, side in enumerate(sides)}
    base = sides[0].name
    return [SpeedResult(
        name=side.name,
        tokens_per_s=new_tokens * len(seconds[side.name]) / sum(seconds[side.name]),
        speed_ratio=statistics.median(b / s for b, s in zip(seconds[base], seconds[side.name])),
        agreement=token_agreement(tokens[side.name], tokens[base]),
        tokens_per_step=stats[side.name].tokens_per_forward if side.medusa_heads is not None else None,
        seconds=[round(s, 4) for s in seconds[side.name]],
    ) for side in sides]


def held_out_perplexity(model: PreTrainedModel, rows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) of `model` on `rows` `[n, seq_len]` (see `reference.evaluate`)."""
    return perplexity(model, rows.to(model.device), batch_size=batch_size)


__all__ = ["Side", "SpeedResult", "compare_speed", "greedy_tokens", "held_out_perplexity"]
