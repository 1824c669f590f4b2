# cython: wraparound=False
# (every index in this module is non-negative)
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
    """(Compiled, an extension type, ``future.pxd``: Belady asks :meth:`next_use` in C.)"""

    def __init__(self, call_layer: np.ndarray, call_ptr: np.ndarray, experts: np.ndarray, num_experts: int):
        """``experts[call_ptr[c]:call_ptr[c+1]]``: the ascending experts call ``c`` requests at MoE layer
        ``call_layer[c]``."""
        self.call_layer = call_layer
        self.call_ptr = call_ptr
        self.experts = experts
        self.num_experts = num_experts
        E = num_experts
        # Every key's uses as one sorted run of calls (CSR: key k's calls are _calls[_ptr[k]:_ptr[k + 1]]),
        # and a cursor per key at its first use after the last call asked: a replay asks with calls that never
        # decrease, so a next use is O(1) amortised; an earlier call is found by bisection instead.
        calls = np.repeat(np.arange(len(call_layer), dtype=np.int64), np.diff(call_ptr))
        keys = np.repeat(np.asarray(call_layer, dtype=np.int64), np.diff(call_ptr)) * E + experts
        nkeys = int(keys.max()) + 1 if len(keys) else 0
        order = np.lexsort((calls, keys))
        ptr = np.zeros(nkeys + 1, dtype=np.int64)
        np.cumsum(np.bincount(keys, minlength=nkeys), out=ptr[1:])
        self._calls = np.ascontiguousarray(calls[order], dtype=np.int64)
        self._ptr = ptr
        self._cursor = ptr[:nkeys].copy()

    def __len__(self) -> int:
        return len(self.call_ptr) - 1

    def layer_of(self, call: int) -> int:
        return int(self.call_layer[call]) if 0 <= call < len(self.call_layer) else -1

    def requests(self, call: int) -> list[int]:
        if call < 0 or call + 1 >= len(self.call_ptr):
            return []
        return self.experts[self.call_ptr[call]:self.call_ptr[call + 1]].tolist()

    def next_use(self, key: int, call: int) -> int:
        """The first call after ``call`` that requests ``key``, or ``NEVER``."""
        if key < 0 or key >= len(self._cursor):  # (the key is checked; cursors stay within their key's run)
            return NEVER
        end = self._ptr[key + 1]
        i = self._cursor[key]
        if i > self._ptr[key] and self._calls[i - 1] > call:  # asked about an earlier call: bisect its run
            i = bisect_right(self._calls, call, self._ptr[key], end)
        while i < end and self._calls[i] <= call:
            i += 1
        self._cursor[key] = i
        return self._calls[i] if i < end else NEVER
