"""Expert stores at several precisions.

A :class:`QuantMethod` (registered in ``QUANT``, one module per library, config ``specmd/conf/quant/<name>.yaml``)
turns the experts module of every MoE layer into an :class:`ExpertStore`: for each precision, the bytes
of one expert (packed weights + scales/zeros + unquantized biases) and, on demand, the dequantized fused
weights of a layer, which are what a low-precision expert really computes with.

Precision names: ``native`` (the model's dtype), ``bf16``/``fp16`` (cast copies), ``int8``, ``int4``,
``int3``, ``int2``. The full precision of a run is the highest stored one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine.outcomes import NATIVE
from ..engine.store import BITS, StoreSizes, precision_bits  # noqa: F401 -- re-exported for quant methods
from ..registry import Plugin, Registry

CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def expert_params(experts: torch.nn.Module, num_experts: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The per-expert weight tensors of a fused experts module: 3-D parameters with a leading E axis
    (biases and other small tensors are kept at native precision)."""
    return [(n, p) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == num_experts]


class ExpertStore(StoreSizes):
    """Per-precision bytes of one expert (:class:`~specmd.engine.store.StoreSizes`, all the engine reads)
    and, on demand, an expert's weights at a stored non-native precision (dequantized; the most recently
    used ``cache_experts`` are kept in memory)."""

    def __init__(self, native_bits: int, expert_bytes: int, bytes_of: dict[str, int],
                 loader: Optional[Any] = None, cache_experts: int = 1024, raw: Optional[Any] = None,
                 unpack: Optional[Any] = None):
        """``loader(layer, expert, precision)``: the dequantized weights; with ``raw`` and ``unpack`` (a
        method that can be offloaded) ``loader`` is ``unpack(layer, precision, raw(layer, expert, precision),
        device)``: the bytes a transfer moves and the one way they become weights (:meth:`raw`,
        :meth:`unpack`)."""
        super().__init__(native_bits, expert_bytes, bytes_of)
        self._raw, self._unpack = raw, unpack
        self._loader = loader  # (layer, expert, precision) -> {param name: tensor of that expert}
        self._dequant: "OrderedDict[tuple[int, int, str], dict[str, torch.Tensor]]" = OrderedDict()
        self._cache_experts = cache_experts

    @property
    def packable(self) -> bool:
        """True when stored copies have raw bytes (:meth:`raw`) that ``execution=offload`` can move."""
        return self._raw is not None

    def raw(self, layer: int, expert: int, precision: str) -> dict[str, torch.Tensor]:
        """The stored copy of ``expert`` at ``precision`` as named host tensors, exactly the bytes a transfer
        moves: their ``nbytes`` sum to ``bytes_of[precision]``."""
        return self._raw(layer, expert, precision)

    def unpack(self, layer: int, precision: str, raw: dict, device) -> dict[str, torch.Tensor]:
        """Weights (native dtype, on ``device``) of a copy from its raw tensors -- wherever they are: the
        store's host copy (``execution=simulated``) or an arena slot (``execution=offload``), by one function,
        so both run the same numbers."""
        return self._unpack(layer, precision, raw, device)

    def weights(self, layer: int, expert: int, precision: str) -> dict[str, torch.Tensor]:
        key = (layer, expert, precision)
        cache = self._dequant
        w = cache.get(key)
        if w is None:
            w = cache[key] = self._loader(layer, expert, precision)
            if len(cache) > self._cache_experts:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return w


class QuantMethod(Plugin):
    """Builds the :class:`ExpertStore` of a model (``build(model, experts_modules, geometry, tag)``)."""

    @classmethod
    def resolve(cls, params, needed: list[str]):
        """Adapt ``params`` to the precisions the run's miss policy needs (``quant=auto`` stores exactly
        those); other methods keep what the user configured."""
        return params

    @classmethod
    def stored_precisions(cls, params) -> list[str]:
        """The precision names a store built with ``params`` will hold."""
        return [NATIVE] + list(getattr(params, "precisions", None) or [])

    def build(self, experts: list[torch.nn.Module], num_experts: int, tag: str) -> ExpertStore:
        raise NotImplementedError


def cache_dir() -> Path:
    """Where quantized expert copies are cached: ``$SPECMD_CACHE/quant``, default ``~/.cache/specmd/quant``."""
    root = os.environ.get("SPECMD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specmd")
    return Path(root) / "quant"


