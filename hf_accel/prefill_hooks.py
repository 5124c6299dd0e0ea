"""`PrefillHooks`: the interface of a cache that wants the prompt around generate's prefill forward.

It lives apart from `registry.py` (which checks it with `isinstance` inside its `_prefill` wrapper) so that
`importlib.reload(hf_accel.registry)`, or a notebook's autoreload, keeps the one class every cache subclasses: a
class defined in the reloaded module would be a new class that no existing cache is an instance of, and the prefix
store would silently stop being consulted.
"""

from __future__ import annotations

import abc

import torch


class PrefillHooks(abc.ABC):
    """A cache that wants the prompt around generate's prefill forward (`_sample` and `_beam_search` call it once).

    `input_ids`: `[rows, width]` prompt rows, already expanded for beams / num_return_sequences; `attention_mask`:
    their 2-D padding mask, or None for no padding. `before_prefill` may fill the cache with leading columns; generate
    then computes only the columns after the cache's `get_seq_length()`."""

    @abc.abstractmethod
    def before_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Called before the prefill forward."""

    @abc.abstractmethod
    def after_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Called after the prefill forward, which stored the whole prompt."""
