"""The target's side of compiled speculative decoding (`ngram_generate`, `draft_generate`, `eagle_generate`,
`medusa_generate` with `compile_config`).

Each model gets a static paged pool for the call (`paged_rows.py`, with room for `lookahead` tokens past a row's
budget: a verify forward writes K/V for every candidate it scores). Row r's state is two numbers on the device:
`positions[r]`, where its last emitted token goes (that token's K/V is not written yet), and `last[r]`, that token. A
round verifies `[rows, 1 + k]` tokens (the last token and k candidates per row, padded) in one compiled forward
(`step.verify_step`), keeps each row's greedy prefix match plus the target's next token (`verify.greedy_accept`), and
advances `positions[r]` by the tokens kept: the rejected candidates' K/V stay in the pool and the next round
overwrites them (rollback in place, no copy). A round with k = 0 is one compiled plain decode step. Finished rows
stay in the batch (fixed shapes: no recompilation) with frozen positions; their tokens are dropped (`RowTokens`).
On a GPU with a `compile_config` mode that asks for CUDA graphs (the default "reduce-overhead"), both forwards are
captured per input shape once it recurs, and replayed (`captured_step.CapturedSteps`).

Covered: greedy decoding without logits processors, and (for drafters whose loops pass `sampling=True` to
`speculation_uncovered`) sampling after transformers' temperature / top-k / top-p / min-p warpers, stopped by
`max_length` / `max_new_tokens` and EOS, any batch size and left padding, sliding-window and hybrid models, a
streamer at batch 1; `speculation_uncovered` names what is not (the caller then decodes eagerly, with a warning).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..kernels.custom_ops import paged_attention_kernel, paged_tree_attention_kernel
from ..cache.paged_config import PagedCacheConfig
from ..registry import attention_implementation
from ..runtime.attention import ATTENTION_NAME, gathered_attention
from ..runtime.cuda_graphs import decode_attention
from ..speculative.decoding import GenerateCall
from ..speculative.stats import SpeculativeStats
from ..speculative.verify import Verdict, greedy_accept, speculative_sample
from .captured_step import CapturedSteps, captures
from .paged_rows import PagedRows, unpadded_prompts
from .spec_rows import RowTokens
from .step import (compiled_decode_step, compiled_verify_features_step, compiled_verify_step, generate_context,
                   model_uncovered)
from .token_choice import choose_tokens, needs_host_processors

_MODEL_INPUTS = ("attention_mask", "past_key_values", "use_cache", "cache_position", "position_ids", "logits_to_keep")


def speculation_uncovered(models: list[PreTrainedModel], call: GenerateCall, sampling: bool = False) -> str | None:
    """The first reason why compiled speculation cannot run `call` with `models` (the target, and a draft model), or
    None when it can; `sampling`: the drafter's loop verifies sampled calls losslessly (deterministic candidates, or
    candidates with their distributions), so sampling with the warpers the graph applies is covered too."""
    config = call.generation_config
    mode = config.get_generation_mode()
    covered = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE) if sampling else (GenerationMode.GREEDY_SEARCH,)
    if mode not in covered:
        return f"compiled speculation here covers {[m.value for m in covered]}, not {mode.value}"
    if needs_host_processors(call.logits_processor, mode == GenerationMode.SAMPLE):
        names = [type(p).__name__ for p in call.logits_processor]
        return f"logits processors {names} are applied by the eager loop only"
    other = [type(c).__name__ for c in call.stopping_criteria
             if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if other:
        return f"stopping criteria {other} are checked by the eager loop only"
    if config.output_scores or config.output_logits or config.output_attentions or config.output_hidden_states:
        return "scores, logits, attentions and hidden states are returned by the eager loop only"
    unknown = sorted(k for k, v in call.model_kwargs.items() if v is not None and k not in _MODEL_INPUTS)
    if unknown:
        return f"model inputs {unknown} are passed by the eager loop only"
    return next((reason for reason in map(model_uncovered, models) if reason is not None), None)


@dataclass(slots=True)
class Attends:
    """The attention rule per kind of forward: the CPU kernel for all (its tree variant for trees); elsewhere (a GPU)
    the gathered one for the eager prefill and the fixed-shape one (`n` queries per row, traceable whole, with its
    tree rule) for the compiled steps."""

    prefill: object
    decode: object
    verify: object
    tree: object  # a speculative tree's forwards (a `[rows, n, m]` tree mask as a last argument)

    @classmethod
    def for_device(cls, device: torch.device) -> Attends:
        kernel = paged_attention_kernel() if device.type == "cpu" else None
        tree = paged_tree_attention_kernel() if kernel is not None else None
        return cls(kernel or gathered_attention, kernel or decode_attention, kernel or decode_attention,
                   tree or decode_attention)


def pool_for(model: PreTrainedModel | nn.Module, prompts: list[torch.Tensor], max_new_tokens: int, lookahead: int,
             config: GenerationConfig, kv_config: PretrainedConfig | None = None) -> PagedRows:
    """A static pool for `prompts` plus `max_new_tokens`, with room for rounds of up to `lookahead` candidates past
    a row's budget; block size from `cache_config` when the call named the paged cache; `kv_config`: the config
    giving the K/V shape when it is not `model.config`."""
    settings = config.cache_config if config.cache_implementation == "paged" else None
    block_size = PagedCacheConfig.from_dict(dict(settings) if isinstance(settings, dict) else None).block_size
    lengths = [len(p) for p in prompts]
    # a row's last round may move it up to lookahead + 1 past its budget; frozen there, a finished row's later
    # rounds write lookahead + 1 more
    return PagedRows(model, lengths, max(lengths) + max_new_tokens + 2 * (lookahead + 1), block_size,
                     config=kv_config)


def prefill(model: PreTrainedModel, rows: PagedRows, prompts: list[torch.Tensor], attend,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed prefill of `prompts` into `rows`' pool -> `[rows, vocab]` fp32 logits of each row's last token, and
    with `feature_layers` the hidden states they index in `output_hidden_states` at every packed token, concatenated
    (`[1, total, len(feature_layers) * H]`; else None)."""
    inputs = rows.prefill(prompts, attend)
    out = model(input_ids=inputs.tokens, position_ids=inputs.positions, use_cache=False, logits_to_keep=inputs.keep,
                output_hidden_states=bool(feature_layers), hf_accel_step=inputs.attention)
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1) if feature_layers else None
    return out.logits[0].float(), features


