"""The batched LoRA update of a step that mixes adapters, added to each adapted projection's output by a forward hook
(the base model's modules, names and `state_dict` stay as they are).

Each adaptable projection (every `nn.Linear` of the model but its output layer) holds the resident adapters stacked:
`a` `[max_loras, max_rank, in]` and `b` `[max_loras, max_rank, out]` (an adapter's `b` transposed, scaling folded
in; ranks below `max_rank` and projections an adapter leaves alone are zeros). Before a forward the engine says which
slot each packed token uses (`StepAdapters.set`): `token_slots` `[T]` (-1 for a base token), the `used` slots `[U]`,
each token's one-hot row over them `[T, U]` and the largest rank among them `R`. Rows of `x` are the step's packed
tokens in order. The update, with no loop over adapters:
- fp32 on the CPU, outside autograd (the engine's steps): hf_accel's kernel (`torch.ops.hf_accel.lora_add`,
  csrc/lora.cpp) adds each token's own adapter's `x a.T b` to the output in place (R x (in + out) per token);
- otherwise one shrink and one expand over every used adapter, each token keeping its own adapter's columns:

    h     = x @ a[used, :R].reshape(U * R, in).T            # [T, U * R]
    h     = h.view(T, U, R) * one_hot[:, :, None]
    delta = h.reshape(T, U * R) @ b[used, :R].reshape(U * R, out)

A step without adapter tokens skips the hook's work entirely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.custom_ops import lora_kernel


@dataclass
class ActiveAdapters:
    """One step's adapters: `used` `[U]` slot ids (also as the tuple `slots`), `one_hot` `[T, U]` (the model's
    dtype), `rank` R, and `token_slots` `[T]` int64 (each token's slot, -1 for the base)."""

    used: torch.Tensor
    slots: tuple[int, ...]
    one_hot: torch.Tensor
    rank: int
    token_slots: torch.Tensor


class StepAdapters:
    """Which adapters the step being run uses; None between steps and in steps without adapter tokens."""

    def __init__(self) -> None:
        self.active: ActiveAdapters | None = None

    def set(self, token_slots: list[int], ranks: list[int], dtype: torch.dtype, device: torch.device) -> None:
        """The step's packed tokens use slots `token_slots` (-1: the base alone); `ranks[slot]` is each slot's
        adapter's rank."""
        used = sorted({slot for slot in token_slots if slot >= 0})
        if not used:
            self.active = None
            return
        column = {slot: i for i, slot in enumerate(used)}
        one_hot = torch.zeros(len(token_slots), len(used), dtype=dtype)
        rows = [t for t, slot in enumerate(token_slots) if slot >= 0]
        one_hot[rows, [column[token_slots[t]] for t in rows]] = 1
        self.active = ActiveAdapters(torch.tensor(used, device=device), tuple(used), one_hot.to(device),
                                     max(ranks[slot] for slot in used), torch.tensor(token_slots, device=device))

    def clear(self) -> None:
        self.active = None


class LoRAProjection:
    """The stacked adapters of one `nn.Linear` and the forward hook that adds their update to its output."""

    def __init__(self, linear: nn.Linear, max_loras: int, max_rank: int, step: StepAdapters):
        weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.a = weight.new_zeros(max_loras, max_rank, self.in_features)
        self.b = weight.new_zeros(max_loras, max_rank, self.out_features)
        self.step = step
        # the used slots' `a` / `b` side by side ([U * R, in], [U * R, out]), kept while the step's slots, ranks and
        # contents stay the same (every decode step of a steady batch)
        self._stacked: tuple[tuple[tuple[int, ...], int], torch.Tensor, torch.Tensor] | None = None
        self._linear: nn.Linear | None = linear  # hooked when an adapter first updates it (then None)

    def place(self, slot: int, update: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one adapter's `(a [r, in], b [out, r])` in `slot` (None: it leaves this projection alone)."""
        self._stacked = None
        self.a[slot].zero_()
        self.b[slot].zero_()
        if update is not None and self._linear is not None:
            # only projections an adapter updates carry the hook (inert outside an adapter step)
            self._linear.register_forward_hook(self._add_update)
            self._linear = None
        if update is not None:
            a, b = update
            self.a[slot, : a.shape[0]].copy_(a)
            self.b[slot, : a.shape[0]].copy_(b.T)

    def _add_update(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                    output: torch.Tensor) -> torch.Tensor | None:
        active = self.step.active
        if active is None:
            return None
        x = inputs[0].reshape(-1, self.in_features)  # [T, in]
        if x.shape[0] != active.token_slots.shape[0]:
            raise ValueError(f"a LoRA adapter updates a Linear whose {x.shape[0]} input rows are not the step's "
                             f"{active.token_slots.shape[0]} tokens (e.g. a mixture-of-experts expert): not supported")
        kernel = _lora_kernel() if _kernel_takes(x, output) else None
        if kernel is not None:  # each token through its own adapter only, in place
            kernel(output.view(-1, self.out_features), x.contiguous(), self.a, self.b, active.token_slots,
                   active.rank)
            return output
        a, b = self._stacked_weights(active)
        count, rank = active.used.numel(), active.rank
        h = (x @ a.T).view(-1, count, rank) * active.one_hot[:, :, None]
        return output + (h.reshape(-1, count * rank) @ b).view(output.shape)

    def _stacked_weights(self, active: ActiveAdapters) -> tuple[torch.Tensor, torch.Tensor]:
        """`a[used, :R]` as `[U * R, in]` and `b[used, :R]` as `[U * R, out]`."""
        key = (active.slots, active.rank)
        if self._stacked is None or self._stacked[0] != key:
            count, rank = len(key[0]), active.rank
            self._stacked = (key, self.a[active.used, :rank].reshape(count * rank, self.in_features),
                             self.b[active.used, :rank].reshape(count * rank, self.out_features))
        return self._stacked[1], self._stacked[2]


def adaptable_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """Every `nn.Linear` of `model` by module name, but its output layer (LoRA there is not served unmerged)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not output}


@functools.cache
def _lora_kernel() -> Callable[..., None] | None:
    return lora_kernel()


def _kernel_takes(x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether `lora_add` can update `output` in place: fp32 on the CPU, contiguous, outside autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and output.dtype == torch.float32
            and output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad))
