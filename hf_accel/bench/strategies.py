"""The rows `hf-accel bench` compares: `Strategy` records (how to generate), the default table `STRATEGIES`, and the
rows added for a model's draft and Medusa heads and for the continuous-batching engine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, StaticCache

from ..cache.kv_shape import config_head_dim
from ..engine.engine import Engine
from ..engine.sampling_params import SamplingParams
from ..quant.quantizer import WeightOnlyConfig, quantize_model
from ..speculative.draft import draft_generate
from ..speculative.medusa import medusa_generate
from .models import BenchModel


def quantized_int4(model: PreTrainedModel) -> dict[str, Any]:
    """generate kwargs for hf_accel's int4 KV cache: groups of 64 (or the head dimension when smaller), residual 128,
    the default 4 full-precision sinks."""
    settings = {"backend": "hf_accel", "nbits": 4, "group_size": math.gcd(64, config_head_dim(model.config)),
                "residual_length": 128}
    return {"cache_implementation": "quantized", "cache_config": settings}


def weight_quantized(bits: int) -> Callable[[PreTrainedModel], PreTrainedModel]:
    """A `Strategy.model_variant`: a copy of the model whose Linear layers are hf_accel's weight-only int8 (per output
    channel) or int4 (groups of 64) modules (`quantize_model`); lm_head, embeddings, and any Linear whose in_features
    the packing does not divide (4 for int8, 64 for int4) stay float."""
    step = 4 if bits == 8 else 64

    def variant(model: PreTrainedModel) -> PreTrainedModel:
        keep = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % step]
        return quantize_model(model, WeightOnlyConfig(bits=bits, modules_to_not_convert=keep))
    return variant


@dataclass(frozen=True, slots=True)
class Strategy:
    """One row of the benchmark: `generate_kwargs(model, max_cache_len)` gives the extra `generate` kwargs;
    `model_variant`, when set, builds the model this row runs on from the benchmarked one (once, untimed); `run`,
    when set, replaces `generate`: `run(model, inputs, new_tokens)` returns an object with `sequences` (prompt
    columns then exactly `new_tokens` greedy tokens) and `past_key_values` (None when it keeps no cache).
    `lossy`: its tokens may differ from the baseline's by design (quantized K/V or weights, a sink window);
    `kv_kwargs`, when set: generate kwargs of one untimed run whose cache holds the K/V this row holds (a compiled
    loop returns none); `gains`: what the row buys besides speed (`hf-accel bench`'s verdicts say it); `first_run`:
    what its first (warm-up) run does that later runs do not, for the progress bar (kernels, compiling)."""

    name: str
    description: str
    generate_kwargs: Callable[[PreTrainedModel, int], dict[str, Any]] = lambda model, max_len: {}
    model_variant: Callable[[PreTrainedModel], PreTrainedModel] | None = None
    run: Callable[[PreTrainedModel, dict[str, torch.Tensor], int], Any] | None = None
    lossy: bool = False
    kv_kwargs: Callable[[PreTrainedModel, int], dict[str, Any]] | None = None
    gains: str = ""
    first_run: str = ""


# Add a strategy (quantized cache, sink cache, speculative decoding, ...) by adding an entry; the first is the baseline.
STRATEGIES: tuple[Strategy, ...] = (
    Strategy("DynamicCache", "transformers default (baseline)", lambda model, max_len: {}),
    Strategy(
        "StaticCache",
        "transformers preallocated cache (best stock option without torch.compile)",
        lambda model, max_len: {"past_key_values": StaticCache(config=model.config, max_cache_len=max_len)},
    ),
    Strategy(
        "hf_accel paged",
        'cache_implementation="paged", block_size 16',
        lambda model, max_len: {"cache_implementation": "paged", "cache_config": {"block_size": 16}},
    ),
    Strategy(
        "hf_accel quantized int4",
        'cache_implementation="quantized", backend "hf_accel", 4 bits, group 64 (or the head dim), residual 128, '
        '4 full-precision sinks',
        lambda model, max_len: quantized_int4(model),
    ),
    Strategy(
        "hf_accel sink",
        'cache_implementation="sink", window = half the longest row (at least 64 tokens), 4 sinks',
        lambda model, max_len: {"cache_implementation": "sink",
                                "cache_config": {"window_length": max(max_len // 2, 64), "num_sink_tokens": 4}},
    ),
    Strategy("hf_accel int8 weights", "Linear weights int8 per output channel (hf_accel.quant), DynamicCache",
             lambda model, max_len: {}, model_variant=weight_quantized(8)),
    Strategy("hf_accel int4 weights", "Linear weights int4 in groups of 64 (hf_accel.quant), DynamicCache",
             lambda model, max_len: {}, model_variant=weight_quantized(4)),
)


def strategies_for(bench_model: BenchModel, batch_size: int) -> tuple[tuple[Strategy, ...], list[str]]:
    """`STRATEGIES`, plus the speculative rows the model has what for: hf_accel's draft-model decoding and Medusa
    heads (any batch size) and, at batch size 1 only, stock assisted decoding with the same draft; and notes on what
    was left out and why."""
    rows, notes = list(STRATEGIES), []
    draft, heads = bench_model.draft, bench_model.medusa_heads
    rows.append(engine_strategy())
    if draft is not None and batch_size == 1:
        rows.append(Strategy("transformers assisted (draft)", "stock assisted decoding, assistant_model=the draft",
                             lambda model, max_len: {"assistant_model": draft}))
    if draft is not None:
        rows.append(Strategy("hf_accel draft", "custom_generate=hf_accel.draft_generate, draft_model=the draft",
                             lambda model, max_len: {"custom_generate": draft_generate, "draft_model": draft}))
    if heads is not None:
        rows.append(Strategy("hf_accel medusa", "custom_generate=hf_accel.medusa_generate, the reference heads",
                             lambda model, max_len: {"custom_generate": medusa_generate, "medusa_heads": heads}))
    if batch_size != 1 and draft is not None:
        notes.append("left out at this batch size: transformers assisted decoding supports batch size 1 only (run "
                     "with --batch-size 1)")
    return tuple(rows), notes


def engine_strategy() -> Strategy:
    """A `Strategy` running each row's unpadded prompt through one `Engine` per model, greedy, EOS ignored."""
    engines: dict[int, Engine] = {}

    def run(model: PreTrainedModel, inputs: dict[str, torch.Tensor], new_tokens: int) -> Any:
        engine = engines.get(id(model))
        if engine is None:
            engine = engines[id(model)] = Engine(model)
        ids, mask = inputs["input_ids"], inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
        prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        new = torch.tensor([out.token_ids for out in outputs], device=ids.device)
        return SimpleNamespace(sequences=torch.cat([ids, new], dim=1), past_key_values=None)

    return Strategy("hf_accel Engine", "hf_accel.Engine (continuous batching, paged attention), same prompts",
                    run=run, first_run="starting the engine: compiling its step (first run only; seconds once "
                                       "cached)")
