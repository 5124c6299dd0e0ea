"""Chains of drafts from a model that drafts one token per pass ("eagle3"'s head, "draft"'s draft model).

Rules:
- the first pass gives every speculating sequence its first draft; each further pass drafts one more token for the
  sequences still drafting, packed into one forward;
- a sequence stops drafting when its chain reaches the candidates the scheduler gave it room for, or after a draft
  the model gave less than `MIN_DRAFT_PROBABILITY` (its confidence predicts acceptance);
- drafts are the model's argmax: deterministic proposals, which the engine verifies losslessly for sampling requests
  too (`engine/commit.py`).
"""

from __future__ import annotations

from collections.abc import Callable

MIN_DRAFT_PROBABILITY = 0.2  # a chain ends after a draft the model is less sure of (eagle_generate's default)
# extend(j, going, keep, last) -> (drafts, sure): draft j + 1 of each sequence in `going` (indices into the chains),
# whose rows in the previous pass were `keep` and whose last drafts are `last`
Extend = Callable[[int, list[int], list[int], list[int]], tuple[list[int], list[bool]]]


def grow_chains(first: list[int], sure: list[bool], num_drafts: list[int], extend: Extend) -> list[list[int]]:
    """Each sequence's chain: its first draft `first[i]` (`sure[i]`: the model gave it `MIN_DRAFT_PROBABILITY`),
    then one `extend` pass per further position over the sequences still drafting, up to `num_drafts[i]` drafts."""
    chains = [[token] for token in first]
    going = list(range(len(chains)))  # sequences still drafting; entry n of `sure` is going[n]'s
    for j in range(1, max(num_drafts)):
        keep = [n for n, i in enumerate(going) if num_drafts[i] > j and sure[n]]
        if not keep:
            break
        going = [going[n] for n in keep]
        tokens, sure = extend(j, going, keep, [chains[i][-1] for i in going])
        for i, token in zip(going, tokens):
            chains[i].append(token)
    return chains
