"""Host tiers of ``execution=offload``: where expert weights live when they are not in the arena.

* :class:`RamTier` (``execution.host=ram``): the experts' fused tensors in host memory (pinned when the
  device is CUDA, so copies are DMA).
* :class:`DiskTier` (``execution.host=disk``, FlashMoE's SSD tier): the checkpoint's safetensors files, read
  per expert with ``pread`` at the byte offsets of the file's header -- no copy of the experts is ever held
  in memory. With ``page_cache=drop`` (default) each read's pages are dropped from the kernel's page cache
  afterwards (``posix_fadvise(DONTNEED)``), so every fetch really reads the device and the host's memory is
  what the process holds; with ``keep`` the kernel may serve repeated reads from memory it does not count
  in the process RSS (results.json says which).

Both fill a destination ``{name: tensor}`` (an arena slot's views) with one expert at the run dtype.
Checkpoints with fused expert tensors (transformers' names) and per-expert ones (the hub's, as the family's
adapter declares them: :class:`~specmd.models.adapters.HubLayout`) are both read.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
from pathlib import Path
from typing import Optional

import torch

from ..accel import accel_for, host_buffer
from ..errors import DataError

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "U8": torch.uint8, "I8": torch.int8}


class HostTier:
    name = "abstract"
    bytes_held = 0  # host memory the tier holds (experts), bytes
    bytes_read = 0  # bytes read from disk

    def copy_into(self, layer: int, expert: int, dst: dict) -> None:
        raise NotImplementedError

    def copy_many(self, items: list, name=None) -> None:
        """:meth:`copy_into` for each ``(layer, expert, dst)`` of ``items`` in order: one channel job (a layer
        call's demand fetches). A failure raises :class:`~.transfer.TransferError` naming the expert
        (``name(layer, expert)``), so a batch fails as precisely as a single copy."""
        copy = self.copy_into
        for layer, expert, dst in items:
            try:
                copy(layer, expert, dst)
            except Exception as exc:  # noqa: BLE001 -- re-raised naming the expert
                _failed(name, layer, expert, exc)

    def host_views(self, layer: int, expert: int) -> dict:
        """Expert ``expert`` of ``layer`` in host memory (``miss=cpu_compute`` runs it there)."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"host": self.name, "host_tier_bytes": self.bytes_held, "disk_bytes_read": self.bytes_read}

    def close(self) -> None:
        pass


def _failed(name, layer: int, expert: int, exc: Exception):
    from .transfer import TransferError

    what = name(layer, expert) if name else f"layer {layer} expert {expert}"
    raise TransferError(f"transfer of {what} failed: {exc}") from exc


BYTES = "__bytes__"


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, accel=None) -> None:
    """Copy ``src``'s bytes into ``dst`` (asynchronously on the thread's current stream of ``accel``, a
    :class:`specmd.accel.Accel`; without one a plain copy) whatever word type :func:`words` gave each: a
    destination's type depends on its offset in the arena (a mixed arena aligns copies to 2 or 4 bytes), a packed
    row's does not, and an int64 row copied into an int32 view is a shape error -- or, for a single word, a
    broadcast."""
    d, s = dst.view(torch.uint8), src.view(torch.uint8)  # a slot's (or staging area's) raw bytes
    if accel is None:
        d.copy_(s, non_blocking=True)
    else:
        accel.copy_(d, s)


def words(raw: torch.Tensor) -> torch.Tensor:
    """Raw bytes seen as the widest integer that divides them: torch copies a uint8 tensor of more than 32 Ki
    elements with its intra-op thread pool, which from the transfer thread fights the model's compute for
    the cores (measured: 49 kB experts copied at 1.8 GB/s as bytes, 5+ GB/s as int64)."""
    n = raw.shape[-1]
    for dt in (torch.int64, torch.int32, torch.int16):
        if n % dt.itemsize == 0 and raw.storage_offset() % dt.itemsize == 0:
            return raw.view(dt)
    return raw


