# cython: wraparound=False
# (every index below is a key or a list number checked to be >= 0: negative indices never wrap)
"""The eviction policies' data structures (libCacheSim's ``dataStructure/``): ordered key lists, an indexed
heap of keys and per-layer queues, all over per-key integer arrays with no allocation per request.

A policy file sees the cache through its hooks; these are what it keeps its order in. Keys are ints
``layer * num_experts + expert`` >= 0; the per-key arrays grow (by doubling) to the largest key seen.

Compiled, each class is an extension type (``structures.pxd``: the arrays are typed memoryviews, the
methods C calls); run as source, the same code on :mod:`array` arrays. Methods called per request are
written with their helpers inlined (one Python call per request instead of three when run as source; the
compiler inlines the helpers anyway).
"""

from __future__ import annotations

from array import array
from typing import Callable

from ...engine.hooks import Evictable, as_evictable


class KeyLists:
    """Ordered lists of keys, each key in at most one of them: doubly linked lists over per-key arrays
    (libCacheSim's queues). Appending, removing, moving a key to a list's back and splicing a whole list onto
    another's back are O(1) (a splice: O(its length) to re-own its keys), with no allocation per request;
    :meth:`first` walks a list from the front asking ``evictable`` in C. FIFO and LRU keep one list;
    :class:`LayerQueues` one per layer (and kind); ARC four. (The per-request methods write their list
    surgery out rather than share helpers: one Python call per request when run as source.)"""

    def __init__(self, lists: int = 1, keys: int = 0):
        n = max(keys, 1)
        self._next = array("q", [-2]) * n  # per key: the next key; -1: none (the back); -2: in no list
        self._prev = array("q", [-1]) * n
        self._owner = array("q", [-1]) * n  # per key: its list, -1: none
        self._front = array("q", [-1]) * lists
        self._back = array("q", [-1]) * lists
        self._size = array("q", [0]) * lists
        self._lists = lists

    def _grow(self, key: int) -> None:
        old = len(self._next)
        n = max(key + 1, 2 * old)
        nxt, prv, own = array("q", [-2]) * n, array("q", [-1]) * n, array("q", [-1]) * n
        for i in range(old):
            nxt[i], prv[i], own[i] = self._next[i], self._prev[i], self._owner[i]
        self._next, self._prev, self._owner = nxt, prv, own

    def _check(self, key: int, lst: int) -> None:
        """A key and a list a key may join: an IndexError when either is out of range (the arrays grow to
        hold a new key)."""
        if key < 0:
            raise IndexError(f"key {key} < 0")
        if lst < 0 or lst >= self._lists:
            raise IndexError(f"list {lst} of {self._lists}")
        if key >= len(self._next):
            self._grow(key)

    def push_back(self, key: int, lst: int = 0) -> None:
        """``key`` joins the back of list ``lst`` (a KeyError if it is in a list already)."""
        if key < 0 or key >= len(self._next) or lst < 0 or lst >= self._lists:
            self._check(key, lst)  # (raises, or grows the arrays for a new key)
        if self._owner[key] >= 0:
            raise KeyError(f"key {key} is already in list {self._owner[key]}")
        back = self._back[lst]
        self._owner[key] = lst
        self._next[key] = -1
        self._prev[key] = back
        if back >= 0:
            self._next[back] = key
        else:
            self._front[lst] = key
        self._back[lst] = key
        self._size[lst] += 1

    def remove(self, key: int) -> None:
        """``key`` leaves its list (a KeyError if it is in none)."""
        if key < 0 or key >= len(self._owner):
            raise KeyError(key)
        lst = self._owner[key]
        if lst < 0:
            raise KeyError(key)
        after = self._next[key]
        before = self._prev[key]
        if before >= 0:
            self._next[before] = after
        else:
            self._front[lst] = after
        if after >= 0:
            self._prev[after] = before
        else:
            self._back[lst] = before
        self._next[key] = -2
        self._prev[key] = -1
        self._owner[key] = -1
        self._size[lst] -= 1

    def discard(self, key: int) -> None:
        """:meth:`remove` if ``key`` is in a list."""
        if 0 <= key < len(self._owner) and self._owner[key] >= 0:
            self.remove(key)

    def move_back(self, key: int, lst: int = 0) -> None:
        """``key`` moves to (or joins) the back of list ``lst`` (LRU's hit: the unlink and the link written
        out, one call per request)."""
        if key < 0 or key >= len(self._next) or lst < 0 or lst >= self._lists:
            self._check(key, lst)  # (raises, or grows the arrays for a new key)
        owner = self._owner[key]
        if owner >= 0:
            if self._back[lst] == key:  # (already the back of ``lst``: the back of a list is in that list)
                return
            after = self._next[key]
            before = self._prev[key]
            if before >= 0:
                self._next[before] = after
            else:
                self._front[owner] = after
            if after >= 0:
                self._prev[after] = before
            else:
                self._back[owner] = before
            self._size[owner] -= 1
        back = self._back[lst]
        self._owner[key] = lst
        self._next[key] = -1
        self._prev[key] = back
        if back >= 0:
            self._next[back] = key
        else:
            self._front[lst] = key
        self._back[lst] = key
        self._size[lst] += 1

    def splice(self, src: int, dst: int) -> None:
        """Every key of list ``src``, in order, joins the back of list ``dst``; ``src`` is left empty."""
        if not (0 <= src < self._lists and 0 <= dst < self._lists):
            raise IndexError(f"lists {src}, {dst} of {self._lists}")
        head = self._front[src]
        if head < 0 or src == dst:
            return
        key = head
        while key >= 0:
            self._owner[key] = dst
            key = self._next[key]
        back = self._back[dst]
        if back >= 0:
            self._next[back] = head
            self._prev[head] = back
        else:
            self._front[dst] = head
        self._back[dst] = self._back[src]
        self._size[dst] += self._size[src]
        self._front[src] = self._back[src] = -1
        self._size[src] = 0

    def first(self, lst: int, evictable):
        """The first key of list ``lst``, from the front, that ``evictable`` accepts, or None."""
        if lst < 0 or lst >= self._lists:
            raise IndexError(f"list {lst} of {self._lists}")
        ev: Evictable = as_evictable(evictable)
        key = self._front[lst]
        while key >= 0:
            if ev.ok(key):
                return key
            key = self._next[key]
        return None

    def owner(self, key: int) -> int:
        """The list ``key`` is in, or -1."""
        if key < 0 or key >= len(self._owner):
            return -1
        return self._owner[key]

    def front(self, lst: int) -> int:
        """List ``lst``'s first key, or -1 when it is empty."""
        if lst < 0 or lst >= self._lists:
            raise IndexError(f"list {lst} of {self._lists}")
        return self._front[lst]

    def size(self, lst: int) -> int:
        if lst < 0 or lst >= self._lists:
            raise IndexError(f"list {lst} of {self._lists}")
        return self._size[lst]

    def keys(self, lst: int = 0) -> list:
        """List ``lst``'s keys, front to back."""
        if not 0 <= lst < self._lists:
            raise IndexError(f"list {lst} of {self._lists}")
        out, key = [], self._front[lst]
        while key >= 0:
            out.append(key)
            key = self._next[key]
        return out


