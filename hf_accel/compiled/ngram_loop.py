"""`ngram_generate` with `compile_config`: model-free speculation whose target forwards are compiled.

Each round every row's drafter (`NgramDrafter`) drafts from its own tokens and the shared `SuffixCache`;
`DraftBudget` chooses k as in the eager loop (0: the off-switch, a compiled plain decode step); rows with fewer
candidates are padded and only their own are accepted; one compiled verify forward scores `[rows, 1 + k]` tokens and
rejected K/V are rolled back by position (`target_rounds.py`). k varies between rounds without recompiling (a
dynamic size of the verify graph). Greedy output equals plain greedy `generate`. Sampling (temperature, top-k, top-p,
min-p, applied on the verify forward's logits) accepts candidates by lossless speculative sampling with one-hot
draft distributions, as the eager loop does.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..speculative.decoding import GenerateCall
from ..speculative.draft_budget import DraftBudget
from ..speculative.ngram import NgramOptions, candidate_counts, padded_candidates, row_drafts
from ..speculative.ngram_drafter import NgramDrafter
from .target_rounds import TargetRounds


def compiled_ngram_generate(call: GenerateCall,
                            options: NgramOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """N-gram speculation with compiled target forwards, greedy or (with `do_sample`) sampled after the call's
    warpers and verified by lossless speculative sampling (see the module docstring); returns what `generate`
    returns. Each row's output is added to the options' `suffix_cache` at the end."""
    budget = options.budget()
    target = TargetRounds(call, budget.max_tokens, options.ngram_stats)
    drafters = options.drafters(len(target.prompts))
    contexts = [prompt.tolist() for prompt in target.prompts]  # each row's tokens so far, no padding
    output = target.run(lambda: _round(target, drafters, contexts, budget))
    options.add_outputs(target.outputs.generated)
    return output


def _round(target: TargetRounds, drafters: list[NgramDrafter], contexts: list[list[int]],
           budget: DraftBudget) -> None:
    """Draft per row, choose k, verify (or step plainly when k is 0), learn from the outcome."""
    started = time.perf_counter()
    _grow(contexts, target.outputs.generated, target.prompts)
    drafts = row_drafts(drafters, contexts, target.outputs.remaining, budget.max_tokens)
    generating = [d for d in drafts if d is not None]
    counts = candidate_counts(drafts, budget.choose(generating, len(drafts)))
    k = max(counts)
    if k == 0:
        target.plain_round()
        accepted = [0] * len(drafts)
    else:
        device = target.positions.device
        candidates = padded_candidates(drafts, counts, 0, device)
        accepted = target.verify_round(candidates, torch.tensor(counts, device=device))
    budget.update(generating, [n for d, n in zip(drafts, accepted) if d is not None], k, len(drafts),
                  time.perf_counter() - started)


def _grow(contexts: list[list[int]], generated: list[list[int]], prompts: list[torch.Tensor]) -> None:
    # append each row's tokens emitted since the last round
    for context, out, prompt in zip(contexts, generated, prompts):
        context.extend(out[len(context) - len(prompt) :])
