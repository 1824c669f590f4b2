"""The expert arena of ``execution=offload``: one pool's device memory of exactly its capacity in bytes (and,
beside it, the :class:`Staging` banks a layer call's streamed or unpacked experts go to).

Two layouts, chosen once per run:

* **uniform** (every copy is native: the common case), :class:`SlotArena`: the pool *is* an experts module's
  tensors -- one ``[slots, ...]`` tensor per parameter in the family's fused layout (``gate_up_proj``
  ``[slots, 2I, H]``, ``down_proj`` ``[slots, H, I]``, GPT-OSS's biases ``[slots, out]``), so a layer call's
  experts run from it as one grouped GEMM per projection with expert ids mapped to slot ids (vLLM's
  ``expert_map``; :func:`~.kernel.grouped_experts`). A free list of slot numbers makes ``alloc``/``release``
  O(1) with no allocation (Fiddler's and MoE-PolicyLang's pre-allocated slots);
* **mixed** (stored low-precision copies may be fetched: ``miss=fetch_lowest_bit``, ``fetch_priority``, ...),
  :class:`ByteArena`: one byte buffer, copies of several sizes share the pool, so ranges are allocated
  first-fit from a sorted list of free extents (native copies from the front, smaller ones from the back),
  merged on release. The engine admits a copy when the pool's *bytes* allow it, not its largest hole; when
  no hole fits, the cheapest run of holes that together hold it is **compacted** (the live copies between
  them slid down, in offset order, leaving one hole) -- so the arena always holds what the engine admitted,
  in exactly the configured capacity. Compaction needs fragmentation and a full pool; its time is measured,
  never simulated.
"""

from __future__ import annotations

import bisect
import ctypes
import math
from typing import Optional

import torch


class SlotArena:
    """One pool as fused ``[slots, ...]`` tensors per parameter (``shapes[name]``: one expert's shape; all one
    ``dtype``), ``slots = capacity // slot_bytes``: the capacity's remainder (less than one expert) is left
    unallocated, as the engine can never fill it with native copies."""

    mixed = False

    def __init__(self, capacity: int, shapes: dict, dtype: torch.dtype, device):
        self.capacity = capacity
        self.slot_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        n = capacity // self.slot_bytes
        # zeroed: the pages are touched now, not by the first fetch into each slot (on a CPU device first-touch
        # page faults made the first pass's copies 3-10x slower than later ones)
        self.tensors = {name: torch.zeros((n, *shape), dtype=dtype, device=device) for name, shape in shapes.items()}
        self.n = n
        self.used = 0
        self.live: dict[int, int] = {}  # key -> slot
        self._free = list(range(n - 1, -1, -1))  # slot numbers, lowest on top
        self._views = [{name: t[s] for name, t in self.tensors.items()} for s in range(n)]  # built once
        self.compactions = self.bytes_compacted = 0

    def alloc(self, key: int, size: int) -> Optional[int]:
        """A free slot for ``key`` (``size`` must be one native expert), or None when the pool is full (the
        engine and the arena disagree)."""
        if size != self.slot_bytes or not self._free:
            return None
        s = self._free.pop()
        self.live[key] = s
        self.used += size
        return s

    def release(self, key: int) -> None:
        self._free.append(self.live.pop(key))
        self.used -= self.slot_bytes

    def views(self, slot: int) -> dict:
        """Slot ``slot``'s per-parameter views (one expert's tensors)."""
        return self._views[slot]

    def holes(self) -> list[int]:
        """Free slot numbers, for checks."""
        return sorted(self._free)


