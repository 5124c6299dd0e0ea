"""Sibling quantized Linears (an attention's q / k / v projections, an MLP's gate and up) run as one kernel call in
compiled steps, without changing the model's forward.

Two halves:
- `colocate_siblings` (at load, after the panels are packed): the panels of the quantized Linears that one module
  holds directly, of the same kind and input width, are copied into one buffer, each module keeping a view of its
  part (no extra memory; `state_dict` still writes each module's checkpoint format).
- `MergeSiblingLinears`, a post-grad pass of the graphs that freeze the weights
  (`runtime.frozen_graphs.step_graph_settings`): calls of `hf_accel::int4_linear` / `int8_linear` on the same input
  whose frozen panels lie end to end become one call over the panels they span, and each former call's result a
  slice of its columns.

Why: a decode step of a 16-layer Llama makes 112 such calls; each pays the op's fixed cost, a parallel region and
the short stream of a small weight (k / v). Merged it makes 64 (benchmarks/bench_size.py measures decode). Each
output column is computed alone, from the same panels and the same quantized input rows, so the results are the same
bits as the separate calls'.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..kernels.packed_linear import FROZEN_WEIGHTS
from .linear import PANEL_ATTRIBUTES

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def colocate_siblings(model: nn.Module) -> int:
    """Put the panels of each group of sibling quantized Linears of `model` end to end in one buffer (see the
    module's docstring); returns how many groups were co-located."""
    groups = 0
    for parent in model.modules():
        siblings: dict[tuple, list[nn.Module]] = defaultdict(list)
        for child in parent.children():
            key = _panel_key(child)
            if key is not None:
                siblings[key].append(child)
        for members in siblings.values():
            if len(members) > 1:
                _colocate(members)
                groups += 1
    return groups


def _panel_key(module: nn.Module) -> tuple | None:
    """What siblings must share to be co-located: kind, group size and the trailing shapes / dtypes of their panels."""
    names = PANEL_ATTRIBUTES.get(type(module))
    if names is None or module.layout != "panels":
        return None
    tensors = [getattr(module, name) for name in names]
    return (type(module), module.in_features, module.group_size,
            *((None,) if t is None else (tuple(t.shape[1:]), t.dtype, t.device) for t in tensors))


@torch.inference_mode(False)
@torch.no_grad()
def _colocate(members: list[nn.Module]) -> None:
    for name in PANEL_ATTRIBUTES[type(members[0])]:
        parts = [getattr(member, name) for member in members]
        if parts[0] is None or _spanning(parts) is not None:  # none, or already end to end: nothing to copy
            continue
        whole = torch.cat([part.detach() for part in parts])
        start = 0
        for member, part in zip(members, parts):
            view = whole[start: start + part.shape[0]]
            start += part.shape[0]
            if name == "weight":
                member.weight = nn.Parameter(view, requires_grad=False)
            else:
                setattr(member, name, view)  # a registered buffer: stays one


class MergeSiblingLinears(CustomGraphPass):
    """Post-grad pass: calls of `hf_accel::int4_linear` / `int8_linear` on one input whose panels are frozen
    constants lying end to end (`colocate_siblings`) -> one call and a column slice per former call (each merge
    counted in dynamo's `counters["hf_accel"]["merged_linears"]`, by the calls it replaced).

    Its constants are views of the frozen weights, so like `kernels.packed_linear.PackLinears` its `uuid` carries the
    fingerprint of the weights the graph freezes (None where there is none: inductor then bypasses its cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            key = _call_key(node, module)
            if key is not None:
                groups[key].append(node)
        for nodes in groups.values():
            if len(nodes) > 1:
                _merge(graph, module, nodes)

    def uuid(self) -> bytes | None:
        fingerprint = FROZEN_WEIGHTS.get()
        weights = None if fingerprint is None else fingerprint()
        return None if weights is None else get_hash_for_files((__file__,)) + weights.encode()


def _call_key(node: torch.fx.Node, module: nn.Module) -> tuple | None:
    """(op, the input's source, its shape, the panels' storage) of a call the pass may merge, else None."""
    if node.op != "call_function" or node.target not in (torch.ops.hf_accel.int4_linear.default,
                                                         torch.ops.hf_accel.int8_linear.default):
        return None
    x, *operands = node.args
    if not isinstance(x, torch.fx.Node) or "val" not in x.meta:
        return None
    tensors = [_constant(operand, module) for operand in operands]
    if any(t is None for t in tensors[:2]) or (operands[2] is not None and tensors[2] is None):
        return None
    source = x
    while source.op == "call_function" and source.target in _VIEWS:
        source = source.args[0]
    bias = tensors[2]
    return (node.target, source, str(tuple(x.meta["val"].shape)), tensors[0].untyped_storage().data_ptr(),
            tuple(tensors[0].shape[1:]), tuple(tensors[1].shape[1:]), tensors[1].dtype,
            None if bias is None else bias.dtype)


def _constant(operand, module: nn.Module) -> torch.Tensor | None:
    if isinstance(operand, torch.fx.Node) and operand.op == "get_attr":
        tensor = getattr(module, operand.target, None)
        return tensor if isinstance(tensor, torch.Tensor) else None
    return None


def _merge(graph: torch.fx.Graph, module: nn.Module, nodes: list[torch.fx.Node]) -> None:
    """Replace `nodes` (one op, one input, panels in one storage; in graph order) by one call over the panels they
    span, placed before the first of them."""
    first = nodes[0]
    operands = {node: [_constant(operand, module) for operand in node.args[1:]] for node in nodes}
    by_offset = sorted(nodes, key=lambda node: operands[node][0].storage_offset())
    panels, params, bias = (_joined([operands[node][i] for node in by_offset], may_copy=i > 0) for i in range(3))
    if panels is None or params is None or bias is False:
        return
    x = first.args[0]
    fake = x.meta["val"].fake_mode
    with graph.inserting_before(first):
        constants = [None if tensor is None else _get_attr(graph, module, tensor, fake)
                     for tensor in (panels, params, bias)]
        merged = graph.call_function(first.target, (x, *constants))
        with fake:
            merged.meta["val"] = first.target(x.meta["val"], *(None if c is None else c.meta["val"]
                                                                for c in constants))
        start = 0
        for node in by_offset:
            width = operands[node][0].shape[0] * 16  # 16 columns a panel
            part = graph.call_function(torch.ops.aten.slice.Tensor, (merged, 1, start, start + width))
            part.meta["val"] = merged.meta["val"][:, start: start + width]
            start += width
            node.replace_all_uses_with(part)
    for node in nodes:  # outside the insertion point, which is the first of them
        graph.erase_node(node)
    counters["hf_accel"]["merged_linears"] += len(nodes)


def _joined(tensors: list, may_copy: bool):
    """One tensor over `tensors` (all None: None): a view where they lie end to end (`_spanning`), else, where
    `may_copy` and they are vectors (int8's per-column scales, biases: small), their concatenation; None where
    neither (panels that do not lie end to end), False where some are None and some not."""
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        return False
    spanning = _spanning(tensors)
    if spanning is None and may_copy and tensors[0].dim() == 1:
        return torch.cat(tensors)
    return spanning


def _spanning(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over `tensors` (contiguous, same trailing shape and dtype, end to end in one storage, in order),
    sharing their memory; None where they do not lie so."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not tensor.is_contiguous()
                or tensor.shape[1:] != first.shape[1:] or tensor.dtype != first.dtype
                or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _get_attr(graph: torch.fx.Graph, module: nn.Module, tensor: torch.Tensor, fake) -> torch.fx.Node:
    index = 0
    while hasattr(module, f"_hf_accel_merged_{index}"):
        index += 1
    name = f"_hf_accel_merged_{index}"
    module.register_buffer(name, tensor)
    node = graph.get_attr(name)
    node.meta["val"] = fake.from_tensor(tensor, static_shapes=True)  # a constant: no new size symbols
    return node
