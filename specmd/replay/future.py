"""The future of a replayed trace: what oracle policies (``eviction=belady``, ``prefetch=oracle``) read.

Layer calls are numbered in execution order (``GateRecord.call``). ``requests(call)`` is the set of experts
the router itself requested at a call; ``next_use(key, call)`` the first call after ``call`` that requests
``key = layer * E + expert`` (``NEVER`` if none). The future is the router's own routing as recorded: under
a cache-aware routing policy the replayed selection can differ from it (such replays are ``exact: false``).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

NEVER = np.iinfo(np.int64).max  # libCacheSim's "no next access" (INT64_MAX)


class Future:
    def __init__(self, call_layer: np.ndarray, call_ptr: np.ndarray, experts: np.ndarray, num_experts: int):
        """``experts[call_ptr[c]:call_ptr[c+1]]``: the ascending experts call ``c`` requests at MoE layer
        ``call_layer[c]``."""
        self.call_layer = call_layer
        self.call_ptr = call_ptr
        self.experts = experts
        self.num_experts = num_experts
        E = num_experts
        calls = np.repeat(np.arange(len(call_layer), dtype=np.int64), np.diff(call_ptr))
        keys = np.repeat(call_layer.astype(np.int64), np.diff(call_ptr)) * E + experts
        if not len(keys):
            self._uses = {}
            return
        order = np.lexsort((calls, keys))
        keys, calls = keys[order], calls[order]
        bounds = np.flatnonzero(np.diff(keys)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(keys)]])
        self._uses = {int(keys[s]): calls[s:e].tolist() for s, e in zip(starts, ends)}

    def __len__(self) -> int:
        return len(self.call_ptr) - 1

    def layer_of(self, call: int) -> int:
        return int(self.call_layer[call]) if 0 <= call < len(self.call_layer) else -1

    def requests(self, call: int) -> list[int]:
        if call < 0 or call + 1 >= len(self.call_ptr):
            return []
        return self.experts[self.call_ptr[call]:self.call_ptr[call + 1]].tolist()

    def next_use(self, key: int, call: int) -> int:
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        i = bisect_right(uses, call)
        return uses[i] if i < len(uses) else NEVER
