"""`compiled_generate`: the decode loop `generate` runs when `compile_config` is given with `cache_implementation=
"paged"` (selected by `route.py`; users never pass it themselves).

It follows transformers' `_sample` step for step (the same processors, stopping criteria, padding of finished rows,
streamer calls and outputs), with three differences that make it fast:
- K/V live in a static paged layout (`paged_rows.py`) attended in place by hf_accel's paged-attention op, the one the
  engine uses;
- the prompts are prefilled packed, without their padding, in one eager forward;
- every later token is one call of the compiled whole step (`step.py`): attention metadata, forward and token choice
  in one graph. Only the stopping criteria and the streamer run on the host between steps (and the processors, when
  the list holds one the graph cannot apply: `token_choice.py`).
Modes it does not cover fall back to transformers' own loop with the cache generate built, eagerly, with a warning
naming the reason (`uncovered`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..cache.kv_shape import FULL_AND_SLIDING, KVShape
from ..cache.paged import PagedCache
from ..cache.paged_config import PagedCacheConfig
from ..cache.sink import SinkCache
from ..cache.sink_config import SinkCacheConfig
from ..runtime.attention import ATTENTION_NAME, gathered_attention
from ..runtime.cuda_graphs import decode_attention
from ..runtime.host_argmax import argmax_rows
from ..kernels.custom_ops import paged_attention_kernel
from ..registry import attention_implementation
from .captured_step import CapturedStep, captures
from .paged_rows import PagedRows, unpadded_prompts
from .sink_rows import SinkRows
from .step import compiled_decode_step, generate_context, model_uncovered
from .token_choice import choose_tokens, graph_grammar, host_processing, needs_host_processors

SINK_BLOCK_SIZE = 16  # the sink cache's ring of blocks (its settings have no block size)


def compiled_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                      stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                      hf_accel_streamer: BaseStreamer | None = None,
                      **model_kwargs) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy or sampled decoding with a compiled whole-step graph over a static paged pool (see the module
    docstring). Returns what `generate` returns: `sequences` `[batch, prompt + new]`, or with
    `return_dict_in_generate` a `GenerateDecoderOnlyOutput` (its `past_key_values` is None: the pool lives for the
    call only)."""
    reason = uncovered(model, generation_config, model_kwargs)
    if reason is not None:
        warnings.warn(f"hf_accel: compile_config is not applied ({reason}); generate decodes eagerly with "
                      "its hf_accel cache", UserWarning, stacklevel=3)
        return stock_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                              hf_accel_streamer, model_kwargs)
    sink = isinstance(model_kwargs["past_key_values"], SinkCache)
    return Decode(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                  model_kwargs.get("attention_mask"), sink).run()


def uncovered(model: PreTrainedModel, config: GenerationConfig, model_kwargs: dict[str, Any],
              caches: tuple[type, ...] = (PagedCache, SinkCache)) -> str | None:
    """Why this call cannot run the compiled loop with a fresh cache of one of the types `caches`, or None when it
    can."""
    mode = config.get_generation_mode()
    cache = model_kwargs.get("past_key_values")
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"the compiled loop covers greedy decoding and sampling, not {mode.value}"
    if config.output_attentions or config.output_hidden_states:
        return "output_attentions / output_hidden_states are not returned by the compiled loop"
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds: the compiled loop starts from input_ids"
    if not isinstance(cache, caches) or cache.get_seq_length() != 0 or \
            getattr(cache, "prefix_store", None) is not None:
        names = " or ".join(kind.__name__ for kind in caches)
        return f"the compiled loop needs a fresh {names}, without a prefix store"
    return model_uncovered(model)


def stock_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                    model_kwargs):
    if generation_config.get_generation_mode() in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
        return GenerationMixin._beam_search(model, input_ids, logits_processor, stopping_criteria,
                                            generation_config, synced_gpus=False, **model_kwargs)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus=False, streamer=streamer, **model_kwargs)


