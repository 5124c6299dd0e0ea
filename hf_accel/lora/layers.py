"""The batched LoRA update of a step that mixes adapters, added to each adapted projection's output by a forward hook
(the base model's modules, names and `state_dict` stay as they are).

Each adaptable projection (every `nn.Linear` of the model but its output layer) holds the resident adapters stacked:
`a` `[max_loras, max_rank, in]` and `b` `[max_loras, max_rank, out]` (an adapter's `b` transposed, scaling folded
in; ranks below `max_rank` and projections an adapter leaves alone are zeros). Before a forward the engine says which
slot each packed token uses (`StepAdapters.set`): `token_slots` `[T]` (-1 for a base token), the `used` slots `[U]`
and the largest rank among them `R`. Rows of `x` are the step's packed tokens in order. The update, with no loop
over adapters:
- fp32 on the CPU, outside autograd (the engine's steps): hf_accel's kernel (`torch.ops.hf_accel.lora_add`,
  csrc/lora.cpp) adds each token's own adapter's `x a.T b` to the output in place (R x (in + out) per token);
- otherwise one shrink and one expand over every used adapter, each token keeping its own adapter's columns:

    h     = x @ a[used, :R].reshape(U * R, in).T            # [T, U * R]
    h     = h.view(T, U, R) * one_hot[:, :, None]              # one_hot [T, U]: token_slots[:, None] == used
    delta = h.reshape(T, U * R) @ b[used, :R].reshape(U * R, out)

A step without adapter tokens skips the hook's work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.custom_ops import lora_kernel


@dataclass
class ActiveAdapters:
    """One step's adapters: `token_slots` `[T]` int64 (each token's slot, -1 for the base), the `used` slots in
    order, and `rank`, the largest rank among them."""

    token_slots: torch.Tensor
    used: tuple[int, ...]
    rank: int


class StepAdapters:
    """Which adapters the step being run uses; None between steps and in steps without adapter tokens."""

    def __init__(self) -> None:
        self.active: ActiveAdapters | None = None

    def set(self, token_slots: list[int], ranks: list[int], device: torch.device) -> None:
        """The step's packed tokens use slots `token_slots` (-1: the base alone); `ranks[slot]` is each slot's
        adapter's rank."""
        used = tuple(sorted({slot for slot in token_slots if slot >= 0}))
        self.active = None if not used else ActiveAdapters(torch.tensor(token_slots, device=device), used,
                                                           max(ranks[slot] for slot in used))

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
        self._linear: nn.Linear | None = linear  # hooked when an adapter first updates it (then None)

    def place(self, slot: int, update: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one adapter's `(a [r, in], b [out, r])` in `slot` (None: it leaves this projection alone)."""
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
        kernel = lora_kernel() if _kernel_takes(x, output) else None
        if kernel is not None:  # each token through its own adapter only, in place
            kernel(output.view(-1, self.out_features), x.contiguous(), self.a, self.b, active.token_slots,
                   active.rank)
            return output
        used, rank = torch.tensor(active.used, device=x.device), active.rank
        one_hot = (active.token_slots[:, None] == used).to(x.dtype)  # [T, U]
        a = self.a[used, :rank].reshape(-1, self.in_features)  # [U * R, in]
        b = self.b[used, :rank].reshape(-1, self.out_features)  # [U * R, out]
        h = (x @ a.T).view(-1, len(active.used), rank) * one_hot[:, :, None]
        return output + (h.flatten(1) @ b).view(output.shape)


def adaptable_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """Every `nn.Linear` of `model` by module name, but its output layer (LoRA there is not served unmerged)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not output}


def _kernel_takes(x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether `lora_add` can update `output` in place: fp32 on the CPU, contiguous, outside autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and output.dtype == torch.float32
            and output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad))
