"""hf_accel: faster, leaner generation for Hugging Face transformers, opted into through generate kwargs.

Importing this package registers hf_accel's cache names with transformers (`hf_accel.unregister()` undoes it):

    import hf_accel
    model.generate(**inputs, cache_implementation="paged", cache_config={"block_size": 16})
"""

import importlib
import warnings
from typing import TYPE_CHECKING

from . import registry
from .cache.block_pool import BlockPool, OutOfBlocksError
from .cache.builders import build_paged_cache, build_quantized_cache, build_sink_cache
from .cache.paged import PagedCache
from .cache.paged_config import PagedCacheConfig
from .cache.prefix_store import PrefixStore, PrefixStoreStats
from .cache.quantized import QuantizedKVCache
from .cache.quantized_config import QuantizedKVConfig
from .cache.sink import SinkCache
from .cache.sink_config import SinkCacheConfig
from .compiled import quantized_rows as _quantized_rows
from .generate_router import route
from .quant.linear import Int4Linear, Int8Linear
from .quant.quantizer import METHODS as _WEIGHT_METHODS, WeightOnlyConfig, WeightOnlyQuantizer, quantize_model
from .runtime import attention as _attention
from .structured.constraint import StructuredOutput, StructuredOutputsParams

if TYPE_CHECKING:  # the lazy names for type checkers and the API docs; `_LAZY` must name the same ones
    from .engine.config import EngineConfig
    from .engine.engine import Engine
    from .engine.engine_process import EngineProcess
    from .engine.engine_stats import EngineStats
    from .engine.errors import ContextLengthExceededError, EngineDeadError
    from .engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
    from .engine.sampling_params import SamplingParams
    from .engine.spec_decode.speculative_config import SpeculativeConfig
    from .lora.config import LoRAConfig, LoRARequest
    from .quant.gguf_file import load_gguf
    from .quant.presets import list_quantization_presets, load_model, load_tokenizer, quantization_config
    from .speculative.medusa import medusa_generate
    from .speculative.medusa_heads import MedusaConfig, MedusaHeads
    from .training.medusa_trainer import train_medusa
    from .training.eagle_trainer import train_eagle
    from .speculative.draft import draft_generate
    from .speculative.draft_length import DraftLength
    from .speculative.eagle import eagle_generate
    from .speculative.eagle_head import EagleConfig, EagleHead
    from .speculative.eagle_tree import EagleTree
    from .speculative.ngram import ngram_generate
    from .speculative.ngram_drafter import NgramSettings
    from .speculative.stats import SpeculativeStats
    from .speculative.suffix_cache import SuffixCache

# public names loaded on first use (module `__getattr__`), so that `import hf_accel` loads only what registration
# needs: the caches, the quantizer, the attention functions and the generate router. name -> module defining it
_LAZY = {
    "EngineConfig": "engine.config",
    "Engine": "engine.engine",
    "EngineProcess": "engine.engine_process",
    "EngineStats": "engine.engine_stats",
    "ContextLengthExceededError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "SpeculativeConfig": "engine.spec_decode.speculative_config",
    "LoRAConfig": "lora.config",
    "LoRARequest": "lora.config",
    "load_gguf": "quant.gguf_file",
    "list_quantization_presets": "quant.presets",
    "load_model": "quant.presets",
    "load_tokenizer": "quant.presets",
    "quantization_config": "quant.presets",
    "medusa_generate": "speculative.medusa",
    "MedusaConfig": "speculative.medusa_heads",
    "MedusaHeads": "speculative.medusa_heads",
    "train_medusa": "training.medusa_trainer",
    "train_eagle": "training.eagle_trainer",
    "draft_generate": "speculative.draft",
    "DraftLength": "speculative.draft_length",
    "eagle_generate": "speculative.eagle",
    "EagleConfig": "speculative.eagle_head",
    "EagleHead": "speculative.eagle_head",
    "EagleTree": "speculative.eagle_tree",
    "ngram_generate": "speculative.ngram",
    "NgramSettings": "speculative.ngram_drafter",
    "SpeculativeStats": "speculative.stats",
    "SuffixCache": "speculative.suffix_cache",
}
# names kept importable for one release after they left the public API: old name -> its current name
_DEPRECATED = {"MedusaStats": "SpeculativeStats"}

__version__ = "0.1.0"

CACHE_BUILDERS = {
    registry.PAGED_ALIAS: build_paged_cache,
    registry.QUANTIZED_ALIAS: build_quantized_cache,
    registry.SINK_ALIAS: build_sink_cache,
}
ATTENTION_FUNCTIONS = {
    _attention.ATTENTION_NAME: _attention.paged_attention,
    _quantized_rows.ATTENTION_NAME: _quantized_rows.quantized_attention,
}
QUANTIZATION_METHODS = {method: (WeightOnlyConfig, WeightOnlyQuantizer) for method in _WEIGHT_METHODS.values()}


def register() -> None:
    """Register hf_accel with transformers (done on import; idempotent): cache names, the generate router, attention
    functions and weight-quantization methods."""
    registry.register(CACHE_BUILDERS, route, ATTENTION_FUNCTIONS, QUANTIZATION_METHODS)


def unregister() -> None:
    """Restore stock transformers behaviour exactly: everything `register` added is removed."""
    registry.unregister()


register()


def __getattr__(name: str) -> object:
    """A public name on first use: imported from its module and kept; a deprecated name with a warning."""
    if name in _DEPRECATED:
        current = _DEPRECATED[name]
        warnings.warn(f"hf_accel.{name} is deprecated and will be removed in the next release: use "
                      f"hf_accel.{current}", DeprecationWarning, stacklevel=2)
        return __getattr__(current)
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BlockPool",
    "CompletionOutput",
    "ContextLengthExceededError",
    "DraftLength",
    "EagleConfig",
    "EagleHead",
    "EagleTree",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineProcess",
    "EngineStats",
    "Int4Linear",
    "Int8Linear",
    "LoRAConfig",
    "LoRARequest",
    "MedusaConfig",
    "MedusaHeads",
    "NgramSettings",
    "OutOfBlocksError",
    "PagedCache",
    "PagedCacheConfig",
    "PrefixStore",
    "PrefixStoreStats",
    "QuantizedKVCache",
    "QuantizedKVConfig",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SinkCache",
    "SinkCacheConfig",
    "SpeculativeConfig",
    "SpeculativeStats",
    "StructuredOutput",
    "StructuredOutputsParams",
    "SuffixCache",
    "WeightOnlyConfig",
    "draft_generate",
    "eagle_generate",
    "list_quantization_presets",
    "load_gguf",
    "load_model",
    "load_tokenizer",
    "medusa_generate",
    "ngram_generate",
    "quantization_config",
    "quantize_model",
    "register",
    "train_eagle",
    "train_medusa",
    "unregister",
]
