"""The batched LoRA update of a step that mixes adapters, added to each adapted projection's output by a forward hook
(the base model's modules, names and `state_dict` stay as they are).

Each adaptable projection (every `nn.Linear` of the model but its output layer) holds the resident adapters stacked:
`a` `[max_loras, max_rank, in]` and `b` `[max_loras, max_rank, out]` (an adapter's `b` transposed, scaling folded
in; ranks below `max_rank` and projections an adapter leaves alone are zeros), and `ranks` `[max_loras]`, each
slot's adapter's rank on this projection (0: it leaves it alone). All projections' stacks are views of three buffers
(`AdapterStacks`), so a compiled step takes three LoRA inputs however many projections the model has. Before a
forward the engine writes which slot each packed token uses into the step's `token_slots` buffer (`StepAdapters.set`:
-1 for a base token; the buffer keeps -1 past the step's tokens and between steps). Rows of `x` are the step's
packed tokens in order. The update, with no loop over adapters:
- fp32 on the CPU, outside autograd (the engine's steps): hf_accel's kernel (`torch.ops.hf_accel.lora_add`,
  csrc/lora.cpp) adds each token's own adapter's `x a.T b` to the output in place (its rank x (in + out) per
  token). It is a custom op with a fake, so a compiled step holds it as one node: the buffers are graph inputs (never
  frozen), so placing an adapter or a step's slots needs no recompile;
- otherwise one shrink and one expand over every used adapter `U` (largest rank `R`), each token keeping its own
  adapter's columns:

    h     = x @ a[used, :R].reshape(U * R, in).T            # [T, U * R]
    h     = h.view(T, U, R) * one_hot[:, :, None]              # one_hot [T, U]: token_slots[:, None] == used
    delta = h.reshape(T, U * R) @ b[used, :R].reshape(U * R, out)

Eager, a step without adapter tokens skips the hooks' work entirely, and only projections some adapter updates
carry a hook. Compiled (`StepAdapters.compiled`), every adaptable projection is hooked before the graphs are traced
and always calls the kernel, whose cost for a base token is one slot read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.custom_ops import lora_kernel


@dataclass
class ActiveAdapters:
    """One eager step's adapters: the `used` slots in order, and `rank`, the largest rank among them."""

    num_tokens: int
    used: tuple[int, ...]
    rank: int


class StepAdapters:
    """The step's `token_slots` buffer `[capacity]` int64 (grown when a step packs more tokens) and, in a step with
    adapter tokens, its `active` adapters; `compiled`: every hook always runs the kernel (fp32 on the CPU only; see
    the module docstring)."""

    def __init__(self, capacity: int, device: torch.device, compiled: bool = False):
        self.token_slots = torch.full((max(capacity, 1),), -1, dtype=torch.long, device=device)
        self.compiled = compiled
        self.active: ActiveAdapters | None = None
        self._num_set = 0  # leading entries of `token_slots` the last `set` wrote

    def set(self, token_slots: list[int], ranks: list[int]) -> None:
        """The step's packed tokens use slots `token_slots` (-1: the base alone); `ranks[slot]` is each slot's
        adapter's rank."""
        self.clear()
        if len(token_slots) > self.token_slots.shape[0]:  # a compiled step recompiles for the new size, once
            self.token_slots = torch.full((len(token_slots),), -1, dtype=torch.long, device=self.token_slots.device)
        used = tuple(sorted({slot for slot in token_slots if slot >= 0}))
        if not used:
            return
        self.token_slots[: len(token_slots)].copy_(torch.tensor(token_slots))
        self._num_set = len(token_slots)
        self.active = ActiveAdapters(len(token_slots), used, max(ranks[slot] for slot in used))

    def clear(self) -> None:
        if self._num_set:
            self.token_slots[: self._num_set].fill_(-1)
            self._num_set = 0
        self.active = None


