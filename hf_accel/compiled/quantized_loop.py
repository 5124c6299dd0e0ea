"""`compiled_quantized_generate`: the decode loop `generate` runs when `compile_config` is given with
`cache_implementation="quantized", cache_config={"backend": "hf_accel", ...}` (selected by `route.py`).

The prompt is prefilled eagerly through the `QuantizedKVCache` generate built (so its sinks, groups and residual are
the eager cache's own), its state is copied into the static buffers of `quantized_rows.py`, and every later token is one
call of a compiled whole step (forward, attention over the full-precision slots and the dequantized history, token
choice) with the flush of a full residual done on the host between steps. The host loop, processors, stopping criteria,
streamer and outputs are `decode_loop.Decode`'s. Calls it cannot serve (sliding-window or hybrid layers, which the eager
cache keeps in transformers' own layers; beams) decode eagerly with a warning naming why; a cache object passed in is
left to transformers (`route.py` does not route such calls here).
On a GPU the step is not captured in a CUDA graph (`mode="reduce-overhead"` compiles in inductor's default mode):
the live history grows at every flush (a new graph per size) and its views are rebuilt (new addresses), so graphs
would cost more than they save.
"""

from __future__ import annotations

import warnings

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.quantized import QuantizedKVCache, QuantizedKVLayer
from ..registry import attention_implementation
from .decode_loop import Decode, stock_decoding, uncovered
from .quantized_rows import (
    ATTENTION_NAME,
    QuantizedRows,
    quantized_decode_step,
)
from .step import compiled_with, generate_context


def compiled_quantized_generate(model: PreTrainedModel, input_ids: torch.LongTensor,
                                logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList,
                                generation_config: GenerationConfig, hf_accel_streamer: BaseStreamer | None = None,
                                **model_kwargs) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy or sampled decoding with the quantized cache and a compiled whole-step graph (see the module
    docstring). Returns what `generate` returns; with `return_dict_in_generate` its `past_key_values` is None (the
    buffers live for the call only)."""
    reason = uncovered(model, generation_config, model_kwargs, (QuantizedKVCache,))
    cache = model_kwargs.get("past_key_values")
    if reason is None and not all(isinstance(layer, QuantizedKVLayer) for layer in cache.layers):
        reason = "the compiled quantized loop covers models whose every layer is full attention"
    if reason is not None:
        warnings.warn(f"hf_accel: compile_config is not applied ({reason}); generate decodes eagerly with "
                      "its hf_accel cache", UserWarning, stacklevel=3)
        return stock_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                              hf_accel_streamer, model_kwargs)
    return QuantizedDecode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                           hf_accel_streamer, model_kwargs.get("attention_mask"), cache).run()


class QuantizedDecode(Decode):
    """One compiled `generate` call with the quantized cache `cache` (fresh, built by generate)."""

    GRAMMAR_IN_GRAPH = False  # its step applies no bitmask: a grammar stays a host processor

    def __init__(self, model, input_ids, processors, criteria, config, streamer, attention_mask, cache):
        super().__init__(model, input_ids, processors, criteria, config, streamer, attention_mask, sink=False)
        self.cache, self.input_ids = cache, input_ids
        self.mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask

    def _generate(self) -> None:
        tokens = self._first_tokens(self._prefill_eagerly())
        # allocated after the prefill: its activations and the eager cache are not held beside the buffers
        rows = QuantizedRows(self.model, self.cache, self.input_ids.shape[0], self.sequences.shape[1])
        rows.take(self.cache, self.mask)
        step = compiled_with(self.config.compile_config, self.model, quantized_decode_step)
        positions = self.mask.sum(dim=-1)  # the next token's position: real tokens before it

        def one_step(last: torch.Tensor, warpers: tuple) -> torch.Tensor:
            nonlocal positions
            out, keys, values = step(self.model, last, positions, rows.step, warpers, self.do_sample,
                                     self.host_processors)
            rows.advance(keys, values)
            positions = positions + 1
            return out

        with attention_implementation(self.model, ATTENTION_NAME), \
                generate_context(self.input_ids.device, self.config, self.model.dtype):
            self._steps(tokens, one_step)

    def _prefill_eagerly(self) -> torch.Tensor:
        """The prompts through the model's own attention into the eager cache, as generate's first step ->
        `[rows, vocab]` fp32 logits of each row's last token."""
        positions = (self.mask.long().cumsum(-1) - 1).masked_fill(self.mask == 0, 0)  # generate's rule
        out = self.model(input_ids=self.input_ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()