class Decode:
    """One compiled `generate` call: `run()` prefills, then steps until every row stops."""

    GRAMMAR_IN_GRAPH = True  # whether its step can take a grammar's bitmask (`token_choice.graph_grammar`)

    def __init__(self, model, input_ids, processors, criteria, config, streamer, attention_mask, sink: bool):
        self.model, self.processors, self.criteria, self.config = model, processors, criteria, config
        self.sink = sink
        self.streamer, self.do_sample = streamer, bool(config.do_sample)
        rows, width = input_ids.shape
        self.sequences = input_ids.new_zeros((rows, max(config.max_length, width)))
        self.sequences[:, :width] = input_ids
        self.length = width  # columns of `sequences` filled
        self.prompts = unpadded_prompts(input_ids, attention_mask)
        self.host_processors = needs_host_processors(processors, self.do_sample) or config.output_scores or \
            config.output_logits
        self.grammar = None  # a grammar the step masks with (on the CPU: its bitmask is filled there)
        if self.GRAMMAR_IN_GRAPH and input_ids.device.type == "cpu" and not (config.output_scores or
                                                                             config.output_logits):
            self.grammar = graph_grammar(processors, self.do_sample)
            self.host_processors = self.host_processors and self.grammar is None
        self.process = host_processing(processors)  # the list's call without its per-step signature reads
        self.has_eos = any(hasattr(criterion, "eos_token_id") for criterion in criteria)
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def run(self) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        if self.streamer is not None:
            self.streamer.put(self.sequences[:, : self.length].cpu())
        try:
            self._generate()
        finally:
            if self.streamer is not None:
                self.streamer.end()
        return self._output()

    def _generate(self) -> None:
        """The prefill and the decode steps, over the paged layout."""
        rows, sinks = self._layout()
        kernel = paged_attention_kernel() if rows.device.type == "cpu" else None
        settings = generate_context(rows.device, self.config, self.model.dtype)
        with attention_implementation(self.model, ATTENTION_NAME), settings:
            self._decode(rows, sinks, self._prefill(rows, kernel or gathered_attention), kernel or decode_attention)

    def _layout(self) -> tuple[PagedRows, SinkRows | None]:
        """Every row's blocks (all of them; a ring for the sink cache) and the sinks, for this call."""
        lengths = [len(prompt) for prompt in self.prompts]
        max_tokens = max(lengths) + self.config.max_length - self.length
        if not self.sink:
            settings = PagedCacheConfig.from_dict(_settings(self.config.cache_config))
            return PagedRows(self.model, lengths, max_tokens, settings.block_size,
                             _block_limit(settings, self.model)), None
        sink = SinkCacheConfig.from_dict(_settings(self.config.cache_config))
        rows = PagedRows(self.model, lengths, max_tokens, SINK_BLOCK_SIZE,
                         ring_tokens=max(max(lengths), sink.window_length + 1))
        return rows, SinkRows(self.model, sink, rows)

    def _decode(self, rows: PagedRows, sinks: SinkRows | None, tokens: torch.Tensor, attend) -> None:
        """Commit `tokens` (the prefill's), then step until every row stops."""
        step = compiled_decode_step(self.config.compile_config, self.model)
        positions = rows.prompt_lengths.clone()
        graph: CapturedStep | None = None

        def one_step(last: torch.Tensor, warpers: tuple) -> torch.Tensor:
            nonlocal positions, graph
            if sinks is not None:
                sinks.capture(rows.kv, positions)

            def run(tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
                return step(self.model, tokens, at, rows.kv, rows.block_table, attend, warpers, self.do_sample,
                            self.host_processors, sinks, self._allowed())

            if graph is None and captures(rows.device, self.config.compile_config.mode):
                graph = CapturedStep(run, last, positions)
            out = run(last, positions) if graph is None else graph(last, positions)
            positions = positions + 1
            return out

        self._steps(tokens, one_step)

    def _steps(self, tokens: torch.Tensor, one_step: Callable[[torch.Tensor, tuple], torch.Tensor]) -> None:
        """Commit `tokens` (the prefill's), then call `one_step(last tokens [rows], in-graph warpers)` (next tokens,
        or logits for the host processors) until every row stops. The first step runs dynamo's guards (picking or
        compiling the graph); the later ones, whose inputs differ only in values, skip them."""
        warpers = () if self.host_processors or self.grammar is not None else tuple(self.processors)
        unfinished = self._commit(tokens, torch.ones_like(tokens, dtype=torch.bool))
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):  # restored on exit
            guarded = True
            while bool(unfinished.any()) and self.length < self.sequences.shape[1]:
                out = one_step(self.sequences[:, self.length - 1], warpers)
                unfinished = self._commit(self._choose(out) if self.host_processors else out, unfinished)
                if guarded:
                    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
                    guarded = False

    def _prefill(self, rows: PagedRows, attend) -> torch.Tensor:
        inputs = rows.prefill(self.prompts, attend)
        out = self.model(input_ids=inputs.tokens, position_ids=inputs.positions, use_cache=False,
                         logits_to_keep=inputs.keep, hf_accel_step=inputs.attention)
        return self._first_tokens(out.logits[0].float())

    def _first_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's choice from its last logits `[rows, vocab]` fp32."""
        return self._choose(logits) if self.host_processors or self.grammar is not None else choose_tokens(
            logits, tuple(self.processors), self.do_sample)

    def _allowed(self) -> torch.Tensor | None:
        """The bitmask of the tokens each row's grammar allows next, for the step to mask with (None: no grammar in
        the step); each row gained one token since the grammar last saw them (the prefill's choice, or a step's)."""
        return None if self.grammar is None else self.grammar.allowed(self.sequences[:, : self.length], appended=True)

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The host path: generate's processors on the tokens so far, then argmax or a draw (as `_sample`)."""
        scores = self.process(self.sequences[:, : self.length], logits)
        if self.config.output_scores:
            self.scores.append(scores)
        if self.config.output_logits:
            self.logits.append(logits)
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return argmax_rows(scores)

    def _commit(self, tokens: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
        """Append a step's tokens (finished rows get the pad token), stream them, and return which rows go on."""
        if self.has_eos:
            tokens = torch.where(unfinished, tokens, self.config._pad_token_tensor)
        self.sequences[:, self.length] = tokens
        self.length += 1
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        scores = self.scores[-1] if self.scores else None
        return unfinished & ~self.criteria(self.sequences[:, : self.length], scores)

    def _output(self) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        sequences = self.sequences[:, : self.length]
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences, scores=tuple(self.scores) if self.config.output_scores else None,
            logits=tuple(self.logits) if self.config.output_logits else None, past_key_values=None)


def _settings(cache_config: object) -> dict | None:
    return dict(cache_config) if isinstance(cache_config, dict) else None


def _block_limit(settings: PagedCacheConfig, model: PreTrainedModel) -> int | None:
    """The user's fixed pool size in blocks (`num_blocks`, or `max_memory` over a block's bytes), if any."""
    if settings.max_memory is None:
        return settings.num_blocks
    dtype = next(model.parameters()).dtype
    per_block = KVShape.from_config(model.config, FULL_AND_SLIDING).bytes_per_token(dtype) * settings.block_size
    return max(settings.max_memory // per_block, 1)
