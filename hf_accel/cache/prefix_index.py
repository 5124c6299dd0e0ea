"""PrefixIndex: the prompt blocks a `PrefixStore` keeps, keyed by the block hash chain, in LRU order. Plain Python.

A block's key is `block_key(parent key, its token ids)` (`block_hash.py`), so equal keys mean equal prefixes. Rules:
- an entry is kept only while its parent is kept: chains are evicted leaves first;
- touching an entry touches its ancestors after it, so a parent is always more recently used than its children and
  the least recently used entry is always a leaf: eviction pops the oldest entry;
- after `insert` returns, the entries' bytes are at most `max_bytes`; an insert that could only fit by evicting its own
  parent is refused, and nothing changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixEntry:
    """One stored block: its parent's key (None for a prompt's first block), its payload (K/V, opaque here) and size."""

    parent: bytes | None
    payload: object
    nbytes: int
    num_children: int = 0


class PrefixIndex:
    """Blocks keyed by hash chain, least recently used first, within `max_bytes`. Not thread-safe (the store locks).
    `on_evict(payload)` is called for each entry evicted to make room (not for `clear`)."""

    def __init__(self, max_bytes: int, on_evict: Callable[[object], None] | None = None):
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.num_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def match(self, chain: Iterable[bytes]) -> list[PrefixEntry]:
        """The stored entries of the longest stored start of `chain` (keys from a prompt's first block on); the
        matched ones become the most recently used."""
        matched: list[bytes] = []
        for key in chain:
            if key not in self._entries:
                break
            matched.append(key)
        for key in reversed(matched):  # leaf first: parents end up more recent than children
            self._entries.move_to_end(key)
        return [self._entries[key] for key in matched]

    def insert(self, key: bytes, parent: bytes | None, payload: object, nbytes: int) -> bool:
        """Store a block under `key` whose parent block (stored, or None) is `parent`; evict least recently used
        chains to fit. False, with nothing changed, if the key is stored, the parent is not, or it cannot fit."""
        if key in self._entries or (parent is not None and parent not in self._entries):
            return False
        ancestors = list(self._ancestors(parent))
        if nbytes + sum(self._entries[a].nbytes for a in ancestors) > self.max_bytes:
            return False
        self._touch(ancestors)
        while self.num_bytes + nbytes > self.max_bytes:
            self._evict_oldest()  # never an ancestor: they are the most recent entries and fit with the new one
        self._entries[key] = PrefixEntry(parent, payload, nbytes)
        self.num_bytes += nbytes
        if parent is not None:
            self._entries[parent].num_children += 1
        self._touch([key, *ancestors])
        return True

    def clear(self) -> None:
        """Forget every entry (not counted as evictions)."""
        self._entries.clear()
        self.num_bytes = 0

    def _ancestors(self, key: bytes | None) -> Iterable[bytes]:
        while key is not None:
            yield key
            key = self._entries[key].parent

    def _touch(self, leaf_to_root: list[bytes]) -> None:
        for key in leaf_to_root:
            self._entries.move_to_end(key)

    def _evict_oldest(self) -> None:
        key, entry = self._entries.popitem(last=False)
        assert entry.num_children == 0, "the least recently used entry must be a leaf"
        self.num_bytes -= entry.nbytes
        self.num_evictions += 1
        if entry.parent is not None:
            self._entries[entry.parent].num_children -= 1
        if self.on_evict is not None:
            self.on_evict(entry.payload)
