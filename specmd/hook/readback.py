"""The one device-to-host synchronisation of a hooked MoE layer call: everything the engine and the policies
read on the host, copied back at once.

The engine decides on the host (which experts a call requests, victims, prefetches), so the routing must
come back from the device once per layer call; nothing else may wait for the device. :class:`Readback`
packs the call's tensors -- all ``[T, n]`` for the call's T tokens: the router's top-k index and weights,
its logits when a policy reads them, the prefetch signal of the later layers a prefetcher or the trace
writer reads -- side by side into one ``[T, bytes]`` buffer on the device (one ``cat`` of byte views),
copies it into pinned host memory with one non-blocking copy and waits on one event (on a CPU device: one
``cat`` into host memory). The host tensors are views of that buffer, one buffer per MoE layer, so a record
stays valid until its layer's next call (records are per layer). Tensors are packed widest element first,
so every view is aligned to its dtype (row widths are multiples of their element size, and element sizes
are powers of two).

What a call reads back is fixed when the stack is installed; a policy that reads what was not read back
still gets it (a second, counted read-back: never a wrong value).
"""

from __future__ import annotations

import torch

from ..accel import accel_for, host_buffer
from ..executor.host import register_host


class Readback:
    def __init__(self, device: torch.device, num_layers: int):
        self.device = torch.device(device)
        self.accel = accel_for(self.device)  # CUDA (or its CPU stand-in); None on a CPU
        self.cuda = self.accel is not None
        self._host: list = [None] * num_layers  # per MoE layer: its host byte buffer
        self._dev = None  # the device staging buffer (CUDA)
        self._event = self.accel.Event() if self.cuda else None
        self._pad = None  # zero bytes that pad a row to the widest element (device)
        self._plans: list = [{} for _ in range(num_layers)]  # per layer: call shape -> how it packs (_plan)
        self.calls = 0  # read-backs (each one synchronisation on a GPU)
        self.bytes = 0

    def __call__(self, layer: int, tensors) -> tuple:
        """Host copies (views, a tuple) of ``tensors``: device tensors of any dtypes, each ``[T, n_i]`` with the
        same T (a layer call's tokens), in their order."""
        key = tuple([t.shape for t in tensors])  # (each position's dtype is the model's: fixed per layer)
        plan = self._plans[layer].get(key)
        if plan is None:  # a new shape at this layer (the first decode, a longer prompt): laid out once
            if len(self._plans[layer]) >= 256:  # (prompts of many lengths: forgotten at once, never per call)
                self._plans[layer].clear()
            plan = self._plans[layer][key] = self._plan(layer, tensors)
        order, host, dev, pad, views = plan
        rows = [tensors[i].view(torch.uint8) for i in order]  # [T, bytes of a token's n_i]
        if pad is not None:
            rows.append(pad)
        if self.cuda:
            torch.cat(rows, dim=1, out=dev)
            host.copy_(dev, non_blocking=True)
            self._event.record()
            self._event.synchronize()  # the one wait for the device in this layer call
        else:
            torch.cat(rows, dim=1, out=host)
        self.calls += 1
        self.bytes += host.numel()
        return views

    def _plan(self, layer: int, tensors) -> tuple:
        """How calls of this shape pack: the order (widest element first), the host buffer's ``[T, width]`` view
        (and the device staging's), the padding that keeps a row aligned to its widest element, and the host
        views each tensor comes back as. A larger call grows the layer's buffers (its earlier plans go)."""
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        T = tensors[0].shape[0]
        widths = [tensors[i].shape[1] * tensors[i].element_size() for i in order]
        width = sum(widths)
        widest = tensors[order[0]].element_size()
        pad = None
        if width % widest:  # a row's width must keep every column aligned: pad it (zeros made once)
            n = widest - width % widest
            if self._pad is None or self._pad.shape[0] < T:
                self._pad = torch.zeros(max(T, 16), 8, dtype=torch.uint8, device=tensors[0].device)
            pad = self._pad[:T, :n]
            width += n
        total = T * width
        buf = self._host[layer]
        if buf is None or buf.numel() < total:  # grows to the largest call (a prefill); never per call after
            buf = self._host[layer] = register_host(host_buffer(self.accel, max(total, 64), dtype=torch.uint8))
            self._plans[layer] = {}
        host = buf[:total].view(T, width)
        dev = None
        if self.cuda:
            if self._dev is None or self._dev.numel() < total:
                self._dev = torch.empty(max(total, 64), dtype=torch.uint8, device=self.device)
                self._plans = [{} for _ in self._plans]  # views of the old staging
            dev = self._dev[:total].view(T, width)
        out = [None] * len(tensors)
        o = 0
        for i, w in zip(order, widths):
            out[i] = host[:, o:o + w].view(tensors[i].dtype)  # [T, n_i] (rows strided by the buffer's width)
            o += w
        return order, host, dev, pad, tuple(out)
