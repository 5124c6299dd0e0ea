"""Where the quantized Linears' panels live: moved, once packed and co-located, onto transparent huge pages
(`kernels.custom_ops.on_huge_pages`), since a decode streams every panel byte once a token and on 4 KiB pages a
TLB miss every 4 KiB held the reads well under the memory's rate (docs/weight-quantization.md has the figures).

Panels that share a storage (siblings co-located by `sibling_linears.colocate_siblings`) move together: their storage
is copied once and each module gets the same view of the copy, so they still lie end to end. The old storages are
freed as the modules let go of them; values, shapes and strides are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.custom_ops import on_huge_pages
from .linear import PANEL_ATTRIBUTES


@torch.inference_mode(False)
@torch.no_grad()
def move_panels_to_huge_pages(model: nn.Module) -> int:
    """Move the CPU panels of every quantized Linear of `model` in layout "panels" onto huge pages (a no-op where the
    extension is not built); returns how many storages were moved."""
    copies: dict[int, torch.Tensor] = {}  # old storage's address -> its copy, as bytes
    for module in model.modules():
        names = PANEL_ATTRIBUTES.get(type(module), ())
        if not names or module.layout != "panels":
            continue
        for name in names:
            tensor = getattr(module, name)
            if tensor is None or tensor.device.type != "cpu":
                continue
            moved = _moved(tensor, copies)
            if moved is None:
                return len(copies)  # nothing to move onto: the extension is not there
            if name == "weight":
                module.weight = nn.Parameter(moved, requires_grad=False)
            else:
                setattr(module, name, moved)  # a registered buffer: stays one
    return len(copies)


def _moved(tensor: torch.Tensor, copies: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """`tensor` as the same view of its storage's copy on huge pages (made on first ask), or None where the copy
    would be the storage itself."""
    storage = tensor.detach().untyped_storage()
    key = storage.data_ptr()
    if key not in copies:
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # the storage's bytes
        copy = on_huge_pages(whole)
        if copy.data_ptr() == whole.data_ptr():
            return None
        copies[key] = copy
    return copies[key].view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
