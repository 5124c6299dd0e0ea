"""`AdapterSlots`: which adapters are resident in the projections' stacked weights, `max_loras` at a time.

A slot is pinned while a running sequence uses its adapter (one pin per sequence); an unpinned resident adapter stays
in its slot for the next request that asks for it, and is the first to go (least recently released) when another
adapter needs a slot and none is free. `acquire` fails, changing nothing, when every slot is pinned: the caller
keeps that sequence waiting.
"""

from __future__ import annotations

from collections import OrderedDict

from .adapter_files import AdapterWeights
from .layers import LoRAProjection


class AdapterSlots:
    """Slots over `projections` (module name -> its `LoRAProjection`), `max_loras` of them."""

    def __init__(self, projections: dict[str, LoRAProjection], max_loras: int):
        self.projections = projections
        self.ranks = [0] * max_loras  # rank of the adapter in each slot (0: empty)
        self._slot: dict[int, int] = {}  # lora_int_id -> its slot
        self._pins: dict[int, int] = {}  # lora_int_id -> running sequences using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unpinned ids, least recently released first
        self._free = list(range(max_loras - 1, -1, -1))  # never-used slots, popped from the end
        self._evicting: set[int] = set()  # pinned ids removed from the engine: their slot goes at the last release

    def slot_of(self, lora_id: int) -> int | None:
        return self._slot.get(lora_id)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def acquire(self, lora_id: int, weights: AdapterWeights) -> int | None:
        """A pin on `lora_id`'s slot, placing `weights` there first if it is not resident (evicting the least
        recently released idle adapter when no slot is free); None, and no change, when every slot is pinned."""
        slot = self._slot.get(lora_id)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            for name, projection in self.projections.items():
                projection.place(slot, weights.modules.get(name))
            self._slot[lora_id], self.ranks[slot] = slot, weights.rank
        self._idle.pop(lora_id, None)
        self._pins[lora_id] = self._pins.get(lora_id, 0) + 1
        return slot

    def release(self, lora_id: int) -> None:
        """Drop one pin on `lora_id`; with none left it stays resident, idle."""
        pins = self._pins[lora_id] - 1
        if pins:
            self._pins[lora_id] = pins
            return
        del self._pins[lora_id]
        if lora_id in self._evicting:  # removed while in use: its slot goes now
            self._evicting.discard(lora_id)
            self._free_slot(lora_id)
        else:
            self._idle[lora_id] = None

    def evict(self, lora_id: int) -> None:
        """Free `lora_id`'s slot: now if it is resident and idle, else at its last release (a pinned adapter stays
        while sequences use it)."""
        if lora_id in self._pins:
            self._evicting.add(lora_id)
        elif lora_id in self._idle:
            del self._idle[lora_id]
            self._free_slot(lora_id)

    def _free_slot(self, lora_id: int) -> None:
        slot = self._slot.pop(lora_id)
        self.ranks[slot] = 0
        self._free.append(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._idle:
            return None
        evicted, _ = self._idle.popitem(last=False)
        slot = self._slot.pop(evicted)
        self.ranks[slot] = 0
        return slot
