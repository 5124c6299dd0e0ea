"""What the chain loops (`draft_generate`, `ngram_generate`, `eagle_generate`) refuse, by name, before they start."""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from ..cache.kv_shape import check_decoder_only
from .decoding import GenerateCall

_IGNORED_MODEL_KWARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep")


def check_call(call: GenerateCall, caller: str) -> None:
    """Raise `ValueError` naming the option for anything the chain loop `caller` does not support."""
    model, config, input_ids, model_kwargs = call.model, call.generation_config, call.input_ids, call.model_kwargs
    check_decoder_only(model.config, caller, "model")
    for name in ("num_beams", "num_beam_groups"):
        if (getattr(config, name, 1) or 1) > 1:
            raise ValueError(f"{caller} does not support beam search (`{name}` > 1)")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name):
            raise ValueError(f"{caller} does not support `{name}`")
    if model_kwargs.get("past_key_values") is None:
        raise ValueError(f"{caller} needs a cache (`use_cache=False` is not supported)")
    if not model._supports_logits_to_keep():
        raise ValueError(f"{caller} needs a `model` whose forward takes `logits_to_keep`")
    if call.streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("`streamer` supports batch size 1 only")
    if input_ids.shape[0] > 1:
        check_full_attention(model, "model", caller)
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _IGNORED_MODEL_KWARGS)
    if unknown:
        raise ValueError(f"{caller} does not support the model inputs {unknown}")


def check_draft_model(call: GenerateCall, draft_model: PreTrainedModel) -> None:
    """`draft_generate`'s checks: the call's, then the draft model's."""
    check_call(call, "draft_generate")
    check_draft_vocabulary(call.model, draft_model)
    if not draft_model._supports_logits_to_keep():
        raise ValueError("draft_generate needs a `draft_model` whose forward takes `logits_to_keep`")
    if call.input_ids.shape[0] > 1:
        check_full_attention(draft_model, "draft_model", "draft_generate")


def check_draft_vocabulary(model: PreTrainedModel, draft_model: PreTrainedModel) -> None:
    """`draft_model` is a decoder-only LM predicting the same tokens as `model`."""
    check_decoder_only(draft_model.config, "draft_generate", "draft_model")
    vocab = model.get_output_embeddings().out_features
    draft_vocab = draft_model.get_output_embeddings().out_features
    if vocab != draft_vocab:
        raise ValueError(f"`draft_model` predicts {draft_vocab} tokens, the model {vocab}: they must share a "
                         "vocabulary")


def check_full_attention(model: PreTrainedModel, name: str, caller: str) -> None:
    """Holes in the cache layout count toward a sliding window (it is enforced over cache slots): batches are only
    exact when every layer attends to the whole history."""
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{caller} at batch size > 1 needs full-attention layers; `{name}` has layer types "
                         f"{sorted(set(layer_types))} (use batch size 1 for sliding-window models)")