class TargetRounds:
    """The target's pool, the rows' positions / last tokens and outputs, and its two kinds of round.

    Args:
        call: the `generate` call (target, left-padded prompts and their mask, generation config, streamer, which
            gets each emitted token at batch 1). With `do_sample` its processors are the in-graph warpers
            (`token_choice.IN_GRAPH_WARPERS`): tokens are sampled, and candidates accepted by lossless speculative
            sampling (against the distributions they were drawn from, or one-hot for deterministic ones;
            `verify_round`).
        lookahead: the most candidates a round verifies.
        stats: counters to add the rounds to (None: a new record).
        feature_layers: indices into the target's `output_hidden_states` whose states the prefill and every verify
            forward also return (an EAGLE head's input), kept in `features` with the round's `verdict`.
    """

    def __init__(self, call: GenerateCall, lookahead: int, stats: SpeculativeStats | None,
                 feature_layers: tuple[int, ...] = ()):
        model, input_ids, config = call.model, call.input_ids, call.generation_config
        if call.streamer is not None and input_ids.shape[0] > 1:
            raise ValueError("`streamer` supports batch size 1 only")
        self.model, self.input_ids, self.config, self.streamer = model, input_ids, config, call.streamer
        self.stats = stats if stats is not None else SpeculativeStats()
        self.do_sample, self.feature_layers = bool(config.do_sample), feature_layers
        self.warpers = tuple(call.logits_processor) if self.do_sample else ()
        self.prompts = unpadded_prompts(input_ids, call.model_kwargs.get("attention_mask"))
        eos = config._eos_token_tensor
        self.outputs = RowTokens.empty(len(self.prompts), config.max_length - input_ids.shape[1],
                                       [] if eos is None else eos.reshape(-1).tolist())
        self.rows = pool_for(model, self.prompts, self.outputs.max_new_tokens, lookahead, config)
        self.attends = Attends.for_device(self.rows.device)
        self.decode, self.verify = self._forwards()
        self.positions = self.rows.prompt_lengths.clone()  # [rows] where each row's last token goes
        self.last = torch.zeros_like(self.positions)  # [rows] each row's last emitted token
        self.previous = torch.stack([p[-1] for p in self.prompts])  # [rows] the token before it (at positions - 1)
        # with feature_layers: the last forward's features (prefill: [1, total, F], packed; verify: [rows, 1 + k, F])
        self.features: torch.Tensor | None = None
        self.verdict: Verdict | None = None  # the last verify round's

    def _forwards(self) -> tuple[CapturedSteps, CapturedSteps]:
        """The compiled decode and verify forwards over the pool, captured in CUDA graphs where the mode asks; they
        hold what they read, not `self` (no reference cycle keeping the pool and graphs alive)."""
        compile_config, model = self.config.compile_config, self.model
        decode = compiled_decode_step(compile_config, model)
        verify = (compiled_verify_features_step if self.feature_layers else compiled_verify_step)(compile_config, model)
        captured = captures(self.rows.device, compile_config.mode)
        return (CapturedSteps(functools.partial(decode_forward, decode, model, self.rows, self.attends.decode,
                                                self.warpers, self.do_sample, False), captured),
                CapturedSteps(functools.partial(verify_forward, verify, model, self.rows, self.attends.verify,
                                                self.feature_layers, self.do_sample), captured))

    def run(self, one_round: Callable[[], None], started: Callable[[], None] | None = None,
            contexts: Iterable[AbstractContextManager] = ()) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        """Prefill, `started()` (when given), then `one_round()` until every row stops, with the target's attention
        over its pool, the drafter's `contexts` and the compile settings entered (the streamer ends however the loop
        ends) -> what `generate` returns: `[rows, width + longest output]` sequences, or with
        `return_dict_in_generate` a `GenerateDecoderOnlyOutput` (`past_key_values` None: the pools live for the call
        only)."""
        with contextlib.ExitStack() as stack:
            for entered in (attention_implementation(self.model, ATTENTION_NAME), *contexts,
                            generate_context(self.rows.device, self.config, self.model.dtype)):
                stack.enter_context(entered)
            try:
                self._start()
                if started is not None:
                    started()
                while not self.outputs.is_done:
                    one_round()
            finally:
                if self.streamer is not None:
                    self.streamer.end()
        self.stats.num_new_tokens += sum(len(out) for out in self.outputs.generated)
        pad = self.config._pad_token_tensor  # None only when no EOS is set: no row is padded then
        sequences = self.outputs.sequences(self.input_ids, 0 if pad is None else int(pad))
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(sequences=sequences, past_key_values=None)

    def _start(self) -> None:
        if self.streamer is not None:
            self.streamer.put(self.input_ids.cpu())
        logits, self.features = prefill(self.model, self.rows, self.prompts, self.attends.prefill, self.feature_layers)
        self.last = choose_tokens(logits, self.warpers, self.do_sample)
        for row, token in enumerate(self.last.tolist()):
            self._emit(row, [token])

    def plain_round(self) -> None:
        """One compiled decode step: every row gains one token (k = 0, the off-switch)."""
        active = self._active()
        tokens = self.decode(self.last, self.positions)
        for row, token in enumerate(tokens.tolist()):
            if active[row]:
                self._emit(row, [token])
        self.positions = self.positions + torch.tensor(active, device=self.positions.device)
        self.previous, self.last = self.last, tokens
        empty = torch.zeros(len(active), dtype=torch.long)
        self.stats.record_round(0, empty, torch.tensor(active, dtype=torch.long), torch.tensor(active),
                                row_depths=empty)

    def verify_round(self, candidates: torch.Tensor, num_candidates: torch.Tensor | None,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
        """Verify `candidates` `[rows, k]` (row r's first `num_candidates[r]` are real; None: all) in one compiled
        forward; emit and advance. When sampling, `draft_probs` `[rows, k, vocab]` are the distributions the
        candidates were drawn from (None: deterministic candidates). Returns each row's accepted candidates (0 for
        finished rows)."""
        active = self._active()
        tokens = torch.cat([self.last[:, None], candidates], dim=1)  # [rows, 1 + k]
        verdict = self.verdict = self._decide(tokens, candidates, num_candidates, draft_probs)
        accepted, emitted = verdict.num_accepted.tolist(), verdict.tokens.tolist()
        kept = [self._emit(r, emitted[r][: n + 1]) if active[r] else 0 for r, n in enumerate(accepted)]
        moved = torch.tensor(active, device=self.positions.device) * verdict.num_emitted
        self.positions = self.positions + moved
        self.previous = tokens.gather(1, verdict.num_accepted[:, None]).squeeze(1)
        self.last = verdict.tokens.gather(1, verdict.num_accepted[:, None]).squeeze(1)
        self.stats.record_round(candidates.shape[1], verdict.num_accepted.cpu(), torch.tensor(kept),
                                torch.tensor(active), row_depths=None if num_candidates is None else
                                num_candidates.cpu())
        return [n if on else 0 for n, on in zip(accepted, active)]

    def _decide(self, tokens: torch.Tensor, candidates: torch.Tensor, num_candidates: torch.Tensor | None,
                draft_probs: torch.Tensor | None) -> Verdict:
        """One compiled verify forward of `tokens` `[rows, 1 + k]`, then greedy prefix match, or lossless speculative
        sampling against `draft_probs` (one-hot where None: deterministic candidates)."""
        result = self.verify(tokens, self.positions)
        if self.feature_layers:
            result, self.features = result
        if not self.do_sample:
            return greedy_accept(candidates, result, num_candidates)
        scores = result.reshape(-1, result.shape[-1])  # [rows * (1 + k), vocab]
        for warper in self.warpers:
            scores = warper(None, scores)  # these warpers never read input_ids
        probs = torch.softmax(scores, dim=-1).view(result.shape)
        if draft_probs is None:
            draft_probs = torch.zeros_like(probs[:, 1:]).scatter_(2, candidates[..., None], 1.0)  # [rows, k, vocab]
        if num_candidates is not None:  # padding positions: q = 0, so the token after a row's drafts comes from p
            real = torch.arange(candidates.shape[1], device=candidates.device) < num_candidates[:, None]
            draft_probs = draft_probs * real[..., None]
        return speculative_sample(candidates, draft_probs, probs, num_drafts=num_candidates)

    def _active(self) -> list[bool]:
        return [not done for done in self.outputs.finished]

    def _emit(self, row: int, tokens: list[int]) -> int:
        kept = self.outputs.emit(row, tokens)
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor(tokens[:kept]))
        return kept


def decode_forward(step: Callable, model: PreTrainedModel, rows: PagedRows, attend, warpers: tuple, do_sample: bool,
                   return_logits: bool, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The compiled decode `step` (`step.decode_step`) of `tokens` `[rows]` at `positions` over `rows`' pool ->
    `[rows]` next tokens, or with `return_logits` `[rows, vocab]` logits. Bound to all but the last two arguments
    (`functools.partial`), a model's forward for `CapturedSteps`."""
    return step(model, tokens, positions, rows.kv, rows.block_table, attend, warpers, do_sample, return_logits)


def verify_forward(step: Callable, model: PreTrainedModel, rows: PagedRows, attend, feature_layers: tuple[int, ...],
                   do_sample: bool, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | tuple:
    """The compiled verify `step` of `tokens` `[rows, 1 + k]` from `positions` over `rows`' pool -> `[rows, 1 + k]`
    greedy next tokens, or when sampling `[rows, 1 + k, vocab]` logits; with `feature_layers`, and the features
    `[rows, 1 + k, F]` they index. Bound like `decode_forward`."""
    args = (model, tokens, positions, rows.kv, rows.block_table, attend)
    return step(*args, feature_layers, do_sample) if feature_layers else step(*args, do_sample)
