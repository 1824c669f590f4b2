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

from ..counting import register_host


class Readback:
    def __init__(self, device: torch.device, num_layers: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: list = [None] * num_layers  # per MoE layer: its host byte buffer
        self._dev = None  # the device staging buffer (CUDA)
        self._event = torch.cuda.Event() if self.cuda else None
        self._pad = None  # zero bytes that pad a row to the widest element (device)
        self.calls = 0  # read-backs (each one synchronisation on a GPU)
        self.bytes = 0

    def __call__(self, layer: int, tensors) -> list:
        """Host copies (views) of ``tensors``: device tensors of any dtypes, each ``[T, n_i]`` with the same T
        (a layer call's tokens), in their order."""
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        rows = [tensors[i].view(torch.uint8) for i in order]  # [T, bytes of a token's n_i]
        T = rows[0].shape[0]
        width = sum(r.shape[1] for r in rows)
        widest = tensors[order[0]].element_size()
        if width % widest:  # a row's width must keep every column aligned: pad it (zeros made once)
            pad = widest - width % widest
            if self._pad is None or self._pad.shape[0] < T:
                self._pad = torch.zeros(max(T, 16), 8, dtype=torch.uint8, device=tensors[0].device)
            rows.append(self._pad[:T, :pad])
            width += pad
        total = T * width
        buf = self._host[layer]
        if buf is None or buf.numel() < total:  # grows to the largest call (a prefill); never per call after
            buf = self._host[layer] = register_host(torch.empty(max(total, 64), dtype=torch.uint8,
                                                                pin_memory=self.cuda))
        host = buf[:total].view(T, width)
        if self.cuda:
            dev = self._dev
            if dev is None or dev.numel() < total:
                dev = self._dev = torch.empty(max(total, 64), dtype=torch.uint8, device=self.device)
            dev = dev[:total].view(T, width)
            torch.cat(rows, dim=1, out=dev)
            host.copy_(dev, non_blocking=True)
            self._event.record()
            self._event.synchronize()  # the one wait for the device in this layer call
        else:
            torch.cat(rows, dim=1, out=host)
        self.calls += 1
        self.bytes += total
        out = [None] * len(tensors)
        o = 0
        for i, r in zip(order, rows):  # (the padding, last, is not read)
            n = r.shape[1]
            out[i] = host[:, o:o + n].view(tensors[i].dtype)  # [T, n_i] (rows strided by the buffer's width)
            o += n
        return out