class RamTier(HostTier):
    """Each layer's experts as the family's fused tensors, one contiguous ``[E, ...]`` tensor per parameter in
    host memory -- the arena's layout (:class:`~.arena.SlotArena`), so one expert's parameter is one
    contiguous copy into its slot. On a CPU device the module's own parameters are the tier (no second
    copy); for a GPU they are copied once into pinned memory and the module's parameters re-pointed there
    (still no second copy), so every fetch is a DMA.

    Into host memory (a CPU device) a copy is one ``memmove`` per parameter between addresses known in advance
    (``ctypes`` releases the GIL for it, so it overlaps compute like a DMA): a tensor ``copy_`` costs 2 us of
    dispatch per call, a third of a 49 kB expert's copy (measured: 12 GB/s vs 25 GB/s at 48 KiB, 4 vs 12 GB/s
    at 17 MiB); onto a GPU it is ``copy_(non_blocking=True)`` from pinned memory on the transfer stream."""

    name = "ram"

    def __init__(self, layers: list[dict], accel=None):
        """``layers[l][name]``: the fused [E, ...] tensor of parameter ``name`` of MoE layer ``l`` (host memory;
        a module's parameters are re-pointed at the pinned copy when ``accel``, the device's
        :class:`specmd.accel.Accel`, copies from host memory; ``None``: a CPU device, memmove copies)."""
        self.accel = accel
        self.tensors: list[dict] = []
        for d in layers:
            out = {}
            for n, t in d.items():
                src = t.detach()
                if accel is not None or not src.is_contiguous():
                    held = host_buffer(accel, *src.shape, dtype=src.dtype)
                    held.copy_(src)
                    if isinstance(t, torch.nn.Parameter):
                        t.data = held  # the parameter now lives in the tier: no second copy of the experts
                    src = held
                out[n] = src
            self.tensors.append(out)
        self.bytes_held = sum(t.numel() * t.element_size() for d in self.tensors for t in d.values())
        self.row_bytes = [sum(t[0].numel() * t.element_size() for t in d.values()) for d in self.tensors]
        # host addresses of expert 0 of each parameter, and one expert's bytes: [layer] -> [(name, addr, bytes)]
        self._rows = [[(n, t.data_ptr(), t[0].numel() * t.element_size()) for n, t in d.items()] for d in self.tensors]

    def copy_into(self, layer, expert, dst):
        rows = self._rows[layer]
        accel = self.accel
        if accel is None:  # host memory to host memory: one memmove per parameter
            memmove = ctypes.memmove
            for n, addr, nbytes in rows:
                memmove(dst[n].data_ptr(), addr + expert * nbytes, nbytes)
            return
        src = self.tensors[layer]
        for n, d in dst.items():
            copy_bytes(d, src[n][expert], accel)

    def host_views(self, layer, expert):
        return {n: t[expert] for n, t in self.tensors[layer].items()}

    def host_bank(self, layer: int) -> dict:
        """Layer ``layer``'s experts as fused ``[E, ...]`` tensors in host memory (experts computed where they
        are: ``miss=cpu_compute`` on a CPU device)."""
        return self.tensors[layer]


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and the offset its data starts at."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DataError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise DataError(f"{path}: unreadable safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _dtype(code: str, path, name: str) -> torch.dtype:
    if code not in ST_DTYPES:
        raise DataError(f"{path}: {name} is stored as {code}, which execution.host=disk cannot read; readable: "
                        f"{', '.join(ST_DTYPES)}")
    return ST_DTYPES[code]


class _Piece:
    """``nbytes`` at ``offset`` of file ``fd`` (dtype ``dtype``) -> rows ``rows`` of destination ``name``."""

    __slots__ = ("fd", "path", "offset", "nbytes", "dtype", "name", "rows", "shape", "param")

    def __init__(self, fd, path, offset, nbytes, dtype, name, rows, shape, param):
        self.fd, self.path, self.offset, self.nbytes = fd, path, offset, nbytes
        self.dtype, self.name, self.rows, self.shape = dtype, name, rows, shape
        self.param = param  # the fused parameter it fills (``name`` is the checkpoint tensor, for errors)


