# cython: wraparound=False
# (every index in this module is non-negative: a key, a layer, an expert, each checked where it enters)
"""The MoE layer call being served (:class:`LayerCall`): the one object a miss outcome touches
(:mod:`specmd.engine.outcomes`). It holds the call's layer, pool and record, the clock's handles the
device's experts wait for, the host's work, and the call's execution plan (:class:`~specmd.engine.outcomes.
Execution`, made on first use: the lossless path never needs one). Its verbs do both halves of an outcome's
job at once -- the accounting (counters, transfers, host time) and the plan -- so an outcome cannot do one
and forget the other. The cache manager (:mod:`specmd.engine.cache`) opens one per call and reuses it.
"""

from __future__ import annotations

from .outcomes import NATIVE, Execution
from .residency import Pool


class LayerCall:
    """The state of the layer call being served: what an outcome may touch (one object, reused).
    (Fields: ``call.pxd``.)"""

    def __init__(self, manager):
        self._m = manager
        self.fetch_precision = manager.fetch_precision
        self.waits: list = []  # the clock's handles the device's experts wait for (demand fetches, late prefetches;
        # host work where the host shares the device's cores: CacheManager._stall)
        self.host_handle = None  # the host's work this call (the layer's output waits for it: finish_layer)
        self.demanded = 0  # demand fetches issued (the clock may return no handle for them)

    def reset(self, layer: int, base: int, pool: Pool, record, index, weights, n: int):
        """A new layer call; ``base``: its layer's first key (``layer * num_experts``, computed by the caller)."""
        self.layer = layer
        self.base = base
        self.pool = pool
        self.record = record
        if self.waits:  # (list.clear is a method call from C: skipped when there is nothing to clear)
            self.waits.clear()
        self.execution = None
        self.host_slots = 0
        self.host_experts = 0
        self.host_handle = None
        self.demanded = 0
        self.index = index
        self.weights = weights
        self.n = n

    # -- what outcomes use ------------------------------------------------------------------------
    def plan(self) -> Execution:
        """The layer's execution plan, created on first use (the lossless path never needs one)."""
        ex = self.execution
        if ex is None:
            import torch

            index, weights = self.index, self.weights
            if index is None:  # the record's own selection
                index, weights = self.record.index, self.record.weights
            # slots a routing policy declared empty (prune: Routed.void)
            void = self.record.void if self.record is not None and self.record.rerouted else None
            slots = index.numel() - (0 if void is None else int(void.sum()))
            ex = self.execution = Execution(index, weights, torch.ones_like(index, dtype=torch.bool), slots, self.n,
                                            void, self._m.geom.num_experts)
        return ex

    def pin(self, expert: int) -> None:
        """``expert`` stays resident until this call finishes (a substitute, pinned in ``prepare``)."""
        self._m.pin(self.base + expert)

    # -- the verbs of a miss outcome: each does the accounting and the plan together ---------------------
    def fetch(self, expert: int, precision: str) -> None:
        """A blocking transfer of ``expert`` at ``precision``: inserted if room can be made, else streamed; a
        non-native copy runs at its precision (the plan records it)."""
        self.fetch_many((expert,), precision)
        if precision != NATIVE:
            self.plan().run_at(expert, precision)

    def drop(self, expert: int, stat: str, renormalise: bool = False) -> None:
        """``expert`` does not run in this call (:meth:`Execution.drop`), counted as ``stat``."""
        self._m.stats.add(stat, self.layer)
        self.plan().drop(expert, renormalise)

    def substitute(self, expert: int, substitute, stat: str) -> None:
        """Each token that selected ``expert`` runs ``substitute[t]`` ([T] long) instead
        (:meth:`Execution.substitute`), counted as ``stat``."""
        self._m.stats.add(stat, self.layer)
        self.plan().substitute(expert, substitute)

    def compute_on_host(self, expert: int, stat: str) -> None:
        """``expert`` is computed on the host (:meth:`Execution.to_host`), counted as ``stat``; its slots are
        the host's work of this call (timed once per call, by the cache manager's stall step)."""
        self._m.stats.add(stat, self.layer)
        self.host_slots += self.plan().to_host(expert)
        self.host_experts += 1

    def fetch_many(self, experts, precision):
        """:meth:`fetch` for each of ``experts`` in order (the residency's demand fetches:
        :meth:`~specmd.engine.residency.Residency.demand`)."""
        self.demanded += self._m.demand(self.pool, self.layer, self.base, experts, precision, self.waits)
