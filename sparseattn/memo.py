"""Memo: the package's one cache mechanism.

An object keeps what it derives from itself in a :class:`Memo` that it owns (a pattern its
graphs and drawn tables, a graph the engines' plans, a block plan its chunks). A memo is
**bounded** (least recently used first out); **safe under threads** (reads and writes hold a
lock, ``make()`` runs outside it, so two threads missing one key may both make it: the first
stored wins); **never pickled or copied** (its owner's pickle or deep copy gets an empty memo).
:meth:`Memo.peek` reads without locking or reordering: what a traced function (a compiled
FlexAttention ``mask_mod``) may call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

__all__ = ["Memo"]

T = TypeVar("T")


class Memo:
    """A bounded, thread-safe LRU map from hashable keys to derived values.

    Args:
        maxsize: entries kept (None: unbounded — for values bounded by their owner, e.g. one
            plan per engine and device of a graph).
    """

    __slots__ = ("_data", "_lock", "maxsize")

    def __init__(self, maxsize: int | None = None) -> None:
        if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 1):
            raise ValueError(f"maxsize must be a positive int or None, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value kept for ``key``, made by ``make()`` and kept on a miss."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = make()
        with self._lock:
            value = self._data.setdefault(key, value)
            self._data.move_to_end(key)
            while self.maxsize is not None and len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value kept for ``key`` (or ``default``), without locking or reordering."""
        return self._data.get(key, default)

    def discard(self, keep: Callable[[Hashable], bool] | None = None) -> None:
        """Drop every entry (``keep`` None) or those whose key ``keep`` rejects."""
        with self._lock:
            if keep is None:
                self._data.clear()
            else:
                for key in [k for k in self._data if not keep(k)]:
                    del self._data[key]

    def keys(self) -> list[Hashable]:
        """The keys kept, least recently used first (a copy)."""
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __reduce__(self):
        return (Memo, (self.maxsize,))

    def __deepcopy__(self, _memo: dict) -> Memo:
        return Memo(self.maxsize)

    def __copy__(self) -> Memo:
        return Memo(self.maxsize)

    def __repr__(self) -> str:
        return f"Memo({len(self)} of {self.maxsize or 'unbounded'})"
