"""Eviction policies (SpecMD §3.1.3, App. B) choose the victim when a cache pool is full.

The cache manager keeps one policy instance per pool (one pool in ``hardware.scope=global``, one per
MoE layer in ``per_layer``) and tells it about every insert, hit and removal. Keys are ints
``layer * num_experts + expert`` (``layer`` is the MoE-layer ordinal); ``self.keys`` converts.
``victim(evictable)`` returns the key to evict among those for which ``evictable(key)`` is true (the
manager excludes the experts the running layer uses and prefetches still in flight), or ``None``.

Hooks with a default no-op: ``on_miss(key)`` (the model requested ``key`` and it was not resident:
called for every demand miss whatever becomes of it -- fetched and inserted, streamed, dropped,
substituted or computed on the host -- before room is made; policies that count requests use it),
``on_pass_start`` (a new forward pass), ``on_layer(layer, record)``
(execution reached a MoE layer; ``record`` is its :class:`~specmd.engine.record.GateRecord`, or None when
a test drives the cache without one), ``on_admit`` (a missing key is about to be inserted, before room is
made for it: adaptive policies such as ARC and LeCaR learn from their ghost lists here).
``setup(model)`` sees the :class:`~specmd.engine.ModelView` (geometry; ``model.future`` when a trace
provides the future, which is how ``belady`` sees next uses); ``attach(view, capacity)`` gives the pool's
byte budget and the read-only :class:`~specmd.engine.view.CacheView` (an entry's precision, bits, bytes,
in-flight state). A policy never sees the cache manager, and nothing tells it which driver feeds it.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Optional

import cython

from ...engine.hooks import Evictable, EvictionHooks, as_evictable
from ...registry import Registry


class KeySpace:
    __slots__ = ("num_experts",)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def split(self, key: int) -> tuple[int, int]:
        return divmod(key, self.num_experts)


@cython.cclass
class EvictionPolicy(EvictionHooks):
    """The base of every eviction policy: a :class:`~specmd.policies.base.Policy` (``name``, ``Params``,
    ``params``, ``setup``, ``needs_future``) whose per-request hooks the cache manager may call in C
    (:mod:`specmd.engine.hooks`). An extension type cannot derive from the Python class ``Policy``, so it
    carries Policy's members itself. A subclass written as a plain Python class (a user's policy) works
    unchanged; a built-in policy compiled as an extension type has a ``.pxd`` beside its file (``lru.pxd``)
    and names itself in its class body (``name = "lru"``: an extension type's attributes cannot be set
    after its class statement, so the registry checks the name instead of setting it)."""

    name = None
    Params = None
    needs_future = False  # oracles: only a trace replay can run them
    reads_logits = False  # (specmd.policies.base.Policy.reads_logits) True for a policy that reads probabilities

    def __init__(self, params: Any = None):
        self.params = params
        self.keys: Optional[KeySpace] = None
        self.view = None
        self.capacity = 0

    def setup(self, model: Any) -> None:
        """Called once with the :class:`~specmd.engine.ModelView` when the engine is built."""

    def attach(self, view: Any, capacity: int) -> None:
        """Called once by the engine: ``capacity`` is this instance's byte budget."""
        self.view = view
        self.capacity = capacity
        self.keys = KeySpace(view.geometry.num_experts)

    def capacity_experts(self, unit: str = "fetch") -> int:
        """The pool's capacity in experts (ARC's and LeCaR's ``c``), counted in copies at ``unit``:
        ``fetch``, the precision the miss policy loads (how many copies the pool really holds when a
        quantized cascade fills it), or ``native``, the stored precision (the model's own expert size)."""
        nbytes = (self.view.bytes_of(self.view.fetch_precision) if unit == "fetch"
                  else self.view.geometry.expert_bytes)
        return max(1, self.capacity // nbytes)

    # on_insert(key, prefetch), on_access(key), on_remove(key), victim(evictable): EvictionHooks'

    def on_miss(self, key: int) -> None:
        pass

    def miss_hook(self) -> Optional[Callable[[int], None]]:
        """What the manager calls for every demand miss: ``on_miss`` when a subclass overrides it, else
        None (then no call per miss at all). A policy whose params switch miss counting off returns None."""
        return self.on_miss if type(self).on_miss is not EvictionPolicy.on_miss else None

    def hook(self, name: str) -> Optional[Callable]:
        """The bound method ``name`` (``on_admit``, ``on_layer``) when a subclass overrides it, else None: the
        manager then skips the base class's no-op instead of calling it per miss or per layer call."""
        return getattr(self, name) if getattr(type(self), name) is not getattr(EvictionPolicy, name) else None

    def on_pass_start(self, pass_index: int) -> None:
        pass

    def on_layer(self, layer: int, record: Any = None) -> None:
        pass

    def on_admit(self, key: int) -> None:
        pass


@cython.cclass
class OrderedEviction(EvictionPolicy):
    """Keeps the pool's resident keys in one insertion-ordered dict, ``_order``. By default the first
    evictable key of it is the victim (FIFO order; a subclass may reorder it on access); ranking policies
    (LFU, score, ml) override ``victim`` and rank its keys."""

    def __init__(self, params=None):
        super().__init__(params)
        self._order: dict[int, None] = {}

    @cython.ccall
    def on_insert(self, key: cython.longlong, prefetch: cython.bint):
        self._order[key] = None

    @cython.ccall
    def on_access(self, key: cython.longlong):
        pass

    @cython.ccall
    def on_remove(self, key: cython.longlong):
        del self._order[key]

    @cython.ccall
    def victim(self, evictable):
        ev: Evictable = as_evictable(evictable)
        for key in self._order:
            if ev.ok(key):
                return key
        return None


@cython.cclass
class KeyLists:
    """Ordered lists of keys, each key in at most one of them: doubly linked lists over per-key arrays
    (libCacheSim's queues). Appending, removing, moving a key to a list's back and splicing a whole list onto
    another's back are O(1) (a splice: O(its length) to re-own its keys), with no allocation per request;
    :meth:`first` walks a list from the front asking ``evictable`` in C. The per-key arrays grow to the
    largest key seen. FIFO and LRU keep one list; :class:`LayerQueues` one per layer (and kind).
    (Compiled, the arrays are typed memoryview fields, ``base.pxd``: indexing them is C.)"""

    def __init__(self, lists: int = 1, keys: int = 0):
        n = max(keys, 1)
        self._next = array("q", [-2]) * n  # per key: the next key; -1: none (the back); -2: in no list
        self._prev = array("q", [-1]) * n
        self._owner = array("q", [-1]) * n  # per key: its list, -1: none
        self._front = array("q", [-1]) * lists
        self._back = array("q", [-1]) * lists
        self._size = array("q", [0]) * lists

    def _grow(self, key: cython.longlong):
        old = len(self._next)
        n = max(key + 1, 2 * old)
        nxt, prv, own = array("q", [-2]) * n, array("q", [-1]) * n, array("q", [-1]) * n
        for i in range(old):
            nxt[i], prv[i], own[i] = self._next[i], self._prev[i], self._owner[i]
        self._next, self._prev, self._owner = nxt, prv, own

    @cython.cfunc
    @cython.boundscheck(False)  # (callers check the key and the list)
    @cython.wraparound(False)
    def _link_back(self, key: cython.longlong, lst: cython.long):
        """``key`` (in no list) joins the back of list ``lst``."""
        back: cython.longlong = self._back[lst]
        self._owner[key] = lst
        self._next[key] = -1
        self._prev[key] = back
        if back >= 0:
            self._next[back] = key
        else:
            self._front[lst] = key
        self._back[lst] = key
        self._size[lst] += 1

    @cython.cfunc
    @cython.boundscheck(False)  # (callers check the key; its list is one it joined)
    @cython.wraparound(False)
    def _unlink(self, key: cython.longlong):
        """``key`` (in a list) leaves it."""
        lst: cython.longlong = self._owner[key]
        after: cython.longlong = self._next[key]
        before: cython.longlong = self._prev[key]
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

    @cython.cfunc
    def _check(self, key: cython.longlong, lst: cython.long):
        """A key and a list a key may join: an IndexError when either is out of range (the arrays grow to
        hold a new key)."""
        if key < 0:
            raise IndexError(f"key {key} < 0")
        if lst < 0 or lst >= len(self._front):
            raise IndexError(f"list {lst} of {len(self._front)}")
        if key >= len(self._next):
            self._grow(key)

    @cython.ccall
    @cython.boundscheck(False)  # (the key and the list are checked: an IndexError, never a stray write)
    @cython.wraparound(False)
    def push_back(self, key: cython.longlong, lst: cython.long = 0):
        """``key`` joins the back of list ``lst`` (a KeyError if it is in a list already)."""
        self._check(key, lst)
        if self._owner[key] >= 0:
            raise KeyError(f"key {key} is already in list {self._owner[key]}")
        self._link_back(key, lst)

    @cython.ccall
    @cython.boundscheck(False)  # (the key is checked)
    @cython.wraparound(False)
    def remove(self, key: cython.longlong):
        """``key`` leaves its list (a KeyError if it is in none)."""
        if key < 0 or key >= len(self._next) or self._owner[key] < 0:
            raise KeyError(key)
        self._unlink(key)

    @cython.ccall
    def discard(self, key: cython.longlong):
        """:meth:`remove` if ``key`` is in a list."""
        if self.owner(key) >= 0:
            self._unlink(key)

    @cython.ccall
    @cython.boundscheck(False)  # (the key and the list are checked)
    @cython.wraparound(False)
    def move_back(self, key: cython.longlong, lst: cython.long = 0):
        """``key`` moves to (or joins) the back of list ``lst``."""
        self._check(key, lst)
        if self._owner[key] >= 0:
            if self._back[lst] == key:  # (already the back of ``lst``: the back of a list is in that list)
                return
            self._unlink(key)
        self._link_back(key, lst)

    @cython.ccall
    @cython.boundscheck(True)
    def splice(self, src: cython.long, dst: cython.long):
        """Every key of list ``src``, in order, joins the back of list ``dst``; ``src`` is left empty."""
        head: cython.longlong = self._front[src]
        if head < 0 or src == dst:
            return
        key: cython.longlong = head
        while key >= 0:
            self._owner[key] = dst
            key = self._next[key]
        back: cython.longlong = self._back[dst]
        if back >= 0:
            self._next[back] = head
            self._prev[head] = back
        else:
            self._front[dst] = head
        self._back[dst] = self._back[src]
        self._size[dst] += self._size[src]
        self._front[src] = self._back[src] = -1
        self._size[src] = 0

    @cython.ccall
    @cython.wraparound(False)  # (the list is checked below; the keys are ones that joined it)
    def first(self, lst: cython.long, evictable):
        """The first key of list ``lst``, from the front, that ``evictable`` accepts, or None."""
        if lst < 0 or lst >= len(self._front):
            raise IndexError(f"list {lst} of {len(self._front)}")
        ev: Evictable = as_evictable(evictable)
        key: cython.longlong = self._front[lst]
        while key >= 0:
            if ev.ok(key):
                return key
            key = self._next[key]
        return None

    @cython.ccall
    @cython.wraparound(False)  # (the key is checked below)
    def owner(self, key: cython.longlong) -> cython.longlong:
        """The list ``key`` is in, or -1."""
        if key < 0 or key >= len(self._owner):
            return -1
        return self._owner[key]

    @cython.ccall
    @cython.boundscheck(True)
    def front(self, lst: cython.long) -> cython.longlong:
        """List ``lst``'s first key, or -1 when it is empty."""
        return self._front[lst]

    @cython.ccall
    @cython.boundscheck(True)
    def size(self, lst: cython.long) -> cython.longlong:
        return self._size[lst]

    def keys(self, lst: int = 0) -> list:
        """List ``lst``'s keys, front to back."""
        if not 0 <= lst < len(self._front):
            raise IndexError(f"list {lst} of {len(self._front)}")
        out, key = [], self._front[lst]
        while key >= 0:
            out.append(key)
            key = self._next[key]
        return out


CAPACITY_UNITS = ("fetch", "native")  # ARC's and LeCaR's ``capacity_unit`` readings


@cython.cclass
class KeyHeap:
    """Keys ranked by two integers (or one float, :meth:`set_score`), smallest first (ties: the smaller key): an indexed binary min-heap over
    per-key arrays, as libCacheSim's priority queues, for a ranking policy whose ranks change in place (LFU's
    count and last use). :meth:`set` inserts or re-ranks a key in O(log N), :meth:`discard` removes it in
    O(log N), :meth:`first` finds the smallest evictable key, leaving it in the heap: the keys ranked before
    it that are not evictable (the running layer's experts, prefetches in flight: a handful) are set aside
    and put back. No allocation per operation. (Compiled, an extension type, ``base.pxd``.)"""

    def __cinit__(self, *args, **kwargs):
        self._n = 0
        self._scratch()

    def _scratch(self):
        self._bits = array("d", [0.0])  # one double, and the same 8 bytes as an int64 (set_score)
        self._double = self._bits
        self._int = memoryview(self._bits).cast("B").cast("q")

    def __init__(self, keys: int = 0):
        self._scratch()
        n = max(keys, 1)
        self._pos = array("q", [-1]) * n  # per key: its slot in the heap, -1: not in it
        self._p1 = array("q", [0]) * n  # per key: its rank
        self._p2 = array("q", [0]) * n
        self._heap = array("q", [0]) * n  # per slot: its key (slots 0 .. _n - 1 in heap order)
        self._aside = array("q", [0]) * n  # the search's keys set aside
        self._n = 0

    def _grow(self, key: cython.longlong):
        old = len(self._pos)
        n = max(key + 1, 2 * old)
        pos, p1, p2 = array("q", [-1]) * n, array("q", [0]) * n, array("q", [0]) * n
        heap, aside = array("q", [0]) * n, array("q", [0]) * n
        for i in range(old):
            pos[i], p1[i], p2[i], heap[i] = self._pos[i], self._p1[i], self._p2[i], self._heap[i]
        self._pos, self._p1, self._p2, self._heap, self._aside = pos, p1, p2, heap, aside

    def __len__(self) -> int:
        return self._n

    @cython.cfunc
    @cython.boundscheck(False)  # (keys in the heap are in range)
    @cython.wraparound(False)
    def _less(self, a: cython.longlong, b: cython.longlong) -> cython.bint:
        if self._p1[a] != self._p1[b]:
            return self._p1[a] < self._p1[b]
        if self._p2[a] != self._p2[b]:
            return self._p2[a] < self._p2[b]
        return a < b

    @cython.cfunc
    @cython.boundscheck(False)  # (slots below _n)
    @cython.wraparound(False)
    def _place(self, i: cython.Py_ssize_t, key: cython.longlong):
        self._heap[i] = key
        self._pos[key] = i

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _up(self, i: cython.Py_ssize_t):
        key: cython.longlong = self._heap[i]
        parent: cython.Py_ssize_t
        while i > 0:
            parent = (i - 1) // 2
            if not self._less(key, self._heap[parent]):
                break
            self._place(i, self._heap[parent])
            i = parent
        self._place(i, key)

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _down(self, i: cython.Py_ssize_t):
        key: cython.longlong = self._heap[i]
        n: cython.Py_ssize_t = self._n
        child: cython.Py_ssize_t
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

    @cython.ccall
    @cython.boundscheck(False)  # (the key is checked)
    @cython.wraparound(False)
    def set(self, key: cython.longlong, p1: cython.longlong, p2: cython.longlong):
        """``key`` joins the heap ranked ``(p1, p2)``, or moves to that rank if it is in it."""
        if key < 0:
            raise IndexError(f"key {key} < 0")
        if key >= len(self._pos):
            self._grow(key)
        self._p1[key] = p1
        self._p2[key] = p2
        i: cython.Py_ssize_t = self._pos[key]
        if i < 0:
            i = self._n
            self._n += 1
            self._place(i, key)
            self._up(i)
        else:
            self._up(i)
            self._down(self._pos[key])

    @cython.ccall
    @cython.boundscheck(False)  # (a one-element scratch, set by __cinit__)
    @cython.wraparound(False)
    @cython.initializedcheck(False)
    def set_score(self, key: cython.longlong, score: cython.double):
        """``key`` ranked by a float, smallest first (ties: the smaller key): ``set(key, b, 0)`` with ``b`` an
        int64 that orders as ``score`` does (its IEEE bits, a negative one's magnitude bits flipped; -0.0
        is 0.0 first). For ranking policies whose ranks are floats (score, ml)."""
        self._double[0] = score + 0.0
        b: cython.longlong = self._int[0]
        self.set(key, b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF), 0)

    @cython.ccall
    @cython.wraparound(False)  # (the key is checked)
    def contains(self, key: cython.longlong) -> cython.bint:
        return 0 <= key < len(self._pos) and self._pos[key] >= 0

    @cython.ccall
    def remove(self, key: cython.longlong):
        """``key`` leaves the heap; a KeyError if it is not in it (a policy told to remove a key it never held)."""
        if not self.contains(key):
            raise KeyError(key)
        self.discard(key)

    @cython.ccall
    @cython.boundscheck(False)  # (the key is checked)
    @cython.wraparound(False)
    def discard(self, key: cython.longlong):
        """``key`` leaves the heap if it is in it."""
        if not self.contains(key):
            return
        i: cython.Py_ssize_t = self._pos[key]
        self._pos[key] = -1
        self._n -= 1
        if i < self._n:  # the last slot's key fills the hole, then finds its place
            last: cython.longlong = self._heap[self._n]
            self._place(i, last)
            self._up(i)
            self._down(self._pos[last])

    @cython.ccall
    @cython.boundscheck(False)  # (keys in the heap are in range)
    @cython.wraparound(False)
    def first(self, evictable):
        """The smallest key ``evictable`` accepts, left in the heap; None if there is none."""
        ev: Evictable = as_evictable(evictable)
        m: cython.Py_ssize_t = 0
        j: cython.Py_ssize_t
        top: cython.longlong
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

    @cython.ccall
    def top(self) -> cython.longlong:
        """The smallest key, or -1 when the heap is empty."""
        return self._heap[0] if self._n > 0 else -1

    @cython.ccall
    @cython.boundscheck(True)
    def rank(self, key: cython.longlong) -> cython.longlong:
        """``key``'s first rank as last set (kept while it is out of the heap)."""
        return self._p1[key]

    def keys(self) -> list:
        """The keys in the heap, smallest first (a new list: for checks and tests)."""
        return sorted(self._heap[:self._n], key=lambda k: (self._p1[k], self._p2[k], k))


