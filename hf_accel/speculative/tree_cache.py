"""Verifying a candidate tree through a transformers `Cache`: 4-D masks per layer type, and keeping the accepted path.

The tree's nodes are appended to the cache by the verification forward like any other tokens; afterwards
`keep_tree_path` moves the accepted nodes' K/V next to the prefix and drops the rest. Supported caches:
`DynamicCache` (full and sliding-window layers; sliding layers record their past so rejected nodes can be dropped)
and hf_accel's `PagedCache` (through `PagedCache.keep_tokens`). In a batch every row keeps its own path, in as many
slots as the longest one; what a shorter path leaves are holes the caller masks out (`RaggedBatch`): per-row paths
need a `DynamicCache` of full-attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import (
    Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs,
)

from ..cache.paged import PagedCache
from .tree import VerifiedTree, tree_attention_mask

MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers sharing one attention mask: their type, the first layer of that type, and its window (None: full)."""

    layer_type: str
    first_layer: int
    sliding_window: int | None


def layer_groups(config: PreTrainedConfig) -> list[LayerGroup]:
    """One `LayerGroup` per attention layer type of `config`, in first-appearance order."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    groups: dict[str, LayerGroup] = {}
    for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if layer_type not in MASKED_LAYER_TYPES:
            raise ValueError(f"tree verification (medusa_generate, eagle_generate's `eagle_tree`) supports layer "
                             f"types {MASKED_LAYER_TYPES}; the model has {layer_type!r}")
        groups.setdefault(layer_type, LayerGroup(layer_type, index, kwargs.get("sliding_window")))
    return list(groups.values())


def prepare_tree_cache(cache: Cache) -> None:
    """Check that tree verification can prune `cache` (else `ValueError` naming `past_key_values`) and make its
    sliding-window layers keep rejected nodes until `keep_tree_path` drops them."""
    if isinstance(cache, PagedCache):
        cache.activate_past_recording()  # its sliding layers keep rejected nodes until `keep_tokens` crops them
        return
    if type(cache) is not DynamicCache or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        raise ValueError("tree verification (medusa_generate, eagle_generate's `eagle_tree`) supports "
                         "`past_key_values` of type DynamicCache (the default) or "
                         f"hf_accel's PagedCache (cache_implementation='paged'), got {type(cache).__name__}")
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
            _trim_window(layer)


def tree_masks(
    cache: Cache, groups: list[LayerGroup], tree: VerifiedTree, valid: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive 4-D masks `[batch, 1, num_nodes, kv_length]` (0 attend, dtype min masked) for the verification
    forward: one tensor when the model has one layer type, else a dict keyed by layer type (as hybrid models accept).

    `valid`: `[batch, width]` bool, which cache slots hold real tokens (not left padding or holes); the root sits in
    the last slot, `width - 1`, and the cache holds the slots before it.
    """
    root = valid.shape[1] - 1
    masks = {}
    for group in groups:
        kv_length, kv_offset = cache.get_mask_sizes(tree.num_nodes, group.first_layer)
        positions = torch.arange(kv_offset, kv_offset + kv_length - tree.num_nodes, device=valid.device)
        positions = torch.where(valid[:, positions], positions, -1)  # [batch, num_prefix]
        allowed = tree_attention_mask(tree, positions, root, group.sliding_window)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
        masks[group.layer_type] = additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def keep_tree_path(cache: Cache, num_nodes: int, kept: torch.Tensor) -> None:
    """After a verification forward appended `num_nodes` tree tokens, keep nodes `kept` `[batch, n]` right after
    the prefix, in that order: row r's slot j then holds node `kept[r, j]` (the accepted path from the root, then
    any node for the slots a row leaves as holes). Batch size > 1 needs a `DynamicCache` of full-attention layers."""
    if kept.shape[1] == 1 or bool((kept == torch.arange(kept.shape[1], device=kept.device)).all()):
        # every row kept the root alone or a chain: in place
        _drop(cache, num_nodes - kept.shape[1])
        return
    if isinstance(cache, PagedCache):
        if kept.shape[0] != 1:
            raise ValueError("keeping per-row tree paths needs a DynamicCache (`past_key_values`)")
        cache.keep_tokens(cache.get_seq_length() - num_nodes, kept[0].tolist())
        return
    for layer in cache.layers:
        # keys, values: [batch, kv_heads, seq, head_dim]; the last num_nodes along seq are the tree's. Kept nodes
        # move to the front of the tree's slots (gathered first, so overlapping moves are safe)
        index = kept.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        for states in (layer.keys, layer.values):
            tree_part = states[:, :, -num_nodes:]
            tree_part[:, :, : kept.shape[1]] = tree_part.gather(2, index)
    _drop(cache, num_nodes - kept.shape[1])


def _drop(cache: Cache, count: int) -> None:
    # the last `count` slots hold rejected nodes
    if isinstance(cache, PagedCache):
        cache.crop(-count)
        return
    for layer in cache.layers:
        if count:
            layer.keys, layer.values = layer.keys[:, :, :-count], layer.values[:, :, :-count]
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length -= count
            _trim_window(layer)


def _trim_window(layer: DynamicSlidingWindowLayer) -> None:
    # a sliding layer needs only its last `sliding_window - 1` tokens for the next forward
    if layer.is_initialized and layer.keys.shape[2] > layer.sliding_window - 1:
        layer.keys = layer.keys[:, :, -(layer.sliding_window - 1) :]
        layer.values = layer.values[:, :, -(layer.sliding_window - 1) :]
