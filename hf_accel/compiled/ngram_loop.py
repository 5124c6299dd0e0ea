"""`ngram_generate` with `compile_config`: model-free speculation whose target forwards are compiled.

Each round every row's `NgramProposer` drafts from its own tokens and the shared `SuffixCache`; `DraftBudget`
chooses k as in the eager loop (0: the off-switch, a compiled plain decode step); rows with fewer candidates are
padded and only their own are accepted; one compiled verify forward scores `[rows, 1 + k]` tokens and rejected K/V
are rolled back by position (`speculation.py`). k varies between rounds without recompiling (a dynamic size of the
verify graph). Greedy output equals plain greedy `generate`. Sampling (temperature, top-k, top-p, min-p, applied
on the verify forward's logits) accepts candidates by lossless speculative sampling with one-hot draft
distributions, as the eager loop does.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..registry import attention_implementation
from ..runtime.attention import ATTENTION_NAME
from ..speculative.draft_budget import DraftBudget
from ..speculative.ngram_proposer import NgramProposer, NgramSettings
from ..speculative.stats import SpeculativeStats
from ..speculative.suffix_cache import Draft, SuffixCache
from .speculation import TargetRounds
from .step import generate_context


def compiled_ngram_generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                            config: GenerationConfig, settings: NgramSettings, shared: SuffixCache | None,
                            budget: DraftBudget, stats: SpeculativeStats, streamer: BaseStreamer | None,
                            warpers: tuple = ()) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """N-gram speculation with compiled target forwards, greedy or (with `config.do_sample`) sampled after `warpers`
    and verified by lossless speculative sampling (see the module docstring); returns what
    `generate` returns (`past_key_values` None: the pool lives for the call only). Each row's output is added to
    `shared` at the end."""
    target = TargetRounds(model, input_ids, attention_mask, config, budget.max_tokens, stats, streamer, warpers)
    proposers = [NgramProposer(settings, shared) for _ in target.prompts]
    contexts = [prompt.tolist() for prompt in target.prompts]  # each row's tokens so far, no padding
    with attention_implementation(model, ATTENTION_NAME), generate_context(target.rows.device, config, model.dtype):
        sequences = target.run(lambda: _round(target, proposers, contexts, budget))
    if shared is not None:
        for output in target.outputs.generated:
            shared.add(output)
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, past_key_values=None)


def _round(target: TargetRounds, proposers: list[NgramProposer], contexts: list[list[int]],
           budget: DraftBudget) -> None:
    """Draft per row, choose k, verify (or step plainly when k is 0), learn from the outcome."""
    started = time.perf_counter()
    _grow(contexts, target.outputs.generated, target.prompts)
    remaining = target.outputs.remaining
    drafts = [None if left <= 0 else proposer.propose(context, min(budget.max_tokens, left - 1))
              for proposer, context, left in zip(proposers, contexts, remaining)]
    generating = [d for d in drafts if d is not None]
    counts = _counts(drafts, budget.choose(generating, len(drafts)))
    k = max(counts)
    if k == 0:
        target.plain_round()
        accepted = [0] * len(drafts)
    else:
        accepted = target.verify_round(_padded(drafts, counts, k, target.positions.device),
                                       torch.tensor(counts, device=target.positions.device))
    budget.update(generating, [n for d, n in zip(drafts, accepted) if d is not None], k, len(drafts),
                  time.perf_counter() - started)


def _counts(drafts: list[Draft | None], k: int) -> list[int]:
    # candidates each row verifies: its draft's first (at most) k tokens
    return [0 if d is None else min(len(d.tokens), k) for d in drafts]


def _padded(drafts: list[Draft | None], counts: list[int], k: int, device: torch.device) -> torch.Tensor:
    # [rows, k] each row's candidates, padded with token 0 (never accepted: past the row's count)
    rows = [(list(d.tokens[:n]) if n else []) + [0] * (k - n) for d, n in zip(drafts, counts)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _grow(contexts: list[list[int]], generated: list[list[int]], prompts: list[torch.Tensor]) -> None:
    # append each row's tokens emitted since the last round
    for context, out, prompt in zip(contexts, generated, prompts):
        context.extend(out[len(context) - len(prompt) :])

