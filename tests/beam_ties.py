"""Near ties of beam search: how far apart the reference scored the beams two runs first kept differently.

Beam search keeps, at each step and for each prompt, the `num_beams` best candidates (a running beam plus one token)
by accumulated log-probability, and at the end returns the best of the last step's candidates, best first. Two runs
whose log-probs differ only by rounding keep the same beams, unless the reference's accumulated scores of the beams
they swap are within that rounding. A difference in a returned row may come from any earlier decision (a beam pruned
at step 13 can have branched off at token 8), so the tie is measured where the runs' kept beams first differ, not at
the row's first differing token.

`BeamSteps` is a logits processor (public generate API, returns the scores unchanged) that records each step's running
beams and log-probs; `beam_tie_gap` replays the reference's accumulated scores from them.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

History = tuple[int, ...]  # the generated tokens of a beam


class BeamSteps(LogitsProcessor):
    """Records each beam-search step: running beams `[prompts * num_beams, length]` and their processed next-token
    log-probs `[prompts * num_beams, vocab]`."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append((input_ids.clone(), scores.float().clone()))
        return scores


def candidate_scores(record: BeamSteps, num_prompts: int, prompt_len: int) -> list[list[dict[History, float]]]:
    """Per step, per prompt: the accumulated log-prob of every candidate (a running beam's history plus one token)."""
    steps, previous = [], [{(): 0.0} for _ in range(num_prompts)]
    for input_ids, log_probs in record.steps:
        num_beams = input_ids.shape[0] // num_prompts
        step: list[dict[History, float]] = [{} for _ in range(num_prompts)]
        seen: set[tuple[int, History]] = set()  # step 0 runs every beam on the prompt; generate expands the first
        for row, history in enumerate(map(tuple, input_ids[:, prompt_len:].tolist())):
            prompt = row // num_beams
            if (prompt, history) in seen:
                continue
            seen.add((prompt, history))
            accumulated = (previous[prompt][history] + log_probs[row]).tolist()
            step[prompt].update({history + (token,): score for token, score in enumerate(accumulated)})
        steps.append(step)
        previous = step
    return steps


def kept_beams(record: BeamSteps, num_prompts: int, prompt_len: int) -> list[list[set[History]]]:
    """Per step but the last, per prompt: the histories of the beams kept for the next step."""
    kept = []
    for input_ids, _ in record.steps[1:]:
        rows = input_ids[:, prompt_len:].tolist()
        num_beams = len(rows) // num_prompts
        kept.append([set(map(tuple, rows[p * num_beams : (p + 1) * num_beams])) for p in range(num_prompts)])
    return kept


def beam_tie_gap(reference: BeamSteps, got: BeamSteps, reference_rows: torch.Tensor, got_rows: torch.Tensor,
                 num_prompts: int, prompt_len: int) -> float:
    """The reference's accumulated log-prob gap across the first decision two beam searches make differently.

    At the first step where some prompt keeps different beams: max over a (kept only by the reference) and b (kept
    only by `got`) of score(a) - score(b); if every step kept the same beams, the same at the first rank where the
    returned rows `[prompts * num_return_sequences, prompt_len + new]` differ. 0 when nothing differs; inf when `got`
    kept a beam that was not a reference candidate (the runs are not comparable there).
    """
    scores = candidate_scores(reference, num_prompts, prompt_len)
    for step, (ours, theirs) in enumerate(zip(kept_beams(reference, num_prompts, prompt_len),
                                              kept_beams(got, num_prompts, prompt_len))):
        for prompt, (kept_ref, kept_got) in enumerate(zip(ours, theirs)):
            if kept_ref != kept_got:
                return _gap(scores[step][prompt], kept_ref - kept_got, kept_got - kept_ref)
    per_prompt = reference_rows.shape[0] // num_prompts
    for row, (ours, theirs) in enumerate(zip(reference_rows[:, prompt_len:].tolist(),
                                             got_rows[:, prompt_len:].tolist())):
        if ours != theirs:
            return _gap(scores[-1][row // per_prompt], {tuple(ours)}, {tuple(theirs)})
    return 0.0


def _gap(scores: dict[History, float], reference_only: set[History], got_only: set[History]) -> float:
    if not got_only <= scores.keys():
        return float("inf")
    return max(scores[h] for h in reference_only) - min(scores[h] for h in got_only)
