"""Speculative decoding inside the engine (vLLM's `v1/spec_decode/`): the `Proposer` protocol and its factory
(`proposer.py`), one proposer per method (`draft_proposer.py`, `eagle_proposer.py`, `medusa_proposer.py`,
`suffix_proposer.py` for "ngram" and "suffix"), the chains the model-drafting ones grow (`draft_chain.py`),
`SpeculativeConfig` and `SpecDecodeStats`. Verifying the candidates is part of the step's commit (`engine/commit.py`).

Words: a *proposer* proposes candidates for sequences; a *candidate* is one proposed token; a *round* is one
propose + verify of a sequence in a step.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from .draft_proposer import DraftProposer
from .eagle_proposer import EagleProposer
from .medusa_proposer import MedusaProposer
from .proposer import NullProposer, Proposer
from .spec_decode_stats import SpecDecodeStats
from .speculative_config import SpeculativeConfig
from .suffix_proposer import SuffixProposer

__all__ = ["NullProposer", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "make_proposer"]


def make_proposer(config: SpeculativeConfig | None, model: PreTrainedModel) -> Proposer:
    """The proposer of `config.method` for the served `model` (`NullProposer` when `config` is None); ValueError when
    `config.model` was made for another model."""
    if config is None:
        return NullProposer()
    if config.method == "medusa":
        config.model.check_compatible(model)
        return MedusaProposer(config.model, config.num_candidates)
    if config.method == "eagle3":
        return EagleProposer(config.model, model, config.num_candidates)
    if config.method == "draft":
        return DraftProposer(config.model, model, config.num_candidates)
    return SuffixProposer(config)
