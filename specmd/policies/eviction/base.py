"""Eviction policies (SpecMD §3.1.3, App. B) choose the victim when a cache pool is full.

The cache manager keeps one policy instance per pool (one pool in ``hardware.scope=global``, one per
MoE layer in ``per_layer``) and tells it about every insert, hit and removal. Keys are ints
``layer * num_experts + expert`` (``layer`` is the MoE-layer ordinal: ``divmod(key, num_experts)``).
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

from typing import Any, Callable, Optional

from ...engine.hooks import Evictable, EvictionHooks, as_evictable
from ...registry import Registry


class EvictionPolicy(EvictionHooks):
    """The base of every eviction policy: a :class:`~specmd.policies.base.Policy` (``name``, ``Params``,
    ``params``, ``setup``, ``needs_future``) whose per-request hooks the cache manager may call in C
    (:mod:`specmd.engine.hooks`). An extension type cannot derive from the Python class ``Policy``, so it
    carries Policy's members itself. A subclass written as a plain Python class (a user's policy) works
    unchanged; a built-in policy compiled as an extension type has a ``.pxd`` beside its file (``lru.pxd``:
    its C declarations, the ``.py`` stays plain Python). Every policy names itself in its class body
    (``name = "lru"``) and registers with one statement after it, ``EVICTION.register(LRU)`` (the one style
    of all four families: Cython takes no decorator on an extension type)."""

    name = None
    Params = None
    needs_future = False  # oracles: only a trace replay can run them
    reads_logits = False  # (specmd.policies.base.Policy.reads_logits) True for a policy that reads probabilities

    def __init__(self, params: Any = None):
        self.params = params
        self.view = None
        self.capacity = 0

    def setup(self, model: Any) -> None:
        """Called once with the :class:`~specmd.engine.ModelView` when the engine is built."""

    def attach(self, view: Any, capacity: int) -> None:
        """Called once by the engine: ``capacity`` is this instance's byte budget."""
        self.view = view
        self.capacity = capacity

    def resized(self, capacity: int) -> None:
        """The pool's byte budget changed (``hardware.memory_gb``: the KV cache took or gave back memory;
        ``hardware.layer_budget``: the warm-up resized the pools), before the pass it applies to; the manager has
        evicted down to it already. A policy that sizes its state by the capacity (ARC's and LeCaR's ``c``)
        recomputes it here."""
        self.capacity = capacity

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


class OrderedEviction(EvictionPolicy):
    """Keeps the pool's resident keys in one insertion-ordered dict, ``_order``. By default the first
    evictable key of it is the victim (FIFO order; a subclass may reorder it on access); ranking policies
    (LFU, score, ml) override ``victim`` and rank its keys."""

    def __init__(self, params=None):
        super().__init__(params)
        self._order: dict[int, None] = {}

    def on_insert(self, key: int, prefetch: bool) -> None:
        self._order[key] = None

    def on_access(self, key: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        del self._order[key]

    def victim(self, evictable):
        ev: Evictable = as_evictable(evictable)
        for key in self._order:
            if ev.ok(key):
                return key
        return None


CAPACITY_UNITS = ("fetch", "native")  # ARC's and LeCaR's ``capacity_unit`` readings


EVICTION: Registry[EvictionPolicy] = Registry("eviction", "specmd.policies.eviction")