class AdapterStacks:
    """Every projection's stacked adapters in three buffers: `a` and `b` flat (projection `i`'s `[S, R, in]` and
    `[S, R, out]` back to back), `ranks` `[projections, S]` int64; `S` = `max_loras`, `R` = `max_rank`."""

    def __init__(self, shapes: list[tuple[int, int]], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_loras, self.max_rank, self.shapes = max_loras, max_rank, shapes
        a_sizes = [max_loras * max_rank * in_features for in_features, _ in shapes]
        b_sizes = [max_loras * max_rank * out_features for _, out_features in shapes]
        self.a_offsets = [sum(a_sizes[:i]) for i in range(len(shapes))]
        self.b_offsets = [sum(b_sizes[:i]) for i in range(len(shapes))]
        self.a = torch.zeros(sum(a_sizes), dtype=dtype, device=device)
        self.b = torch.zeros(sum(b_sizes), dtype=dtype, device=device)
        self.ranks = torch.zeros(len(shapes), max_loras, dtype=torch.long, device=device)

    def views(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection `index`'s `a` `[S, R, in]`, `b` `[S, R, out]` and `ranks` `[S]` (views: writes land in the
        buffers)."""
        in_features, out_features = self.shapes[index]
        count, rank = self.max_loras, self.max_rank
        a = self.a.narrow(0, self.a_offsets[index], count * rank * in_features).view(count, rank, in_features)
        b = self.b.narrow(0, self.b_offsets[index], count * rank * out_features).view(count, rank, out_features)
        return a, b, self.ranks[index]


class LoRAProjection:
    """The stacked adapters of one `nn.Linear` (projection `index` of `stacks`) and the forward hook that adds their
    update to its output."""

    def __init__(self, linear: nn.Linear, stacks: AdapterStacks, index: int, step: StepAdapters):
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.stacks, self.index = stacks, index
        self.a, self.b, self.ranks = stacks.views(index)  # for `place` and eager steps
        # the kernel's trailing arguments: this projection's row of the ranks, offsets in the flat stacks, max rank
        self._kernel_args = (index, stacks.a_offsets[index], stacks.b_offsets[index], stacks.max_rank)
        self.step = step
        self._kernel = lora_kernel()
        self._linear: nn.Linear | None = linear  # hooked when an adapter first updates it (then None)
        if step.compiled:  # the graphs are traced with every hook in place
            self._attach()

    def place(self, slot: int, update: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one adapter's `(a [r, in], b [out, r])` in `slot` (None: it leaves this projection alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0 if update is None else update[0].shape[0]
        if update is not None:
            self._attach()  # only projections an adapter updates carry the hook (inert outside an adapter step)
            a, b = update
            self.a[slot, : a.shape[0]].copy_(a)
            self.b[slot, : a.shape[0]].copy_(b.T)

    def _attach(self) -> None:
        if self._linear is not None:
            self._linear.register_forward_hook(self._compiled_hook() if self.step.compiled else self._add_update)
            self._linear = None

    def _compiled_hook(self) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
        """The hook of a compiled step: traced once, it reads the flat buffers, the step's slots and five ints (few
        guards each step) and always calls the kernel, which adds nothing to tokens of the base, or to a forward longer
        than the slots buffer (not an engine step: a `generate` on the same model)."""
        kernel, step, stacks, args = self._kernel, self.step, self.stacks, self._kernel_args
        a, b, ranks = stacks.a, stacks.b, stacks.ranks  # never replaced (`AdapterStacks` writes into them)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            kernel(output, inputs[0], a, b, step.token_slots, ranks, *args)
            return output

        # what a saved engine step holds of this hook (runtime/saved_steps.py): its constants; the tensors it reads
        # are the step's inputs (`EngineAdapters.graph_inputs`)
        hook.step_description = ["hf_accel.lora_add", *args]
        return hook

    def _add_update(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                    output: torch.Tensor) -> torch.Tensor | None:
        step = self.step
        x = inputs[0].reshape(-1, self.in_features)  # [T, in]
        active = step.active
        if active is None:
            return None
        if x.shape[0] != active.num_tokens:
            raise ValueError(f"a LoRA adapter updates a Linear whose {x.shape[0]} input rows are not the step's "
                             f"{active.num_tokens} tokens (e.g. a mixture-of-experts expert): not supported")
        if self._kernel is not None and _kernel_takes(x, output):  # each token through its own adapter, in place
            stacks = self.stacks
            self._kernel(output, x, stacks.a, stacks.b, step.token_slots, stacks.ranks, *self._kernel_args)
            return output
        slots = step.token_slots[: x.shape[0]]
        used, rank = torch.tensor(active.used, device=x.device), active.rank
        one_hot = (slots[:, None] == used).to(x.dtype)  # [T, U]
        a = self.a[used, :rank].reshape(-1, self.in_features)  # [U * R, in]
        b = self.b[used, :rank].reshape(-1, self.out_features)  # [U * R, out]
        h = (x @ a.T).view(-1, len(active.used), rank) * one_hot[:, :, None]
        return output + (h.flatten(1) @ b).view(output.shape)


def lora_projections(linears: dict[str, nn.Linear], max_loras: int, max_rank: int,
                     step: StepAdapters) -> tuple[AdapterStacks, dict[str, LoRAProjection]]:
    """One `LoRAProjection` per Linear (by name), their stacks in one `AdapterStacks`."""
    some = next(iter(linears.values()))
    stacks = AdapterStacks([(linear.in_features, linear.out_features) for linear in linears.values()], max_loras,
                           max_rank, some.weight.dtype, some.weight.device)
    return stacks, {name: LoRAProjection(linear, stacks, index, step)
                    for index, (name, linear) in enumerate(linears.items())}


def adaptable_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """Every `nn.Linear` of `model` by module name, but its output layer (LoRA there is not served unmerged)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not output}


def _kernel_takes(x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether `lora_add` can update `output` in place: fp32 on the CPU, contiguous, outside autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and output.dtype == torch.float32
            and output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad))
