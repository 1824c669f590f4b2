from heapq import heapify, heappush

from .base import EVICTION, EvictionPolicy, heap_first


@EVICTION.register("least_stale")
class LeastStale(EvictionPolicy):
    """Least-Stale (SpecMD §4.2). An expert is *current* if it was used or prefetched in the ongoing
    forward pass, otherwise *stale*. Stale experts are evicted before current ones (current ones only to
    avoid running out of memory); within each queue the order is FIFO by layer position: the lowest layer
    first (for stale experts these are "left" of the execution point once the pass has passed them; for
    current ones, layers already executed), and within one layer the expert that joined the queue first.
    Equivalent to the paper's two priority heaps keyed by (layer, arrival).

    Implemented as those two heaps of ``(layer, arrival seq, key)`` with lazy invalidation: an entry is
    live while ``mark[key]`` still carries its seq (a key that becomes current again gets a new seq; a
    removed key has no mark). A new pass moves the current heap's live entries into the stale heap."""

    def __init__(self, params=None):
        super().__init__(params)
        self.mark: dict[int, tuple[int, int]] = {}  # key -> (pass it was last current in, arrival seq)
        self.pass_index = 0
        self.seq = 0
        self._max_pass = 0  # highest pass index seen: no key is marked with a pass above it
        self._stale: list[tuple[int, int, int]] = []  # heaps of (layer, seq, key)
        self._cur: list[tuple[int, int, int]] = []

    def _live(self, ent) -> bool:
        m = self.mark.get(ent[2])
        return m is not None and m[1] == ent[1]

    def _rebuild(self) -> None:
        """Both heaps from ``mark`` (drops dead entries; also the path for a pass index seen before)."""
        e, cur = self.keys.num_experts, self.pass_index
        self._stale = [(k // e, s, k) for k, (p, s) in self.mark.items() if p != cur]
        self._cur = [(k // e, s, k) for k, (p, s) in self.mark.items() if p == cur]
        heapify(self._stale)
        heapify(self._cur)

    def on_pass_start(self, pass_index):
        if pass_index == self.pass_index:
            return
        self.pass_index = pass_index
        if pass_index > self._max_pass:  # a fresh pass: every current key becomes stale, nothing is current
            self._max_pass = pass_index
            stale, live = self._stale, self._live
            for ent in self._cur:
                if live(ent):
                    heappush(stale, ent)
            self._cur = []
        else:
            self._rebuild()

    def _current(self, key):
        m = self.mark.get(key)
        if m is None or m[0] != self.pass_index:
            self.seq += 1
            self.mark[key] = (self.pass_index, self.seq)
            cur = self._cur
            heappush(cur, (key // self.keys.num_experts, self.seq, key))
            if len(cur) + len(self._stale) > 2 * len(self.mark) + 64:
                self._rebuild()

    def on_insert(self, key, prefetch):
        self._current(key)

    def on_access(self, key):
        self._current(key)

    def on_remove(self, key):
        del self.mark[key]

    def victim(self, evictable):
        live = self._live
        ent = heap_first(self._stale, evictable, live) or heap_first(self._cur, evictable, live)
        return None if ent is None else ent[2]