class KeyHeap:
    """Keys ranked by two integers (or one float, :meth:`set_score`), smallest first (ties: the smaller key):
    an indexed binary min-heap over per-key arrays, as libCacheSim's priority queues, for a ranking policy
    whose ranks change in place (LFU's count and last use). :meth:`set` inserts or re-ranks a key in
    O(log N), :meth:`discard` removes it in O(log N), :meth:`first` finds the smallest evictable key, leaving
    it in the heap: the keys ranked before it that are not evictable (the running layer's experts, prefetches
    in flight: a handful) are set aside and put back. No allocation per operation."""

    def __init__(self, keys: int = 0):
        self._bits = array("d", [0.0])  # one double, and the same 8 bytes as an int64 (set_score)
        self._double = self._bits
        self._int = memoryview(self._bits).cast("B").cast("q")
        n = max(keys, 1)
        self._pos = array("q", [-1]) * n  # per key: its slot in the heap, -1: not in it
        self._p1 = array("q", [0]) * n  # per key: its rank
        self._p2 = array("q", [0]) * n
        self._heap = array("q", [0]) * n  # per slot: its key (slots 0 .. _n - 1 in heap order)
        self._aside = array("q", [0]) * n  # the search's keys set aside
        self._n = 0

    def _grow(self, key: int) -> None:
        old = len(self._pos)
        n = max(key + 1, 2 * old)
        pos, p1, p2 = array("q", [-1]) * n, array("q", [0]) * n, array("q", [0]) * n
        heap, aside = array("q", [0]) * n, array("q", [0]) * n
        for i in range(old):
            pos[i], p1[i], p2[i], heap[i] = self._pos[i], self._p1[i], self._p2[i], self._heap[i]
        self._pos, self._p1, self._p2, self._heap, self._aside = pos, p1, p2, heap, aside

    def __len__(self) -> int:
        return self._n

    def _less(self, a: int, b: int) -> bool:
        if self._p1[a] != self._p1[b]:
            return self._p1[a] < self._p1[b]
        if self._p2[a] != self._p2[b]:
            return self._p2[a] < self._p2[b]
        return a < b

    def _place(self, i: int, key: int) -> None:
        self._heap[i] = key
        self._pos[key] = i

    def _up(self, i: int) -> None:
        key = self._heap[i]
        while i > 0:
            parent = (i - 1) // 2
            if not self._less(key, self._heap[parent]):
                break
            self._place(i, self._heap[parent])
            i = parent
        self._place(i, key)

    def _down(self, i: int) -> None:
        key = self._heap[i]
        n = self._n
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and self._less(self._heap[child + 1], self._heap[child]):
                child += 1
            if not self._less(self._heap[child], key):
                break
            self._place(i, self._heap[child])
            i = child
        self._place(i, key)

    def set(self, key: int, p1: int, p2: int) -> None:
        """``key`` joins the heap ranked ``(p1, p2)``, or moves to that rank if it is in it."""
        if key < 0:
            raise IndexError(f"key {key} < 0")
        if key >= len(self._pos):
            self._grow(key)
        self._p1[key] = p1
        self._p2[key] = p2
        i = self._pos[key]
        if i < 0:
            i = self._n
            self._n += 1
            self._place(i, key)
            self._up(i)
        else:
            self._up(i)
            self._down(self._pos[key])

    def set_score(self, key: int, score: float) -> None:
        """``key`` ranked by a float, smallest first (ties: the smaller key): ``set(key, b, 0)`` with ``b`` an
        int64 that orders as ``score`` does (its IEEE bits, a negative one's magnitude bits flipped; -0.0
        is 0.0 first). For ranking policies whose ranks are floats (score, ml)."""
        self._double[0] = score + 0.0
        b = self._int[0]
        self.set(key, b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF), 0)

    def contains(self, key: int) -> bool:
        return 0 <= key < len(self._pos) and self._pos[key] >= 0

    def remove(self, key: int) -> None:
        """``key`` leaves the heap; a KeyError if it is not in it (a policy told to remove a key it never held)."""
        if not self.contains(key):
            raise KeyError(key)
        self.discard(key)

    def discard(self, key: int) -> None:
        """``key`` leaves the heap if it is in it."""
        if not self.contains(key):
            return
        i = self._pos[key]
        self._pos[key] = -1
        self._n -= 1
        if i < self._n:  # the last slot's key fills the hole, then finds its place
            last = self._heap[self._n]
            self._place(i, last)
            self._up(i)
            self._down(self._pos[last])

    def first(self, evictable):
        """The smallest key ``evictable`` accepts, left in the heap; None if there is none."""
        ev: Evictable = as_evictable(evictable)
        m = 0
        found = None
        while self._n > 0:
            top = self._heap[0]
            if ev.ok(top):
                found = top
                break
            self._aside[m] = top  # (at most every key once: the array holds them all)
            m += 1
            self.discard(top)
        for j in range(m):
            top = self._aside[j]
            self.set(top, self._p1[top], self._p2[top])
        return found

    def top(self) -> int:
        """The smallest key, or -1 when the heap is empty."""
        return self._heap[0] if self._n > 0 else -1

    def rank(self, key: int) -> int:
        """``key``'s first rank as last set (kept while it is out of the heap)."""
        if key < 0 or key >= len(self._p1):
            raise IndexError(f"key {key} of {len(self._p1)}")
        return self._p1[key]

    def keys(self) -> list:
        """The keys in the heap, smallest first (a new list: for checks and tests)."""
        return sorted(self._heap[:self._n], key=lambda k: (self._p1[k], self._p2[k], k))


