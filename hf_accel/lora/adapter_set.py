"""`AdapterSet`: the adapters read into CPU memory, by `lora_int_id`, at most `max_cpu_loras` of them (least recently
used dropped first; a dropped adapter is read again when a request asks for it). Thread-safe: a request's adapter is
read in the caller's thread when the request is added (so a bad folder is the caller's ValueError), and taken by the
engine's thread when the request starts. `AdapterPaths`: the rule that an id names one folder for good."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from .adapter_files import AdapterWeights, read_adapter
from .config import LoRAConfig, LoRARequest


class AdapterPaths:
    """`lora_int_id` -> its folder, for good: an engine's slots and prefix cache know an adapter by its id, so an id
    never names a second folder, even after memory dropped the first one's weights (not thread-safe: callers lock)."""

    def __init__(self):
        self._paths: dict[int, str] = {}

    def check(self, request: LoRARequest) -> str:
        """`request`'s folder as a string; TypeError for a non-`LoRARequest`, ValueError when its id is bound to
        another folder."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"`lora_request` must be a hf_accel.LoRARequest, got {type(request).__name__}")
        path = str(Path(request.lora_path))
        known = self._paths.get(request.lora_int_id)
        if known is not None and known != path:
            raise ValueError(f"`lora_int_id` {request.lora_int_id} is the adapter from {known}, not {path}: give "
                             "each adapter folder its own id")
        return path

    def bind(self, request: LoRARequest) -> None:
        """Bind `request`'s id to its folder (`check` first)."""
        self._paths[request.lora_int_id] = self.check(request)


class AdapterSet:
    """Adapters for a base whose adaptable projections are `projections` (module name -> `(in, out)`), in
    `dtype`, under `config`'s limits."""

    def __init__(self, config: LoRAConfig, projections: dict[str, tuple[int, int]], dtype: torch.dtype):
        self.config, self.projections, self.dtype = config, projections, dtype
        self._adapters: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._paths = AdapterPaths()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, request: LoRARequest) -> AdapterWeights:
        """`request`'s adapter, read now if it is not in memory; ValueError for a folder that cannot be served, or
        an id already held by another folder."""
        with self._lock:
            path = self._paths.check(request)
            found = self._adapters.get(request.lora_int_id)
            if found is not None:
                self._adapters.move_to_end(request.lora_int_id)
                return found
        # read outside the lock (disk and safetensors): two threads may read the same folder once each
        weights = read_adapter(request.lora_name, path, self.projections, self.config.max_lora_rank, self.dtype)
        with self._lock:
            self._paths.bind(request)  # another thread may have bound the id meanwhile
            self._adapters[request.lora_int_id] = weights
            self._adapters.move_to_end(request.lora_int_id)
            while len(self._adapters) > self.config.max_cpu_loras:
                self._adapters.popitem(last=False)
        return weights

    def remove(self, lora_int_id: int) -> None:
        """Drop the adapter's weights from memory (a later request with its id reads the folder again)."""
        with self._lock:
            self._adapters.pop(lora_int_id, None)