@cython.cclass
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

    @cython.ccall
    def add(self, layer: cython.long, key: cython.longlong, kind: cython.long = 0):
        """``key`` joins the back of ``layer``'s FIFO of ``kind`` (moves there from wherever it is)."""
        self.lists.move_back(key, kind * self.num_layers + layer)

    @cython.ccall
    def discard(self, key: cython.longlong):
        """``key`` leaves its FIFO, if it is in one."""
        self.lists.discard(key)

    @cython.ccall
    def merge(self, src: cython.long, dst: cython.long):
        """Every layer's FIFO of kind ``src`` joins the back of the same layer's FIFO of kind ``dst``."""
        L: cython.long = self.num_layers
        layer: cython.long
        for layer in range(L):
            self.lists.splice(src * L + layer, dst * L + layer)

    @cython.ccall
    def first(self, current: cython.long, evictable, kind: cython.long = 0):
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
        base: cython.long = kind * self.num_layers
        layer: cython.long
        for layer in scan:
            key = lists.first(base + layer, ev)
            if key is not None:
                return key
        return None

    def keys(self, layer: int, kind: int = 0) -> list:
        """``layer``'s FIFO of ``kind``, front to back."""
        return self.lists.keys(kind * self.num_layers + layer)


EVICTION: Registry[EvictionPolicy] = Registry("eviction", "specmd.policies.eviction")
