"""RowLayer: a cache layer whose tensors all hold rows first (`[rows, ...]`), so beam reorders and batch selects are
one row selection applied to each of them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

RowSelect = Callable[[torch.Tensor], torch.Tensor]


class RowLayer(CacheLayerMixin):
    """`reorder_cache`, `batch_repeat_interleave` and `batch_select_indices` through the subclass's
    `_select_rows(select: RowSelect)`, which each subclass defines to apply `select` to every tensor it holds."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda t: t[indices])
