"""The quantized cache under compiled generate: `QuantizedKVCache`'s codes, sinks and residual window in buffers of
fixed size, so every decode step is one call of the same graph.

`QuantizedKVCache` (docs/caches.md) keeps per layer the first `cap` columns in full precision (the sinks: the first
real tokens after the batch's largest left padding), a quantized history of whole groups, and a full-precision
residual of at most `R` recent tokens, flushed into groups when it reaches `R`. Columns are shared by all rows, so the
flush happens at the same step for every row, a step the host knows in advance. That makes a static layout exact:

    full precision  fp_keys / fp_values  [kv_heads, layers * rows, S = cap + R, D]: per (layer, row) slots
                    0 .. cap - 1 the sinks, cap .. cap + R - 1 the residual
    quantized       codes [layers, rows, kv_heads, Q, ...] (Q: room for every group the call can make) with scales and
                    minima, in `ops.quantize`'s layout (key tokens split into groups), filled up to `Tq` tokens
    valid           [rows, S + Q] bool: which slots hold a real token (in the order attention reads them)

One tensor per kind for all layers, so a step's graph reads nine tensors, not nine per layer (each input costs the
compiled call's wrappers time). A decode step attends, per layer, the valid fp slots, the live history (whole groups up
to `Tq`, at least 2: not the whole room) and the new token itself (attention is a sum over keys: their order does not
matter); on CPU in fp32 through the C++ kernel `hf_accel::quantized_decode_attention`, which reads the packed codes
where they lie, elsewhere by dequantizing the live history in the graph and calling sdpa. The step returns every layer's
new K/V; the host then writes them at fp slot `w` (the next sink while the sinks fill, then the next residual slot: `w`
just counts up) with one `index_copy_` per kind and marks the slot valid (`advance`: a write inside the graph would be a
custom op call per layer, or a copy of the buffer). When the residual is full, the host quantizes it into the next `R`
history tokens with the cache's own `ops.quantize` and moves its valid bits along (`flush`): the same groups of the same
tokens the eager cache makes, so tokens equal eager `QuantizedKVCache`'s (logits up to float reassociation: attention
sums the slots in another order; fp32 tests compare tokens). The prefill runs eagerly through the eager cache itself
(`take` copies its state over). Layers of other kinds (sliding windows) have no place here: such models decode eagerly
(`decode_loop.uncovered`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..cache.kv_shape import config_head_dim
from ..cache.quantized import KEY_AXIS, VALUE_AXIS, QuantizedKVCache, QuantizedKVLayer
from ..runtime.attention import attend_dense, pool_attention
from ..kernels.custom_ops import quantized_attention_kernel
from ..quant import ops
from ..quant.ops import QuantizedTensor
from .token_choice import choose_tokens

ATTENTION_NAME = "hf_accel_quantized_kv"
MIN_GROUPS = 2  # history groups a step reads at least: sizes 0 and 1 would each be specialized (more graphs)


@dataclass(slots=True)
class QuantizedStep:
    """What every layer of one decode step reads (the `hf_accel_quantized` forward kwarg): the full-precision
    slots, the live part of the history (`groups` whole groups, at least 2) and which slots are valid."""

    fp_keys: torch.Tensor  # [kv_heads, layers * rows, S, D]
    fp_values: torch.Tensor
    key_codes: torch.Tensor  # [layers, rows, kv_heads, groups, G, D * nbits / 8]: per channel over G tokens
    key_scale: torch.Tensor  # [layers, rows, kv_heads, groups, 1, D]; key_minimum alike
    key_minimum: torch.Tensor
    value_codes: torch.Tensor  # [layers, rows, kv_heads, groups * G, D * nbits / 8]: per token over G channels
    value_scale: torch.Tensor  # [layers, rows, kv_heads, groups * G, D / G, 1]; value_minimum alike
    value_minimum: torch.Tensor
    valid: torch.Tensor  # [rows, S + groups * G] bool, in the order attention reads the slots
    attend: Callable[..., torch.Tensor] | None = None  # the C++ kernel (CPU, fp32), else the dense path


class QuantizedRows:
    """The static quantized K/V of one compiled `generate` call with `cache`'s settings, for columns up to
    `max_columns` (prompt and new tokens)."""

    def __init__(self, model: PreTrainedModel, cache: QuantizedKVCache, rows: int, max_columns: int):
        weight = next(model.parameters())
        self.settings, self.num_sink_columns, self.rows = cache.settings, cache.num_sink_columns, rows
        self.residual_length, group = self.settings.residual_length, self.settings.group_size
        self.num_fp_slots = self.num_sink_columns + self.residual_length  # S: the sinks, then the residual
        config = model.config.get_text_config(decoder=True)
        self.heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.dim, layers = config_head_dim(config), len(cache.layers)
        # whole groups for every later column, at least 2 (a size of 1 would be specialized: one more graph), and
        # one to spare: a live view is then never the whole buffer (a trace would tie its strides to its sizes)
        self.num_room_groups = max(-(-(max_columns - self.num_sink_columns) // group), MIN_GROUPS) + 1
        heads, dim, slots, groups = self.heads, self.dim, self.num_fp_slots, self.num_room_groups
        packed, tokens = dim * self.settings.nbits // 8, groups * group

        def zeros(*size: int, kind: torch.dtype = weight.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=kind, device=weight.device)

        self.fp_keys, self.fp_values = zeros(heads, layers * rows, slots, dim), zeros(heads, layers * rows, slots, dim)
        self.key_codes = zeros(layers, rows, heads, groups, group, packed, kind=torch.uint8)
        self.key_scale, self.key_minimum = (zeros(layers, rows, heads, groups, 1, dim) for _ in range(2))
        self.value_codes = zeros(layers, rows, heads, tokens, packed, kind=torch.uint8)
        self.value_scale, self.value_minimum = (zeros(layers, rows, heads, tokens, dim // group, 1) for _ in range(2))
        self.valid = zeros(rows, slots + tokens, kind=torch.bool)
        self.base = torch.arange(layers * rows, device=weight.device) * slots  # flat slot 0 of each (layer, row)
        self.next_slot = 0  # w: the fp slot the next token goes to
        self.num_quantized = 0  # Tq: history tokens held
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.attend = quantized_attention_kernel() if on_cpu else None
        self.step = self._live_step()

    def take(self, cache: QuantizedKVCache, attention_mask: torch.Tensor) -> None:
        """Copy the prefilled eager `cache` (its K/V of the columns of `attention_mask` `[rows, prompt]`) into the
        buffers, and empty it."""
        cap, rows = self.num_sink_columns, self.rows
        first: QuantizedKVLayer = cache.layers[0]
        sinks, residual = first.sink_keys.shape[-2], first.residual_keys.shape[-2]
        quantized = 0 if first.quantized_keys is None else first.quantized_keys.num_tokens
        for index, layer in enumerate(cache.layers):
            own = slice(index * rows, (index + 1) * rows)
            for fp, sink, recent in ((self.fp_keys, layer.sink_keys, layer.residual_keys),
                                     (self.fp_values, layer.sink_values, layer.residual_values)):
                fp[:, own, :sinks] = sink.transpose(0, 1)
                fp[:, own, cap:cap + residual] = recent.transpose(0, 1)
            if quantized:
                self._place(index, layer.quantized_keys, layer.quantized_values, 0)
        real = attention_mask.bool()
        self.valid[:, :sinks] = real[:, :sinks]
        self.valid[:, cap:cap + residual] = real[:, cap + quantized:cap + quantized + residual]
        start = self.num_fp_slots
        self.valid[:, start:start + quantized] = real[:, cap:cap + quantized]
        self.num_quantized = quantized
        self.next_slot = sinks if sinks < cap else cap + residual
        self.step = self._live_step()
        cache.reset()

    def advance(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After a decode step: write its new `keys` / `values` `[layers, rows, kv_heads, D]` at fp slot `w`, mark it
        valid, move on; a full residual is quantized into the history (`flush`)."""
        slots = self.base + self.next_slot
        for fp, new in ((self.fp_keys, keys), (self.fp_values, values)):
            fp.view(self.heads, -1, self.dim).index_copy_(1, slots, new.permute(2, 0, 1, 3).flatten(1, 2))
        self.valid[:, self.next_slot] = True
        self.next_slot += 1
        if self.next_slot == self.num_fp_slots:
            self.flush()

    def flush(self) -> None:
        """Quantize the residual's R tokens into history tokens `Tq .. Tq + R` (keys per channel over groups of
        tokens, values per token: `QuantizedKVLayer`'s rule, with `ops.quantize`) and empty the residual."""
        cap, size, start, rows = self.num_sink_columns, self.residual_length, self.num_quantized, self.rows
        group, nbits = self.settings.group_size, self.settings.nbits
        for index in range(self.key_codes.shape[0]):
            keys, values = (fp[:, index * rows:(index + 1) * rows, cap:].transpose(0, 1).contiguous()
                            for fp in (self.fp_keys, self.fp_values))  # [rows, kv_heads, R, D]
            self._place(index, ops.quantize(keys, nbits, group, KEY_AXIS),
                        ops.quantize(values, nbits, group, VALUE_AXIS), start)
        history = cap + size + start
        self.valid[:, history:history + size] = self.valid[:, cap:cap + size]
        self.valid[:, cap:cap + size] = False
        self.num_quantized += size
        self.next_slot -= size
        self.step = self._live_step()

    def _place(self, layer: int, keys: QuantizedTensor, values: QuantizedTensor, start: int) -> None:
        """Write quantized `keys` / `values` (`ops.quantize`'s layout) into layer `layer`'s history from token `start`
        (a multiple of the group size)."""
        group, count = keys.group_size, keys.num_tokens
        groups = slice(start // group, (start + count) // group)
        self.key_codes[layer][:, :, groups] = keys.codes.unflatten(2, (-1, group))
        self.key_scale[layer][:, :, groups] = keys.scale
        self.key_minimum[layer][:, :, groups] = keys.minimum
        tokens = slice(start, start + count)
        self.value_codes[layer][:, :, tokens] = values.codes
        self.value_scale[layer][:, :, tokens] = values.scale
        self.value_minimum[layer][:, :, tokens] = values.minimum

    def _live_step(self) -> QuantizedStep:
        """The step inputs over the history's live groups (at least 2), so attention reads what the eager cache
        holds, not the whole room; the model's sizes (layers, heads, head dimension, group size) marked static for
        the compiler."""
        live = max(self.num_quantized // self.settings.group_size, MIN_GROUPS)
        tokens = live * self.settings.group_size
        keys = [_static(t[:, :, :, :live], (0, 2, 4, 5)) for t in (self.key_codes, self.key_scale, self.key_minimum)]
        values = [_static(t[:, :, :, :tokens], (0, 2, 4) + ((5,) if t.dim() == 6 else ()))
                  for t in (self.value_codes, self.value_scale, self.value_minimum)]
        return QuantizedStep(_static(self.fp_keys, (0, 3)), _static(self.fp_values, (0, 3)), *keys, *values,
                             self.valid[:, :self.num_fp_slots + tokens], self.attend)


def _static(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`tensor`, its sizes at `dims` marked static: a compile with every size symbolic spends minutes proving the
    dequantization's reshapes."""
    for dim in dims:
        torch._dynamo.mark_static(tensor, dim)
    return tensor


def unpacked(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes `[..., dim * nbits / 8]` packed by `ops.pack` -> `[..., dim]` uint8 codes (`nbits` from the two
    static sizes)."""
    return ops.unpack(codes, 8 * codes.shape[-1] // dim)


def history_keys(step: QuantizedStep, layer: int, dim: int) -> torch.Tensor:
    """The dequantized key history of `layer`: `[rows, kv_heads, groups * G, dim]` (code * scale + minimum)."""
    scale = step.key_scale[layer]  # [rows, heads, groups, 1, dim]
    codes = unpacked(step.key_codes[layer], dim).to(scale.dtype)  # [rows, heads, groups, G, dim]
    return (codes * scale + step.key_minimum[layer]).flatten(2, 3)


def history_values(step: QuantizedStep, layer: int, dim: int) -> torch.Tensor:
    """The dequantized value history of `layer`: `[rows, kv_heads, tokens, dim]`."""
    scale = step.value_scale[layer]  # [rows, heads, tokens, dim / G, 1]
    codes = unpacked(step.value_codes[layer], dim).to(scale.dtype).unflatten(-1, (scale.shape[-2], -1))
    return (codes * scale + step.value_minimum[layer]).flatten(-2)


@pool_attention(ATTENTION_NAME, "hf_accel's compiled generate with the quantized cache", "hf_accel_quantized")
def quantized_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                        sliding_window: int | None, softcap: float | None, step: QuantizedStep,
                        hf_accel_mask: torch.Tensor, hf_accel_written: list, **kwargs) -> torch.Tensor:
    """`query` `[rows, heads, 1, head_dim]`, `key` / `value` `[rows, kv_heads, 1, head_dim]` (each row's new token)
    -> `[rows, 1, heads, head_dim]`: attention over every valid fp slot, the dequantized history and the new token
    (`hf_accel_mask` `[rows, S + tokens + 1]`); the new K/V are appended to `hf_accel_written` for the host. Models
    with sliding windows never get here (`decode_loop.uncovered`)."""
    rows, dtype, dim = query.shape[0], step.fp_keys.dtype, step.fp_keys.shape[-1]
    key, value = key.to(dtype), value.to(dtype)
    hf_accel_written.append((key[:, :, 0], value[:, :, 0]))
    own = slice(layer * rows, (layer + 1) * rows)
    if step.attend is not None and not softcap:  # the kernel reads the codes where they lie: [rows, heads, D]
        out = step.attend(query[:, :, 0].to(dtype), step.fp_keys[:, own], step.fp_values[:, own],
                          step.key_codes[layer], step.key_scale[layer], step.key_minimum[layer],
                          step.value_codes[layer], step.value_scale[layer], step.value_minimum[layer], step.valid,
                          key[:, :, 0], value[:, :, 0], scale)
        return out[:, None].to(query.dtype)
    keys = torch.cat((step.fp_keys[:, own].transpose(0, 1), history_keys(step, layer, dim), key), dim=2)
    values = torch.cat((step.fp_values[:, own].transpose(0, 1), history_values(step, layer, dim), value), dim=2)
    out = attend_dense(query.to(dtype), keys, values, hf_accel_mask[:, None, None, :], scale, softcap)
    return out.transpose(1, 2).to(query.dtype)


def quantized_decode_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor,
                          step: QuantizedStep, warpers: tuple, do_sample: bool,
                          return_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row `r` computes token `tokens[r]` at position `positions[r]` -> (`[rows]` next tokens, or with
    `return_logits` the `[rows, vocab]` fp32 logits for processors applied outside the graph; the step's new keys
    and values `[layers, rows, kv_heads, D]`, for `QuantizedRows.advance`)."""
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    mask = torch.cat((step.valid, step.valid.new_ones(step.valid.shape[0], 1)), dim=1)  # the new token: valid
    out = model(input_ids=tokens[:, None], position_ids=positions[:, None], use_cache=False,
                hf_accel_quantized=step, hf_accel_mask=mask, hf_accel_written=written)
    keys, values = (torch.stack([pair[i] for pair in written]) for i in (0, 1))
    logits = out.logits[:, -1].float()
    return (logits if return_logits else choose_tokens(logits, warpers, do_sample)), keys, values
