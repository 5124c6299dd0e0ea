"""Build hf_accel caches inside `generate`, from `cache_implementation` and `cache_config`."""

from __future__ import annotations

from typing import TypeVar

from transformers import PreTrainedModel

from ..registry import CacheRequest
from .kv_shape import check_decoder_only
from .paged import PagedCache
from .paged_config import PagedCacheConfig
from .sink import SinkCache
from .sink_config import SinkCacheConfig
from .quantized import QuantizedKVCache
from .quantized_config import QuantizedKVConfig

C = TypeVar("C", PagedCacheConfig, QuantizedKVConfig, SinkCacheConfig)


def build_paged_cache(model: PreTrainedModel, request: CacheRequest) -> PagedCache:
    """A `PagedCache` for the request's rows, from `generation_config.cache_config` (`prefix_store`: a
    `PrefixStore` of this model)."""
    settings = _settings(model, request, "paged", PagedCacheConfig)
    options = request.generation_config.cache_config
    return PagedCache(model.config, block_size=settings.block_size, num_blocks=settings.num_blocks,
                      max_memory=settings.max_memory, max_cache_len=request.max_cache_len,
                      prefix_store=options.get("prefix_store") if options else None)


def build_quantized_cache(model: PreTrainedModel, request: CacheRequest) -> QuantizedKVCache:
    """hf_accel's `QuantizedKVCache`, for `cache_implementation="quantized"` with `cache_config["backend"]="hf_accel"`,
    told the prompts' left padding (each row's first real tokens are its full-precision sinks)."""
    settings = _settings(model, request, "quantized", QuantizedKVConfig)
    return QuantizedKVCache(model.config, nbits=settings.nbits, group_size=settings.group_size,
                            residual_length=settings.residual_length, num_fp_sink_tokens=settings.num_fp_sink_tokens,
                            attention_mask=request.attention_mask)


def build_sink_cache(model: PreTrainedModel, request: CacheRequest) -> SinkCache:
    """A `SinkCache` from `generation_config.cache_config`, told the prompts' left padding (pads never become sinks)."""
    settings = _settings(model, request, "sink", SinkCacheConfig)
    return SinkCache(model.config, window_length=settings.window_length, num_sink_tokens=settings.num_sink_tokens,
                     attention_mask=request.attention_mask, max_cache_len=request.max_cache_len)


def _settings(model: PreTrainedModel, request: CacheRequest, name: str, config_class: type[C]) -> C:
    """The request's `cache_config` as `config_class`, once `model` is known to support cache `name`."""
    check_decoder_only(model.config, f"cache_implementation={name!r}", "model")
    if not model._supports_default_dynamic_cache():
        raise ValueError(
            f"cache_implementation={name!r} needs a model that uses transformers' Cache API; "
            f"{type(model).__name__} does not"
        )
    return config_class.from_dict(request.generation_config.cache_config)
