"""The `hf_accel Engine` row of `hf-accel bench`: the same prompts through the continuous-batching engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from transformers import PreTrainedModel

from .engine.engine import Engine
from .engine.sampling_params import SamplingParams


def engine_strategy():
    """A `bench.Strategy` running each row's unpadded prompt through one `Engine` per model, greedy, EOS ignored."""
    from .bench import Strategy  # bench imports this module

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
                    lambda model, max_len: {}, run=run)
