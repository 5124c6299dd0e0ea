"""`SpeculativeConfig`: how the engine speculates, with vLLM's names (`--speculative-config` takes the same JSON).

    Engine(model, tokenizer, speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=8))
    Engine(model, tokenizer, speculative=SpeculativeConfig(method="medusa", model=heads))
    Engine(model, tokenizer, speculative=SpeculativeConfig(method="eagle3", model=reference.load_head("eagle", model)))
    Engine(model, tokenizer, speculative=SpeculativeConfig(method="draft", model=draft_model))

Methods (one proposer class each, `hf_accel/engine/spec_decode/*_proposer.py`):
- "ngram": prompt lookup, vLLM's name: candidates continue an earlier occurrence of the sequence's last tokens in its
  own prompt and output (`prompt_lookup_min` to `prompt_lookup_max` tokens matched);
- "suffix": prompt lookup plus one `SuffixCache` of the outputs of earlier requests, shared by every request of the
  engine (SuffixDecoding; vLLM's "suffix"): each decode drafts from whichever source expects more accepted tokens;
- "medusa": `model` is a `MedusaHeads` for the served model; plain-greedy requests verify a top-1 chain of the heads;
- "eagle3": `model` is an `EagleHead` for the served model (vLLM's EAGLE-3 layer: `hf-accel export` writes it for
  vLLM too); every request verifies a chain the head drafts on the target's own features;
- "draft": `model` is a small causal LM over the served model's vocabulary (vLLM's "draft_model"); every request
  verifies a chain it drafts over a K/V pool of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from ...cache.settings import check_int
from ...speculative.eagle_head import EagleHead
from ...speculative.medusa_heads import MedusaHeads
from ...speculative.ngram_drafter import NgramSettings

METHODS = ("ngram", "suffix", "medusa", "eagle3", "draft")
MODEL_FREE = ("ngram", "suffix")
CHAIN_MODELS = ("eagle3", "draft")  # a model drafts chains, one pass per draft: speculation pays at small batches only
DEFAULT_MODEL_FREE_TOKENS = 8  # candidates per step for "ngram" / "suffix" when `num_speculative_tokens` is None
DEFAULT_EAGLE_TOKENS = 3  # the longest chain "eagle3" / "draft" draft when `num_speculative_tokens` is None
DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS = 24
# "eagle3", "draft": every draft is a pass of the head or draft model, so it pays only for the smallest batches
# (docs/serving.md, "Speculative decoding"): chains of 3 at one decoding sequence, 2 at two, 1 at three, none from
# four on
DEFAULT_EAGLE_BATCH_TOKENS = 6


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding in the engine (see the module docstring for the methods).

    Args:
        method: one of "ngram", "suffix", "medusa", "eagle3", "draft".
        num_speculative_tokens: most candidates a decoding sequence verifies in one step; default: every head
            (medusa), 3 (eagle3, draft), 8 (ngram, suffix; drafts are also cut where the match's counts make them
            unlikely).
        model: the `MedusaHeads` ("medusa") or `EagleHead` ("eagle3") of the served model, or a draft model
            ("draft": a `PreTrainedModel` with the served model's vocabulary); None for the model-free methods.
        prompt_lookup_max: longest tail of the sequence matched ("ngram", "suffix"); default 23.
        prompt_lookup_min: shortest tail whose match may propose ("ngram", "suffix"); default 1.
        max_speculative_batch_tokens: speculate in a step only while (decoding sequences) x (1 + candidates) stays
            within this many tokens: the candidates per sequence shrink as the batch grows, and below one the step
            decodes plainly (a large batch is already compute-bound: candidates would only slow it down); None:
            24, or 6 for "eagle3" and "draft".
        suffix_decoding_max_cached_requests: outputs the "suffix" cache keeps (the oldest quarter is dropped when
            full); None keeps all.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: MedusaHeads | EagleHead | PreTrainedModel | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    max_speculative_batch_tokens: int | None = None
    suffix_decoding_max_cached_requests: int | None = 10000

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"`method` must be one of {', '.join(map(repr, METHODS))}, got {self.method!r}")
        if self.num_speculative_tokens is not None:
            check_int("num_speculative_tokens", self.num_speculative_tokens, 1, "a positive int or None")
        if self.max_speculative_batch_tokens is not None:
            check_int("max_speculative_batch_tokens", self.max_speculative_batch_tokens, 1, "a positive int or None")
        if self.suffix_decoding_max_cached_requests is not None:
            check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 1,
                      "a positive int or None")
        if self.method == "medusa":
            self._check_medusa()
        elif self.method in CHAIN_MODELS:
            self._check_chain_model()
        else:
            self._check_model_free()

    def _check_medusa(self) -> None:
        if not isinstance(self.model, MedusaHeads):
            raise TypeError(f"`model` must be a hf_accel.MedusaHeads for method 'medusa', got "
                            f"{type(self.model).__name__}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > self.model.num_heads:
            raise ValueError(f"`num_speculative_tokens` must be at most the heads' {self.model.num_heads}, got "
                             f"{self.num_speculative_tokens}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(f"`{name}` is for the methods {', '.join(map(repr, MODEL_FREE))}, not 'medusa'")

    def _check_chain_model(self) -> None:
        wanted = EagleHead if self.method == "eagle3" else PreTrainedModel
        if not isinstance(self.model, wanted):
            what = "a hf_accel.EagleHead" if self.method == "eagle3" else "a transformers PreTrainedModel (a draft LM)"
            raise TypeError(f"`model` must be {what} for method {self.method!r}, got {type(self.model).__name__}")
        check_model_options({name: getattr(self, name) for name in ("prompt_lookup_max", "prompt_lookup_min")},
                            self.method)

    def _check_model_free(self) -> None:
        if self.model is not None:
            raise ValueError(f"`model` must be None for method {self.method!r} (it proposes from tokens alone), got "
                             f"{type(self.model).__name__}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, "a positive int or None")
        if self.lookup_min > self.lookup_max:
            raise ValueError(f"`prompt_lookup_min` ({self.lookup_min}) must be at most `prompt_lookup_max` "
                             f"({self.lookup_max})")

    @property
    def num_candidates(self) -> int:
        """Candidates per step at most: `num_speculative_tokens`, or the method's default."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.method == "medusa":
            return self.model.num_heads
        return DEFAULT_EAGLE_TOKENS if self.method in CHAIN_MODELS else DEFAULT_MODEL_FREE_TOKENS

    @property
    def batch_tokens(self) -> int:
        """`max_speculative_batch_tokens`, or the method's default."""
        if self.max_speculative_batch_tokens is not None:
            return self.max_speculative_batch_tokens
        return DEFAULT_EAGLE_BATCH_TOKENS if self.method in CHAIN_MODELS else DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS

    @property
    def lookup_max(self) -> int:
        default = NgramSettings().max_depth - 1
        return default if self.prompt_lookup_max is None else self.prompt_lookup_max

    @property
    def lookup_min(self) -> int:
        return 1 if self.prompt_lookup_min is None else self.prompt_lookup_min

    def ngram_settings(self) -> NgramSettings:
        """Matching rules of the model-free methods: tails of up to `prompt_lookup_max` tokens."""
        return NgramSettings(max_depth=self.lookup_max + 1)


def check_model_options(options: dict, method: str) -> None:
    """`ValueError` / `TypeError` for fields of "eagle3" or "draft" (`method`) a `SpeculativeConfig` would refuse,
    checked before its head or draft model is loaded (`options`: fields other than `method` and `model`)."""
    for name in ("prompt_lookup_max", "prompt_lookup_min"):
        if options.get(name) is not None:
            raise ValueError(f"`{name}` is for the methods {', '.join(map(repr, MODEL_FREE))}, not {method!r}")
    if options.get("num_speculative_tokens") is not None:
        check_int("num_speculative_tokens", options["num_speculative_tokens"], 1, "a positive int or None")
    if options.get("max_speculative_batch_tokens") is not None:
        check_int("max_speculative_batch_tokens", options["max_speculative_batch_tokens"], 1, "a positive int or None")
