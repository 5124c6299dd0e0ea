"""What a request may ask of an engine: checks made when it is added, in the caller's thread, so a request the engine
could never serve is refused with a ValueError naming the argument instead of failing (or lingering) later."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from .errors import ContextLengthExceededError
from .sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """One engine's bounds: vocabulary size, longest sequence, most sequences at once, KV cache size in tokens."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_tokens: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits) -> None:
    """ValueError for an empty prompt, ids outside the vocabulary, a prompt plus `max_tokens` too long
    (`ContextLengthExceededError`), more samples (`n`) than `max_num_seqs`, or samples that together cannot fit in
    the KV cache."""
    if not prompt_token_ids:
        raise ValueError("`prompt` must hold at least one token")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= limits.vocab_size:
        raise ValueError(f"`prompt` token ids must be in [0, {limits.vocab_size}), got {prompt_token_ids[:8]}...")
    total = len(prompt_token_ids) + params.max_tokens
    if total > limits.max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(prompt_token_ids)} in the prompt, {params.max_tokens} for `max_tokens`). "
            "Please reduce the length of the prompt or `max_tokens`.")
    if params.n > limits.max_num_seqs:
        raise ValueError(f"`n` must be at most max_num_seqs={limits.max_num_seqs}, got {params.n}")
    if params.n * total > limits.kv_cache_tokens:
        raise ValueError(f"`n` x (prompt + `max_tokens`) = {params.n} x {total} tokens exceeds the KV cache's "
                         f"{limits.kv_cache_tokens} tokens; lower `n` or `max_tokens`")


def context_length(model: PreTrainedModel) -> int:
    """The model's context length: its (text) config's `max_position_embeddings`; ValueError when it has none."""
    text = model.config.get_text_config(decoder=True)
    length = getattr(text, "max_position_embeddings", None)
    if not isinstance(length, int):
        raise ValueError("the model config has no `max_position_embeddings`; pass `max_model_len` explicitly")
    return length