class LayerQueues:
    """One FIFO of keys per MoE layer and *kind* (:class:`KeyLists`: list ``kind * num_layers + layer``),
    searched layer by layer in an order that depends on the layer being executed: the building block of the
    layer-aware policies (FLD: one kind; Least-Stale: stale and current). A victim search costs O(L) plus the
    pinned keys it skips, never a scan of the pool.

    ``order(current, num_layers)`` returns the layers in eviction order (first = evicted first); it is
    evaluated once per current layer and cached."""

    def __init__(self, num_layers: int, order: Callable[[int, int], list], kinds: int = 1):
        self.num_layers = num_layers
        self.lists = KeyLists(num_layers * kinds)
        self.order = order
        self._scans: dict = {}  # executing layer -> the layers in eviction order

    def add(self, layer: int, key: int, kind: int = 0) -> None:
        """``key`` joins the back of ``layer``'s FIFO of ``kind`` (moves there from wherever it is)."""
        self.lists.move_back(key, kind * self.num_layers + layer)

    def discard(self, key: int) -> None:
        """``key`` leaves its FIFO, if it is in one."""
        self.lists.discard(key)

    def merge(self, src: int, dst: int) -> None:
        """Every layer's FIFO of kind ``src`` joins the back of the same layer's FIFO of kind ``dst``."""
        L = self.num_layers
        for layer in range(L):
            self.lists.splice(src * L + layer, dst * L + layer)

    def first(self, current: int, evictable, kind: int = 0):
        """The first evictable key of ``kind``, layers in ``order(current)``, each FIFO front to back."""
        scan = self._scans.get(current)
        if scan is None:
            scan = list(self.order(current, self.num_layers))
            for layer in scan:
                if not 0 <= layer < self.num_layers:
                    raise ValueError(f"the layer order at layer {current} names a layer outside "
                                     f"0..{self.num_layers - 1}: {scan}")
            self._scans[current] = scan
        ev: Evictable = as_evictable(evictable)
        lists: KeyLists = self.lists
        base = kind * self.num_layers
        for layer in scan:
            key = lists.first(base + layer, ev)
            if key is not None:
                return key
        return None

    def keys(self, layer: int, kind: int = 0) -> list:
        """``layer``'s FIFO of ``kind``, front to back."""
        return self.lists.keys(kind * self.num_layers + layer)