def model_fingerprint(experts: list[torch.nn.Module], num_experts: int, tag: str) -> str:
    """Identifies the expert weights: SHA-256 (first 16 hex digits) of the tag and, for every layer, each
    fused expert tensor's layer index, name, shape, dtype and raw bytes -- all experts, not a sample."""
    h = hashlib.sha256(tag.encode())
    for i, mod in enumerate(experts):
        for name, p in expert_params(mod, num_experts):
            t = p.detach().cpu().contiguous()
            h.update(f"{i}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


# A cache file: MAGIC, the header's length (8 bytes, little-endian), a JSON header {"format", "key",
# "payload_bytes", "payload_sha256"}, then the payload (``torch.save`` of the cached object).
CACHE_FORMAT = 1
_MAGIC = b"SPECMD-CACHE\n"
_CHUNK = 1 << 24
log = logging.getLogger("specmd")


class BadCacheFile(Exception):
    """A cache file that must not be read as numbers; the message is the reason."""


class _Window(io.RawIOBase):
    """Bytes ``[start, start + size)`` of an open file, seen as a file of their own (what ``torch.load``
    reads the payload from without copying it into memory first)."""

    def __init__(self, f, start: int, size: int):
        self._f, self._start, self._size, self._pos = f, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b):
        n = max(0, min(len(b), self._size - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


def _describe_key_mismatch(got: Any, want: dict) -> str:
    if not isinstance(got, dict):
        return f"key mismatch: holds {got!r}"
    diff = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
    if diff == ["precision"]:
        return f"key mismatch: holds {got.get('precision')}, expected {want.get('precision')}"
    return "key mismatch: " + ", ".join(f"{k} {got.get(k)!r} (expected {want.get(k)!r})" for k in diff)


def write_cache_file(path: Path, key: dict, obj: Any) -> None:
    """Writes ``obj`` under ``key`` (a JSON-able dict) with its checksum: to a temporary file whose name
    carries the pid and a random token, fsync'ed, then moved onto ``path`` with ``os.replace``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = json.dumps({"format": CACHE_FORMAT, "key": key, "payload_bytes": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_cache_file(path: Path, key: dict) -> Any:
    """The object stored in ``path``, after checking the header, that its key equals ``key``, the payload's
    length and its SHA-256; the payload is then read with ``torch.load(weights_only=True)``. Raises
    ``FileNotFoundError`` when there is no file and :class:`BadCacheFile` (naming the reason) when any
    check fails."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(_MAGIC) + 8)
        if not head.startswith(_MAGIC):
            if _MAGIC.startswith(head):
                raise BadCacheFile(f"truncated ({size} bytes, not even a header)")
            raise BadCacheFile("not a specmd cache file (no header)")
        if len(head) < len(_MAGIC) + 8:
            raise BadCacheFile(f"truncated ({size} bytes, not even a header)")
        (n,) = struct.unpack("<Q", head[len(_MAGIC):])
        raw = f.read(n) if n <= size else b""
        if len(raw) < n:
            raise BadCacheFile(f"truncated ({size} bytes, inside the header)")
        try:
            meta = json.loads(raw)
            fmt, got, want_bytes, want_sha = (meta["format"], meta["key"], int(meta["payload_bytes"]),
                                              meta["payload_sha256"])
        except (ValueError, KeyError, TypeError) as e:
            raise BadCacheFile(f"unreadable header ({e})") from None
        if fmt != CACHE_FORMAT:
            raise BadCacheFile(f"format version {fmt!r}, expected {CACHE_FORMAT}")
        if got != key:
            raise BadCacheFile(_describe_key_mismatch(got, key))
        start = f.tell()
        if size - start < want_bytes:
            raise BadCacheFile(f"truncated (payload {size - start} of {want_bytes} bytes)")
        if size - start > want_bytes:
            raise BadCacheFile(f"{size - start - want_bytes} bytes after the payload")
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if h.hexdigest() != want_sha:
            raise BadCacheFile(f"checksum mismatch (payload sha256 {h.hexdigest()[:12]}..., "
                               f"header says {str(want_sha)[:12]}...)")
        try:
            return torch.load(io.BufferedReader(_Window(f, start, want_bytes), _CHUNK), weights_only=True)
        except MemoryError:  # the machine's trouble, not the file's: never move a good file aside for it
            raise
        except Exception as e:  # noqa: BLE001 -- a payload with a valid checksum that torch cannot read
            raise BadCacheFile(f"payload unreadable ({type(e).__name__}: {e})") from None


def lock_path(path: Path) -> Path:
    """The lock of cache file ``path``: ``<cache root>/locks/<dir>-<name>.lock`` (kept out of the cache
    directory, which then holds only cache files)."""
    return path.parent.parent / "locks" / f"{path.parent.name}-{path.name}.lock"


def load_or_compute(path: Path, key: dict, compute: Callable[[], Any]) -> Any:
    """The object cached in ``path`` under ``key``, or ``compute()`` written there.

    A valid file is read without locking (files only ever appear whole, by ``os.replace``). Otherwise the
    file's lock (:func:`lock_path`, a ``filelock.FileLock``) is taken and the file checked again, so that
    of several processes wanting the same file one computes it and the others wait and then read it. A
    file that fails the check under the lock is logged as a WARNING on the ``specmd`` logger (its path and
    the reason), renamed aside to ``<name>.bad-<token>``, and computed and written anew; it is never read
    as numbers."""
    try:
        return read_cache_file(path, key)
    except (FileNotFoundError, BadCacheFile):
        pass
    from filelock import FileLock

    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        try:
            return read_cache_file(path, key)
        except FileNotFoundError:
            pass
        except BadCacheFile as e:
            bad = path.with_name(f"{path.name}.bad-{secrets.token_hex(4)}")
            os.replace(path, bad)
            log.warning("cache file %s is unusable: %s; moved it to %s and recomputing", path, e, bad.name)
        obj = compute()
        write_cache_file(path, key, obj)
        return obj


QUANT: Registry[QuantMethod] = Registry("quant", "specmd.quant")
