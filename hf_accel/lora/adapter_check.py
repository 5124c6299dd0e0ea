"""`AdapterShapes`: what an adapter must fit to be served over one base (picklable: an engine-core process sends it
to its caller); `AdapterCheck`: adapters checked against it in the caller's thread without keeping their weights
(what `EngineProcess` does, its engine-core process reading each adapter again for itself)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from .adapter_files import read_adapter
from .adapter_set import AdapterPaths
from .config import LoRAConfig, LoRARequest


class AdapterChecker(Protocol):
    """What an engine's `Admission` needs: `check` an adapter (ValueError / TypeError when it cannot be served)."""

    def check(self, request: LoRARequest) -> None: ...


@dataclass(frozen=True)
class AdapterShapes:
    """The engine's limits (`config`), the base's adaptable projections (module name -> `(in, out)`) and dtype."""

    config: LoRAConfig
    projections: dict[str, tuple[int, int]]
    dtype: torch.dtype


class AdapterCheck:
    """Adapters checked against `shapes` (thread-safe); an id checked once is not read again until `remove`."""

    def __init__(self, shapes: AdapterShapes):
        self.shapes = shapes
        self._paths = AdapterPaths()
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    def check(self, request: LoRARequest) -> None:
        """Read `request`'s adapter once and let it go; ValueError naming what does not fit, or an id bound to
        another folder."""
        with self._lock:
            path = self._paths.check(request)
            if request.lora_int_id in self._checked:
                return
        read_adapter(request.lora_name, path, self.shapes.projections, self.shapes.config.max_lora_rank,
                     self.shapes.dtype)
        with self._lock:
            self._paths.bind(request)
            self._checked.add(request.lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        """Forget that the adapter was checked: the next request with its id reads the folder again."""
        with self._lock:
            self._checked.discard(lora_int_id)