class DiskTier(HostTier):
    name = "disk"

    def __init__(self, checkpoint: str, layer_ids: list[int], shapes: dict, dtype: torch.dtype, num_experts: int,
                 hub, page_cache: str = "drop", device: Optional[torch.device] = None):
        """``shapes[name]``: one expert's shape of each per-expert parameter (as the model runs it); ``hub``:
        the family's :class:`~specmd.models.adapters.HubLayout` (its adapter's ``hub``; None: only fused
        tensors under transformers' names are read)."""
        self.dir = Path(checkpoint)
        # where a layer's experts may be (transformers' block first) and, per fused parameter, the hub's
        # per-expert tensors concatenated along rows
        self._blocks = ("mlp",) if hub is None or hub.block == "mlp" else ("mlp", hub.block)
        self._layers = ("model.layers",) if hub is None else hub.layer_prefixes()  # (and a wrapper's, read)
        self._parts = {n: hub.expert_parts(n) for n in shapes} if hub is not None else {}
        self.dtype = dtype
        self.page_cache = page_cache
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise DataError(f"execution.host=disk: no *.safetensors files in {self.dir}")
        tensors = {}
        self._fds = []
        try:
            self._index(files, tensors, layer_ids, shapes, num_experts)
        except BaseException:
            self.close()  # a truncated file or a missing expert: no descriptor left open
            raise
        self._accel = accel_for(device) if device is not None else None  # reads bounce through its pinned memory
        self._bounces: dict = {}  # one bounce buffer per reading thread (transfer thread; main: cpu_compute, checks)
        self._lock = threading.Lock()
        self.bytes_held = 0

    def _index(self, files, tensors, layer_ids, shapes, num_experts) -> None:
        """Every expert's pieces: file, byte offset, length, dtype, destination rows."""
        for path in files:
            header, start = read_header(path)
            fd = os.open(path, os.O_RDONLY)
            self._fds.append(fd)
            size = os.fstat(fd).st_size
            for name, info in header.items():
                b, e = info["data_offsets"]
                if start + e > size:
                    raise DataError(f"{path}: truncated: tensor {name} ends at byte {start + e}, the file has {size}")
                tensors[name] = (fd, path, start + b, e - b, info["dtype"], info["shape"])
        self.pieces: list[list[list[_Piece]]] = []  # [layer][expert] -> pieces
        biggest = 0
        for layer_id in layer_ids:
            per_expert = []
            for e in range(num_experts):
                pieces = []
                for name, shape in shapes.items():
                    got = self._locate(tensors, layer_id, e, name, shape, num_experts)
                    pieces.extend(got)
                    biggest = max([biggest] + [p.nbytes for p in got])
                per_expert.append(pieces)
            self.pieces.append(per_expert)
        self._biggest = biggest

    def _locate(self, tensors, layer_id, e, name, shape, E) -> list[_Piece]:
        for base, block in ((b, k) for b in self._layers for k in self._blocks):
            prefix = f"{base}.{layer_id}.{block}.experts"
            fused = tensors.get(f"{prefix}.{name}")
            if fused is not None:  # [E, ...]: expert e's bytes are the e-th of E equal chunks
                fd, path, off, nbytes, dt, fshape = fused
                if fshape[0] != E or tuple(fshape[1:]) != tuple(shape):
                    raise DataError(f"{path}: {prefix}.{name} has shape {fshape}, expected [{E}, {', '.join(map(str, shape))}]")
                per = nbytes // E
                return [_Piece(fd, path, off + e * per, per, _dtype(dt, path, name), f"{prefix}.{name}[{e}]", None,
                               tuple(shape), name)]
            parts = self._parts.get(name, ())
            found = [tensors.get(f"{prefix}.{e}.{p}") for p in parts]
            if parts and not all(f is None for f in found):
                missing = [f"{prefix}.{e}.{p}" for p, f in zip(parts, found) if f is None]
                if missing:
                    raise DataError(f"execution.host=disk: {self.dir} lacks {', '.join(missing)} (layer {layer_id}, "
                                    f"expert {e})")
                out, row = [], 0
                for p, (fd, path, off, nbytes, dt, fshape) in zip(parts, found):
                    rows = fshape[0]
                    out.append(_Piece(fd, path, off, nbytes, _dtype(dt, path, p), f"{prefix}.{e}.{p}", (row, row + rows),
                                      tuple(fshape), name))
                    row += rows
                if row != shape[0]:
                    raise DataError(f"execution.host=disk: {prefix}.{e}.{'+'.join(parts)} give {row} rows of {name}, "
                                    f"the model has {shape[0]}")
                return out
        raise DataError(f"execution.host=disk: expert {e} of layer {layer_id} ({name}) is not in the checkpoint "
                        f"{self.dir} (looked for model.layers.{layer_id}.{{{','.join(self._blocks)}}}.experts.{name} "
                        f"and per-expert tensors)")

    def _bounce_of_thread(self) -> torch.Tensor:
        """This thread's bounce buffer (allocated once per thread: never per transfer)."""
        tid = threading.get_ident()
        buf = self._bounces.get(tid)
        if buf is None:
            buf = self._bounces[tid] = host_buffer(self._accel, self._biggest, dtype=torch.uint8)
        return buf

    def _read(self, piece: _Piece, out: torch.Tensor) -> None:
        """Read ``piece`` into ``out`` (a uint8 view of exactly its bytes)."""
        mv = memoryview(out.numpy())
        try:
            got = os.preadv(piece.fd, [mv], piece.offset)
        except OSError as exc:
            raise DataError(f"{piece.path}: reading {piece.name} at byte {piece.offset} failed ({exc})") from None
        if got != piece.nbytes:
            raise DataError(f"{piece.path}: short read of {piece.name} at byte {piece.offset} ({got} of "
                            f"{piece.nbytes} bytes): the file is truncated or unreadable")
        if self.page_cache == "drop":
            os.posix_fadvise(piece.fd, piece.offset, piece.nbytes, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += piece.nbytes

    def copy_into(self, layer, expert, dst):
        for piece in self.pieces[layer][expert]:
            d = dst[piece.param]
            if piece.rows is not None:
                d = d[piece.rows[0]:piece.rows[1]]
            if piece.dtype == d.dtype and self._accel is None and d.is_contiguous():
                self._read(piece, d.view(-1).view(torch.uint8))  # straight into the slot
            else:
                buf = self._bounce_of_thread()[:piece.nbytes]
                self._read(piece, buf)
                src = buf.view(piece.dtype).view(d.shape)
                if self._accel is None:
                    d.copy_(src)
                else:  # blocking: the bounce buffer is read into again at the next piece
                    self._accel.copy_(d, src, blocking=True)

    def host_views(self, layer, expert):
        raise NotImplementedError  # the offload executor reads into host scratch with copy_into

    def describe(self):
        return {**super().describe(), "page_cache": self.page_cache}

    def close(self):
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
