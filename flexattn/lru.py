"""`LRU`: the bounded, thread-safe mapping behind every in-memory cache of flexattn.

Each cache names its bound where it is made (docs/limits.md, "Bounds", lists them all). A cache
at its bound drops its least recently used entry: what is dropped is made again by the next call
that needs it (a trace, a plan, a module import), never answered wrongly.

    >>> cache = LRU(2)
    >>> cache["a"] = 1; cache["b"] = 2; cache.get("a"); cache["c"] = 3
    1
    >>> list(cache.keys())
    ['a', 'c']
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable


class LRU:
    """A mapping of at most ``limit`` entries; ``get`` and ``__setitem__`` mark an entry as used."""

    __slots__ = ("limit", "on_evict", "_data", "_lock")

    def __init__(self, limit: int, on_evict: Callable[[Any, Any], None] | None = None):
        """``on_evict(key, value)``: called for each entry dropped to keep the bound."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self.limit, self.on_evict = limit, on_evict
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _trim(self) -> None:
        data = self._data
        while len(data) > self.limit:
            key, value = data.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(key, value)

    def get(self, key: Hashable, default: Any = None) -> Any:
        # No lock (a hit is on every call's path): each OrderedDict operation is atomic on its own
        data = self._data
        value = data.get(key, _ABSENT)
        if value is _ABSENT:
            return default
        try:
            data.move_to_end(key)
        except KeyError:  # dropped by another thread meanwhile: still a right answer
            pass
        return value

    def __getitem__(self, key: Hashable) -> Any:
        value = self.get(key, _ABSENT)
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            self._trim()

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The entry of ``key``, made by ``make()`` and stored if there is none (one entry per key
        also when threads race: the first stored wins, ``make`` runs outside the lock)."""
        value = self.get(key, _ABSENT)
        if value is not _ABSENT:
            return value
        made = make()
        with self._lock:
            value = self._data.setdefault(key, made)
            self._data.move_to_end(key)
            self._trim()
            return value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._data.pop(key, default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def keys(self) -> list:
        with self._lock:
            return list(self._data)

    def items(self) -> list:
        with self._lock:
            return list(self._data.items())

    def values(self) -> list:
        with self._lock:
            return list(self._data.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)


_ABSENT = object()
