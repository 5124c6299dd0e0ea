"""hf_accel's C++ ops, for eager and compiled callers alike (built by `build.py` on first use):
- `torch.ops.hf_accel.paged_attention` (`csrc/paged_attention.cpp`): for one layer of one step, writes the step's new
  K/V into their pool slots, then every sequence's queries (decodes, speculative candidates, prefill chunks) attend
  over that sequence's blocks where they lie (block table, lengths), so a step copies no context; see the .cpp file
  for the shapes and the masking rule. `paged_tree_attention` is the same rule with a speculative tree's mask;
- `torch.ops.hf_accel.quantized_decode_attention` (`csrc/quantized_attention.cpp`): compiled generate's quantized
  cache, attention over packed codes;
- `torch.ops.hf_accel.packed_linear` (`csrc/packed_linear.cpp`): a Linear of a few rows over a weight packed in
  column panels (`packed_linear.py`); `panel_linear` the same over a Linear's own weight and its panels in a buffer
  of many Linears' (`linear_panels.py`);
- `torch.ops.hf_accel.int8_linear` / `int4_linear` (`csrc/quantized_linear.cpp`): Linears over weight-only quantized
  codes re-laid in column panels (`quant/panels.py`), dequantized in registers;
- `torch.ops.hf_accel.apply_token_bitmask` (`csrc/token_bitmask.cpp`): structured outputs' grammar mask on the
  host's logits, in place; `masked_argmax` the greedy choice under that mask, nothing written (no fakes: they run
  between compiled steps, never inside one);
- `torch.ops.hf_accel.lora_add` (`csrc/lora.cpp`): the LoRA update of a step mixing adapters, each token through its
  own adapter, added in place to a projection's output (eager and compiled engine steps);
- `torch.ops.hf_accel.huge_page_copy` (`csrc/huge_pages.cpp`): a weight's copy on transparent huge pages, where the
  kernels above stream it (`on_huge_pages`; at load, never inside a step: no fake).
The ops of a step each mutate only what they write and have a fake implementation, so a compiled step traces
around each as one opaque node. Where the extension cannot be built, or with `HF_ACCEL_PAGED_KERNEL=0`, every
accessor returns None and callers take their fallback (the engine's `runtime.attention.gathered_attention`: the
same rule over blocks copied out of the pool, sdpa on them; the same results up to float rounding).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable

import torch

from .build import build_extension

SWITCH = "HF_ACCEL_PAGED_KERNEL"

_BUILD_LOCK = threading.Lock()  # one build and one fake registration, whichever thread asks first


def paged_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.paged_attention`, built on first call; None when switched off or not buildable."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    with _BUILD_LOCK:
        return _built_kernel()


@functools.cache
def _built_kernel() -> Callable[..., torch.Tensor] | None:
    try:
        build_extension()
    except Exception as error:  # no compiler, headers or ninja: the gather path still works
        warnings.warn(f"hf_accel: the paged attention kernel could not be built ({type(error).__name__}: {error}); "
                      "the engine gathers K/V blocks instead", RuntimeWarning, stacklevel=2)
        return None
    torch.library.register_fake("hf_accel::paged_attention")(_fake)
    torch.library.register_fake("hf_accel::paged_tree_attention")(_fake)
    torch.library.register_fake("hf_accel::quantized_decode_attention")(_quantized_fake)
    torch.library.register_fake("hf_accel::packed_linear")(_linear_fake)
    torch.library.register_fake("hf_accel::panel_linear")(_panel_linear_fake)
    torch.library.register_fake("hf_accel::int8_linear")(_quantized_linear_fake)
    torch.library.register_fake("hf_accel::int4_linear")(_quantized_linear_fake)
    torch.library.register_fake("hf_accel::lora_add")(_lora_fake)
    return torch.ops.hf_accel.paged_attention


def paged_tree_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.paged_tree_attention` (a speculative tree's verify: the paged kernel's rule with a
    `[seqs, n, m]` tree mask as a last argument; see the .cpp file), built with the paged kernel; None where that is
    switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.paged_tree_attention


def quantized_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.quantized_decode_attention` (csrc/quantized_attention.cpp, built with the paged kernel);
    None where that is switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.quantized_decode_attention


def packed_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.packed_linear` (csrc/packed_linear.cpp: a Linear of a few rows over a weight packed in
    column panels, `packed_linear.py`), built with the paged kernel; None where that is switched off or not
    buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.packed_linear


def panel_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.panel_linear` (csrc/packed_linear.cpp: `packed_linear` over a Linear's own `[N, K]`
    weight and its panels at an offset of a buffer of many Linears' panels); None where `packed_linear` is."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.panel_linear


def quantized_linear_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """(`torch.ops.hf_accel.int8_linear`, `torch.ops.hf_accel.int4_linear`) (csrc/quantized_linear.cpp, built with
    the paged kernel); None where that is switched off or not buildable."""
    if paged_attention_kernel() is None:
        return None
    return torch.ops.hf_accel.int8_linear, torch.ops.hf_accel.int4_linear


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU `tensor` backed by transparent huge pages (`csrc/huge_pages.cpp`: a decode's
    weight reads run faster without a TLB miss every 4 KiB), for the weights the kernels stream; `tensor` itself on
    another device or where the extension is switched off or not buildable."""
    if tensor.device.type != "cpu" or paged_attention_kernel() is None:
        return tensor
    return torch.ops.hf_accel.huge_page_copy(tensor)


# The host-side ops below are looked up once per process (`HF_ACCEL_PAGED_KERNEL` read then): their callers run
# between decode steps, where the accessor's lock and environment read cost ~10 us each on a cold cache.
@functools.cache
def token_bitmask_kernel() -> Callable[..., None] | None:
    """`torch.ops.hf_accel.apply_token_bitmask` (csrc/token_bitmask.cpp: `(logits [rows, V], bitmask [rows, W]
    int32, indices [n] int64)`, forbidden tokens of the indexed rows set to -inf in place), built with the paged
    kernel; None where that is switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.apply_token_bitmask


@functools.cache
def masked_argmax_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.masked_argmax` (csrc/token_bitmask.cpp: `(logits [rows, V], bitmask [rows, W] int32,
    indices [n] int64) -> [rows] int64`, each row's argmax with the indexed rows' forbidden tokens read as -inf),
    built with the paged kernel; None where that is switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.masked_argmax


@functools.cache
def lora_kernel() -> Callable[..., None] | None:
    """`torch.ops.hf_accel.lora_add` (csrc/lora.cpp: `(y [..., out], x [..., in], a, b, slots [capacity] int64,
    ranks [P, S] int64, projection, a_offset, b_offset, max_rank)`, `a` / `b` every projection's flat stacks, this
    one's `[S, R, in]` / `[S, R, out]` from the offsets; each token's adapter update added to `y` in place), built
    with the paged kernel; None where that is switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.lora_add


def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
          value_pool: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
          kv_lengths: torch.Tensor, scale: float, window: int, softcap: float,
          tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    heads, tokens, dim = query.shape  # -> [tokens, heads, dim]
    return query.new_empty(tokens, heads, dim)


def _quantized_fake(query: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(query.shape)  # [rows, heads, dim]


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])  # [M, N]


def _panel_linear_fake(x: torch.Tensor, panels: torch.Tensor, start: int, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # [M, N]


def _quantized_linear_fake(x: torch.Tensor, panels: torch.Tensor, params: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], panels.shape[0] * panels.shape[2])  # [M, N = 16 P]


def _lora_fake(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               ranks: torch.Tensor, projection: int, a_offset: int, b_offset: int, max_rank: int) -> None:
    return None  # adds into `y` in place