class ByteArena:
    """One pool as a byte buffer shared by copies of several sizes (the mixed layout: module docstring)."""

    mixed = True

    def __init__(self, capacity: int, slot_bytes: int, device, align: int = 1):
        """``slot_bytes``: one native copy (copies at least that large go first-fit from the front); ``align``:
        every copy's size is a multiple of it, so the usable end is rounded down to it -- copies whose bytes
        sum to at most the capacity sum to at most that -- and every offset, from either end, stays aligned."""
        self.buf = torch.zeros(capacity, dtype=torch.uint8, device=device)  # zeroed: pages touched now (SlotArena)
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.used = 0  # bytes held
        self.live: dict[int, tuple[int, int]] = {}  # key -> (offset, size)
        self.compactions = 0
        self.bytes_compacted = 0
        self.end = capacity - capacity % align
        self._free = [(0, self.end)] if self.end else []  # sorted (offset, size) holes

    def alloc(self, key: int, size: int) -> Optional[int]:
        """The offset of ``size`` free bytes for ``key``, or None when no hole is large enough (then
        :meth:`compact`)."""
        free = self._free
        if size >= self.slot_bytes:  # native copies first-fit from the front
            for i, (o, n) in enumerate(free):
                if n >= size:
                    off = o
                    if n == size:
                        del free[i]
                    else:
                        free[i] = (o + size, n - size)
                    break
            else:
                return None
        else:  # smaller copies from the back, in the highest hole they fit: sizes stay apart
            for i in range(len(free) - 1, -1, -1):
                o, n = free[i]
                if n >= size:
                    off = o + n - size
                    if n == size:
                        del free[i]
                    else:
                        free[i] = (o, n - size)
                    break
            else:
                return None
        self.live[key] = (off, size)
        self.used += size
        return off

    def release(self, key: int) -> None:
        off, size = self.live.pop(key)
        self.used -= size
        free = self._free
        i = bisect.bisect_left(free, (off, size))
        if i < len(free) and off + size == free[i][0]:  # merge with the hole after
            size += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # and the one before
            off, size = free[i - 1][0], free[i - 1][1] + size
            del free[i - 1]
            i -= 1
        free.insert(i, (off, size))

    def window(self, need: Optional[int] = None) -> tuple[int, int]:
        """The byte range :meth:`compact` slides to open one hole of ``need`` bytes, moving as few bytes as
        possible: of every run of consecutive holes that together hold ``need`` bytes, the one with the
        fewest live bytes between its first and last hole (a two-pointer scan over the holes); ``need=None``:
        the whole buffer. (Sliding everything from the first hole moved 17x the bytes the transfers did on
        tiny with ``miss=fetch_priority``; stopping at the first large enough gap 9.5x; the cheapest run 8.8x.)"""
        holes = self._free
        if need is None:
            return 0, self.end
        best, i, hsum, lsum = None, 0, 0, 0
        for j, (o, n) in enumerate(holes):
            hsum += n
            if j > i:
                lsum += o - (holes[j - 1][0] + holes[j - 1][1])
            while i < j and hsum - holes[i][1] >= need:  # drop the first hole while the rest suffice
                hsum -= holes[i][1]
                lsum -= holes[i + 1][0] - (holes[i][0] + holes[i][1])
                i += 1
            if hsum >= need and (best is None or lsum < best[0]):
                best = (lsum, i, j)
        if best is None:
            raise RuntimeError(f"arena: {need} bytes requested, {self.capacity - self.used} free in all")
        _, i, j = best
        return holes[i][0], holes[j][0] + holes[j][1]

    def inside(self, start: int, end: int) -> list[int]:
        """Keys of the live copies in ``[start, end)``."""
        return [k for k, (o, _) in self.live.items() if start <= o < end]

    def compact(self, need: Optional[int] = None, span: Optional[tuple[int, int]] = None) -> dict[int, int]:
        """Slide the live copies of :meth:`window` (or ``span``) down onto its first byte, in offset order (a
        move never overwrites a copy not yet moved); its free bytes become one hole at its end. Returns
        ``{key: new offset}`` of the copies moved. The caller makes sure no transfer is writing into the
        span (copies outside it are untouched)."""
        start, end = span or self.window(need)
        moved, at = {}, start
        cpu = self.buf.device.type == "cpu"
        base = self.buf.data_ptr()
        for key, (off, size) in sorted(((k, self.live[k]) for k in self.inside(start, end)), key=lambda kv: kv[1][0]):
            if off != at:
                if cpu:  # memmove handles the overlap of a short slide
                    ctypes.memmove(base + at, base + off, size)
                else:
                    src = self.buf[off:off + size]
                    self.buf[at:at + size].copy_(src.clone() if off < at + size else src)  # overlapping: via a copy
                self.live[key] = (at, size)
                moved[key] = at
                self.bytes_compacted += size
            at += size
        keep = [h for h in self._free if h[0] + h[1] <= start or h[0] >= end]
        if at < end:
            bisect.insort(keep, (at, end - at))
        self._free = keep
        self.compactions += 1
        return moved

    def holes(self) -> list[tuple[int, int]]:
        """Free (offset, size) ranges, for checks."""
        return list(self._free)


class Staging:
    """A growing bank of fused ``[rows, ...]`` tensors (one expert per row) on the device: a layer call's
    streamed experts, or the experts it puts into place to run. Grows geometrically, never shrinks; the
    largest it grew to is reported (``memory.staging_peak_bytes``)."""

    def __init__(self, shapes: dict, dtype: torch.dtype, device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.tensors: dict = {}
        self.cap = 0
        self._views: list = []
        self.row_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize

    def ensure(self, rows: int, keep: int = 0) -> None:
        """Room for ``rows`` rows; the first ``keep`` rows' contents survive a growth."""
        if rows <= self.cap:
            return
        cap = max(rows, 2 * self.cap, 1)
        new = {n: torch.zeros((cap, *s), dtype=self.dtype, device=self.device) for n, s in self.shapes.items()}
        if keep:
            for n, t in self.tensors.items():
                new[n][:keep].copy_(t[:keep])
        self.tensors, self.cap = new, cap
        self._views = [{n: t[r] for n, t in new.items()} for r in range(cap)]

    def views(self, row: int) -> dict:
        return self._views[row]

    @property
    def bytes(self) -> int:
        return self.cap * self.row_bytes


class RawViews:
    """Views of one copy's tensors at a byte offset of a 1-D byte buffer (a mixed arena, a stream row), as
    ``native`` (``[(name, dtype, shape, bytes)]``, the family's layout) or as ``raw_layout[layer, precision]``
    (a stored copy's raw tensors). Remembered per (buffer, offset, layout): making them is up to 18 tensor
    calls, and copies keep landing at the same offsets (sizes repeat). At most :attr:`KEPT` remembered (then
    forgotten at once)."""

    KEPT = 8192

    def __init__(self, native: list, raw_layout: dict):
        self.native = native
        self.raw_layout = raw_layout
        self._kept: dict = {}

    def at(self, buf: torch.Tensor, offset: int, layer: int, precision: str) -> dict:
        layout = self.native if precision == "native" else self.raw_layout[layer, precision]
        ck = (buf.data_ptr(), offset, id(layout))
        out = self._kept.get(ck)
        if out is None:
            if len(self._kept) >= self.KEPT:
                self._kept.clear()
            out, o = {}, offset
            for n, dtype, shape, nbytes in layout:
                out[n] = buf[o:o + nbytes].view(dtype).view(shape)
                o += nbytes
            self._kept[ck] = out
        return out

    def clear(self) -> None:
        """Forget every view (the buffer they view was replaced: a stream bank grew)."""
        self._kept.clear()
