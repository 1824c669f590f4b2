from .base import EVICTION, EvictionPolicy, argmin_key


@EVICTION.register("least_stale")
class LeastStale(EvictionPolicy):
    """Least-Stale (SpecMD §4.2). An expert is *current* if it was used or prefetched in the ongoing
    forward pass, otherwise *stale*. Stale experts are evicted before current ones (current ones only to
    avoid running out of memory); within each queue the order is FIFO by layer position: the lowest layer
    first (for stale experts these are "left" of the execution point once the pass has passed them; for
    current ones, layers already executed), and within one layer the expert that joined the queue first.
    Equivalent to the paper's two priority heaps keyed by (layer, arrival)."""

    def __init__(self, params=None):
        super().__init__(params)
        self.mark: dict[int, tuple[int, int]] = {}  # key -> (pass it was last current in, arrival seq)
        self.pass_index = 0
        self.seq = 0

    def on_pass_start(self, pass_index):
        self.pass_index = pass_index

    def _current(self, key):
        m = self.mark.get(key)
        if m is None or m[0] != self.pass_index:
            self.seq += 1
            self.mark[key] = (self.pass_index, self.seq)

    def on_insert(self, key, prefetch):
        self._current(key)

    def on_access(self, key):
        self._current(key)

    def on_remove(self, key):
        del self.mark[key]

    def victim(self, evictable):
        mark, cur, e = self.mark, self.pass_index, self.keys.num_experts
        return argmin_key(mark, evictable, lambda k: (mark[k][0] == cur, k // e, mark[k][1]))
