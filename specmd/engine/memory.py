"""The device's memory, shared (``hardware.memory_gb``; docs/semantics.md "Device memory"): the experts' cache is
what the resident dense weights, the KV cache of the live sequences and an activation reserve leave of it, so
its capacity is per forward pass.

A paper's fixed ``hardware.capacity`` is the right setting to compare policies at one budget; a user serving on
a real GPU has a budget that moves: the KV cache of the sequences in flight grows a few hundred KB per token
(OLMoE-1B-7B: 128 KiB; DeepSeek-V3's compressed MLA latent: 69 KiB) and takes its bytes from the experts. Here
the capacity of a pass is::

    memory - reserve - dense - kv(contexts of the pass's sequences)

split between the pools as ``hardware.scope`` splits a fixed one (one global pool, or evenly per MoE layer),
and capped at the arena (:attr:`DeviceMemory.ceiling`: what every routed expert needs, or the memory with no
KV cache at all, whichever is smaller). The KV cache is counted as a paged serving engine holds it (vLLM's
PagedAttention): each live sequence's own tokens -- no padding to the batch's longest, a finished sequence's
freed -- per decoder layer of the model's own attention (:class:`KvLayout`). Nothing here imports a model;
the layout is read off the model's config where the model is (``specmd.models.kv``) and travels in the
geometry (a trace's meta records it).

Units: bytes throughout; ``memory_gb`` and ``reserve_gb`` are GiB (2^30 bytes), the unit of a GPU's
"80 GB" (an H100 80GB's ``torch.cuda.mem_get_info`` total: 85.0e9 bytes, 79.2 GiB) and of the papers' model
sizes (SpecMD's "OLMoE-1B-7B is 12.89 GB" is 13.84e9 bytes of bf16 parameters: 12.89 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

GIB = 1 << 30


@dataclass(frozen=True)
class KvLayout:
    """Bytes the KV cache holds per sequence, summed over the model's decoder layers (source: the model's
    attention, :func:`specmd.models.kv.kv_layout`).

    * ``token_bytes``: per token of a sequence's context, over its full-attention layers (GQA:
      ``2 * kv_heads * head_dim * dtype`` each; MLA: the compressed latent ``(kv_lora_rank + rope_dim) * dtype``);
    * ``windows``: ``((window, bytes per token), ...)``, layers that keep at most ``window`` tokens (sliding
      window, chunked attention), one entry per distinct window;
    * ``state_bytes``: per sequence whatever its length (linear attention's recurrent and convolution state);
    * ``unknown``: why the layout could not be read (a layer type specmd cannot size), else ''.
    """

    token_bytes: int = 0
    windows: tuple = ()
    state_bytes: int = 0
    unknown: str = ""

    def bytes_of(self, contexts: Sequence[int]) -> int:
        """The KV cache of sequences of ``contexts`` tokens each (their own tokens before and in the pass)."""
        total = 0
        n = 0
        for c in contexts:
            total += c
            n += 1
        out = total * self.token_bytes + n * self.state_bytes
        for window, per_token in self.windows:
            held = 0
            for c in contexts:
                held += c if c < window else window
            out += held * per_token
        return out

    def to_dict(self) -> dict:
        return {"token_bytes": self.token_bytes, "windows": [list(w) for w in self.windows],
                "state_bytes": self.state_bytes, "unknown": self.unknown}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "KvLayout":
        """From :meth:`to_dict`'s mapping; an empty one (a trace recorded before layouts were) is unknown."""
        if not d:
            return cls(unknown="not recorded (a trace or geometry from before specmd read KV layouts)")
        return cls(int(d.get("token_bytes", 0)), tuple((int(w), int(b)) for w, b in d.get("windows", ())),
                   int(d.get("state_bytes", 0)), str(d.get("unknown", "")))


@dataclass
class DeviceMemory:
    """The memory budget of a run with ``hardware.memory_gb``: the bytes left for experts per pass.

    ``memory_bytes`` the device's, ``reserve_bytes`` the activation reserve, ``dense_bytes`` every weight that
    is not a routed expert (attention, embeddings, norms, shared experts, LM head: the model's bytes less its
    routed experts'), ``kv`` the layout, ``pools`` how many pools share the budget (evenly)."""

    memory_bytes: int
    reserve_bytes: int
    dense_bytes: int
    kv: KvLayout
    pools: int = 1
    ceiling: int = 0  # bytes per pool at most (the memory with no KV cache, at most the pool's experts)
    series: list = field(default_factory=list)  # (capacity bytes of every pool, KV bytes, experts held) per pass

    def budget(self, contexts: Sequence[int]) -> tuple[int, int]:
        """``(bytes left for experts, KV bytes)`` for a pass whose live sequences hold ``contexts`` tokens each:
        the memory less the reserve, the dense weights and their KV cache (negative: the memory cannot hold the
        pass, the caller's error: :meth:`excess`); the engine splits it between the pools."""
        kv = self.kv.bytes_of(contexts)
        return self.memory_bytes - self.reserve_bytes - self.dense_bytes - kv, kv

    def excess(self, contexts: Sequence[int]) -> int:
        """Bytes by which the dense weights, the reserve and this pass's KV cache exceed the memory (<= 0: fits)."""
        return -self.budget(contexts)[0]

    def describe(self, contexts: Sequence[int]) -> str:
        """One line of the memory's parts for a message."""
        parts = (f"{self.memory_bytes / GIB:.4g} GiB of memory; dense weights {self.dense_bytes / GIB:.4g} GiB, "
                 f"reserve {self.reserve_bytes / GIB:.4g} GiB")
        if not len(contexts):
            return parts
        return (f"{parts}, KV cache {self.kv.bytes_of(contexts) / GIB:.4g} GiB for {len(contexts)} sequence(s) of "
                f"{max(contexts)} tokens at most")

    def section(self) -> dict:
        """results.json's ``cache.memory``: the parts, and the capacity per pass (min / mean / last), in bytes
        and in whole experts of the fetched precision (each pool's, summed)."""
        total = [c for c, _, _ in self.series] or [0]
        kvs = [k for _, k, _ in self.series] or [0]
        slots = [n for _, _, n in self.series] or [0]
        return {
            "memory_bytes": self.memory_bytes, "reserve_bytes": self.reserve_bytes, "dense_bytes": self.dense_bytes,
            "kv_token_bytes": self.kv.token_bytes, "kv_windows": [list(w) for w in self.kv.windows],
            "kv_state_bytes": self.kv.state_bytes,
            "capacity_bytes": {"min": min(total), "mean": sum(total) / len(total), "last": total[-1]},
            "capacity_experts": {"min": min(slots), "mean": sum(slots) / len(slots), "last": slots[-1]},
            "kv_bytes": {"min": min(kvs), "mean": sum(kvs) / len(kvs), "max": max(kvs)},
            "passes": len(self.series),
        }
