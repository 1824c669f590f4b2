"""What a layer call would cost on a GPU, counted on the CPU: aten ops (kernel launches) and the reads that
would make the host wait for the device (synchronisations).

On a GPU the time of a hooked or offloaded MoE layer call is set by the host, not the device: every aten op
is a launch (microseconds of dispatch), and every read of device data on the host (``.item()``,
``.tolist()``, a boolean index, ``nonzero``, a copy into host memory) stalls the host until the device has
caught up, so nothing queues ahead. Neither needs a GPU to count. :class:`Counting` runs a model on the CPU
under a dispatch mode (every aten op) and a function mode (host reads, and what a factory call asked for),
tracking which tensors live in *host* memory and which would be on the *device*:

* host: registered host buffers (:func:`specmd.executor.host.register_host`: the routing read-back's, the expert map's pinned
  ring), what a read from the device returns, a factory op given no ``device`` (on a GPU machine that is
  the host), and whatever is computed from host tensors only;
* device: everything else -- the model's parameters and activations, what is computed from them, a
  factory op given a ``device``, and a host tensor moved with ``.to(device)`` (an upload: no wait).

A **sync** is a read of device data on the host: ``tolist``/``item``/``numpy``/``bool``/``int``/``float``/
``cpu``/``.to(host)`` of a device tensor, a copy or ``cat`` into a host buffer, and the ops that read their
input to size their output (``nonzero``, ``unique``, ``masked_select``, ``bincount``, boolean indexing,
``repeat_interleave`` without ``output_size``, ``equal``). **Device ops** are ops on device tensors,
**kernels** those of them that are not views (a view launches nothing), **host ops** the rest.

Counts are kept inside the MoE blocks (:meth:`Counting.scope`: the router, the hook's engine work, the
experts, the shared experts) per MoE layer call, and over everything. A proxy: it cannot see a CUDA
stream, an event, or a transfer thread's copies (host memory to host memory, ``ctypes``), and ops inside
a backend kernel are one op.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .executor.host import unwatch_host, watch_host

aten = torch.ops.aten
SYNC_OPS = {aten.nonzero, aten.argwhere, aten.masked_select, aten.bincount, aten.equal, aten.is_nonzero,
            aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.allclose,
            aten._local_scalar_dense}
READS = {"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}  # device data on the host
MOVES = {"to", "cpu", "cuda"}  # a copy that may cross host <-> device


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "Counting"):
        super().__init__()
        self.c = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        mutated = None  # an out= or in-place op writes into this tensor: the op runs where it lives
        if isinstance(kwargs.get("out"), torch.Tensor):
            mutated = kwargs["out"]
        elif func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            mutated = args[0]
        packet = func.overloadpacket
        sources = [t for t in ins if t is not mutated]
        device_src = any(not c.is_host(t) for t in sources)
        if mutated is not None:
            host = c.is_host(mutated)
        elif packet in (aten.lift_fresh, aten.lift_fresh_copy) or not ins:  # a new tensor: where the caller said
            host = not c._explicit_device
        else:
            host = not device_src
        out = func(*args, **kwargs)
        sync = False
        if device_src:
            if mutated is not None and host:  # a copy (or cat, ...) of device data into host memory
                sync = True
            elif packet in SYNC_OPS:
                sync = not c._reading  # (item & co: counted once, as the read the function mode saw)
            elif packet in (aten.index, aten.index_put, aten.index_put_):
                idx = args[1] if len(args) > 1 else kwargs.get("indices")
                sync = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ())
            elif packet is aten.repeat_interleave and kwargs.get("output_size") is None:
                sync = True
        if mutated is None:  # new outputs live where the op ran
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    c._tag(t, host)
        c._count(func, host and not sync, sync)  # a copy out of the device is launched there
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: "Counting"):
        super().__init__()
        self.c = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor):
            device_data = not c.is_host(args[0])
            c._reading += 1
            try:
                out = func(*args, **kwargs)
            finally:
                c._reading -= 1
            if device_data:
                c._read(name)
            return out
        if name in MOVES and args and isinstance(args[0], torch.Tensor):
            src_host = c.is_host(args[0])
            target = _device_arg(args[1:], kwargs) if name == "to" else name
            out = func(*args, **kwargs)
            if target is not None and not src_host:  # device data to the host
                c._read(name)
            if target is not None and isinstance(out, torch.Tensor) and out is not args[0]:
                c._tag(out, not src_host)  # (from the host: an upload, no wait)
            return out
        prev = c._explicit_device
        c._explicit_device = "device" in kwargs and kwargs["device"] is not None
        try:
            return func(*args, **kwargs)
        finally:
            c._explicit_device = prev


def _device_arg(args, kwargs):
    d = kwargs.get("device")
    if d is None:
        for a in args:
            if isinstance(a, (torch.device, str)):
                return a
    return d


class Counting:
    """``with Counting() as c: ...`` counts everything; ``c.scope(model_blocks)`` counts per MoE layer call.

    After the run: ``c.per_call()`` -> dict of ``device_ops``, ``kernels``, ``host_ops``, ``syncs`` per MoE
    layer call inside the blocks; ``c.total`` the same over everything; ``c.sync_sites`` what synced."""

    FIELDS = ("device_ops", "kernels", "host_ops", "syncs")

    def __init__(self):
        self.total = dict.fromkeys(self.FIELDS, 0)
        self.inside = dict.fromkeys(self.FIELDS, 0)
        self.calls = 0
        self.sync_sites: Counter = Counter()
        self._host_ptrs: set = set()
        self._depth = 0
        self._reading = 0
        self._explicit_device = False
        self._handles: list = []
        self._modes: list = []

    # ---- where tensors live ---------------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        if t.device.type == "meta":
            return False
        p = _ptr(t)
        return p != 0 and p in self._host_ptrs

    def _tag(self, t: torch.Tensor, host: bool) -> None:
        p = _ptr(t)
        if p == 0:
            return
        if host:
            self._host_ptrs.add(p)
        else:  # a new device tensor at this address: whatever lived there before (a freed buffer) is gone
            self._host_ptrs.discard(p)

    def _count(self, func, host: bool, sync: bool) -> None:
        view = func.is_view or func.overloadpacket in (aten.detach, aten.alias, aten.lift_fresh)
        for d in ((self.total, self.inside) if self._depth else (self.total,)):
            if host:
                d["host_ops"] += 1
            else:
                d["device_ops"] += 1
                if not view:
                    d["kernels"] += 1
            if sync:
                d["syncs"] += 1
        if sync:
            self.sync_sites[func.overloadpacket.__name__] += 1

    def _read(self, what: str) -> None:
        for d in ((self.total, self.inside) if self._depth else (self.total,)):
            d["syncs"] += 1
        self.sync_sites[what] += 1

    # ---- scope: per MoE layer call ----------------------------------------------------------------------
    def scope(self, blocks) -> "Counting":
        """Count per call of each module of ``blocks`` (the MoE blocks: router, hook, experts)."""
        for b in blocks:
            self._handles.append(b.register_forward_pre_hook(self._enter))
            self._handles.append(b.register_forward_hook(self._leave))
        return self

    def _enter(self, module, args):
        self._depth += 1
        if self._depth == 1:
            self.calls += 1

    def _leave(self, module, args, out):
        self._depth -= 1

    def _registered(self, t: torch.Tensor) -> None:
        self._host_ptrs.add(_ptr(t))

    def per_call(self) -> dict:
        n = max(self.calls, 1)
        return {k: v / n for k, v in self.inside.items()}

    def __enter__(self):
        self._host_ptrs = {_ptr(t) for t in watch_host(self._registered)}
        f, d = _Function(self), _Dispatch(self)
        f.__enter__()
        d.__enter__()
        self._modes = [f, d]
        return self

    def __exit__(self, *exc):
        f, d = self._modes
        d.__exit__(*exc)
        f.__exit__(*exc)
        unwatch_host(self._registered)
        for h in self._handles:
            h.remove()
        self._handles = []


def count_layer_calls(blocks, run, warm: bool = True) -> Counting:
    """``run()`` (a generation, say) counted per call of ``blocks`` (the MoE blocks); ``warm``: run it once
    before, uncounted, so buffers allocated once are not counted as per-call work."""
    if warm:
        run()
    c = Counting().scope(blocks)
    with c:
        run()
    return c

