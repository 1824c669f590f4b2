from .base import EVICTION, EvictionPolicy, LazyHeap


@EVICTION.register("least_stale")
class LeastStale(EvictionPolicy):
    """Least-Stale (SpecMD §4.2). An expert is *current* if it was used or prefetched in the ongoing
    forward pass, otherwise *stale*. Stale experts are evicted before current ones (current ones only to
    avoid running out of memory); within each queue the order is FIFO by layer position: the lowest layer
    first (for stale experts these are "left" of the execution point once the pass has passed them; for
    current ones, layers already executed), and within one layer the expert that joined the queue first.
    Equivalent to the paper's two priority heaps keyed by (layer, arrival).

    Implemented as those two heaps of ``(layer, arrival seq, key)`` with lazy invalidation
    (:class:`~.base.LazyHeap`): an entry is live while it is its key's newest one, ``_entry[key]`` (a key
    that becomes current again gets a new seq and entry; a removed key has none). A new pass moves the
    current heap's live entries into the stale heap."""

    def __init__(self, params=None):
        super().__init__(params)
        self.mark: dict[int, tuple[int, int]] = {}  # key -> (pass it was last current in, arrival seq)
        self.pass_index = 0
        self.seq = 0
        self._max_pass = 0  # highest pass index seen: no key is marked with a pass above it
        self._entry: dict[int, tuple[int, int, int]] = {}  # key -> its live heap entry (layer, seq, key)
        self._stale = LazyHeap()  # entries of stale keys (and dead ones)
        self._cur = LazyHeap()  # entries of keys current in this pass (and dead ones)

    def _rebuild(self) -> None:
        """Both heaps from ``mark`` (drops dead entries; also the path for a pass index seen before)."""
        e, cur = self.keys.num_experts, self.pass_index
        entry = self._entry = {k: (k // e, s, k) for k, (p, s) in self.mark.items()}
        self._stale = LazyHeap([entry[k] for k, (p, s) in self.mark.items() if p != cur])
        self._cur = LazyHeap([entry[k] for k, (p, s) in self.mark.items() if p == cur])

    def on_pass_start(self, pass_index):
        if pass_index == self.pass_index:
            return
        self.pass_index = pass_index
        if pass_index > self._max_pass:  # a fresh pass: every current key becomes stale, nothing is current
            self._max_pass = pass_index
            stale, entry = self._stale, self._entry
            for ent in self._cur.entries():
                if entry.get(ent[2]) is ent:
                    stale.push(ent)
            self._cur = LazyHeap()
        else:
            self._rebuild()

    def _current(self, key):
        m = self.mark.get(key)
        p = self.pass_index
        if m is None or m[0] != p:
            s = self.seq = self.seq + 1
            self.mark[key] = (p, s)
            ent = self._entry[key] = (key // self.keys.num_experts, s, key)
            cur = self._cur
            cur.push(ent)
            if len(cur) + len(self._stale) > 2 * len(self.mark) + 64:
                self._rebuild()

    def on_insert(self, key, prefetch):
        self._current(key)

    def on_access(self, key):
        self._current(key)

    def on_remove(self, key):
        del self.mark[key]
        del self._entry[key]

    def victim(self, evictable):
        live = self._entry
        ent = self._stale.first(evictable, live) or self._cur.first(evictable, live)
        return None if ent is None else ent[2]
