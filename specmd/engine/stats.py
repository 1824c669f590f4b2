"""Cache and timing accounting, per MoE layer and per forward pass."""

from __future__ import annotations

from array import array

PER_LAYER = (
    "requests",
    "requests_router",  # distinct experts the router itself selected (before routing/pruning policies)
    "hits",
    "misses",
    "collision_misses",
    "evictions",
    "evictions_pressure",  # ... of them made by the device's memory shrinking (hardware.memory_gb: Residency.resize)
    "prefetch_issued",
    "prefetch_used",
    "prefetch_late",
    "prefetch_wasted",
    "prefetch_skipped",
    "streamed",
    "layer_streams",  # layer calls streamed (hardware.stream_layers: docs/semantics.md "Layer streaming")
    "stream_served",  # ... their misses, served from the staging area (counted in misses too)
    "bytes_demand",
    "bytes_prefetch",
    "bytes_stream",  # bytes those calls moved into the staging area (a layer staged ahead: all it lacked)
    "stall_s",
    "dropped",  # miss outcomes besides fetching
    "substituted",
    "host_computed",
    "pred_true",  # prefetch predictions that the layer then requested (precision/recall, SpecMD Fig. 6)
    "pred_predicted",
    "pred_actual",
)


class PassRecord:
    """One forward pass's accounting. (Compiled, an extension type: ``stats.pxd`` declares its fields.)"""

    FIELDS = ("index", "kind", "tokens", "time_s", "stall_s", "requests", "hits", "misses", "collision_misses",
              "capacity_bytes", "kv_bytes", "bytes_moved")

    def __init__(self, index: int, kind: str, tokens: int, time_s: float, stall_s: float, requests: int, hits: int,
                 misses: int, collision_misses: int, capacity_bytes: int = 0, kv_bytes: int = -1,
                 bytes_moved: int = 0):
        self.index = index
        self.kind = kind  # "prefill" or "decode"
        self.tokens = tokens
        self.time_s = time_s
        self.stall_s = stall_s
        self.requests = requests
        self.hits = hits
        self.misses = misses
        self.collision_misses = collision_misses
        self.capacity_bytes = capacity_bytes  # the cache's bytes during the pass (every pool's)
        self.kv_bytes = kv_bytes  # the KV cache of its sequences (hardware.memory_gb), -1: not modelled
        self.bytes_moved = bytes_moved  # demand fetches, prefetches and layer streams during the pass

    def astuple(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __eq__(self, other):
        if not isinstance(other, PassRecord):
            return NotImplemented
        return self.astuple() == other.astuple()

    def __repr__(self) -> str:
        return f"PassRecord({', '.join(f'{f}={getattr(self, f)!r}' for f in self.FIELDS)})"


def _zeros(name: str, num_layers: int) -> array:
    """A per-layer counter's zeros: 64-bit integers (``stall_s``: seconds, doubles). The typed fields of the
    compiled :class:`CacheStats` view these arrays; :meth:`CacheStats.per_layer` reads one as a list."""
    return array("d" if name == "stall_s" else "q", [0]) * num_layers


# The counters besides the per-layer ones (what :meth:`CacheStats.snapshot` keeps besides them)
SCALARS = ("peak_bytes", "slots_total", "slots_unchanged", "lifetime_sum", "lifetime_n", "extra")
PER_PRECISION = ("fetched_n", "moved_bytes", "moved_any")  # the counters per stored precision


class CacheStats:
    """The counters. (A compiled extension type whose fields ``stats.pxd`` declares, so the cache manager
    updates them by C field access; the outcome counters :meth:`add` makes on first use live in its
    ``__dict__``.)"""

    def __init__(self, num_layers: int, precisions=("native",)):
        """``precisions``: the stored precisions fetches may move (the store's; more join on first use)."""
        self.num_layers = num_layers
        for name in PER_LAYER:
            setattr(self, name, _zeros(name, num_layers))
        # per precision (an index into ``precisions``): demand fetches, bytes moved (demand + prefetch), and
        # whether any were counted (``fetched_by_precision`` / ``bytes_by_precision`` list those)
        self.precisions = list(precisions)
        self._precision_index = {p: i for i, p in enumerate(self.precisions)}
        self.fetched_n = array("q", [0]) * len(self.precisions)
        self.moved_bytes = array("q", [0]) * len(self.precisions)
        self.moved_any = array("q", [0]) * len(self.precisions)
        self.passes: list[PassRecord] = []
        self.extra: list[str] = []  # per-layer counters of outcomes beyond the built-in ones
        self.peak_bytes = 0
        self.slots_total = 0  # token-expert selections made by the original router
        self.slots_unchanged = 0  # ... of which executed unchanged (routing fidelity)
        self.lifetime_sum = 0  # forward passes each evicted expert stayed resident
        self.lifetime_n = 0

    def per_layer(self, name: str) -> list:
        """A per-layer counter (built-in or an outcome's) as a list, one value per MoE layer."""
        return list(getattr(self, name))

    def snapshot(self) -> dict:
        """Every counter (not the pass records), to :meth:`restore` after a pass that must not count."""
        out = {k: self.per_layer(k) for k in PER_LAYER + tuple(self.extra)}
        out.update({k: list(getattr(self, k)) for k in PER_PRECISION})
        for k in SCALARS:
            v = getattr(self, k)
            out[k] = v.copy() if isinstance(v, list) else v
        return out

    def restore(self, snap: dict) -> None:
        """Counters back to ``snap`` (outcome counters created since are dropped); pass records stay."""
        for k in self.extra:
            if k not in snap:
                delattr(self, k)
        for k, v in snap.items():
            if k in PER_PRECISION:
                v = array("q", v) + array("q", [0]) * (len(self.precisions) - len(v))  # (and any added since)
            elif k in PER_LAYER or k in snap["extra"]:
                counts = _zeros(k, self.num_layers)
                for layer, x in enumerate(v):
                    counts[layer] = x
                v = counts
            setattr(self, k, v)

    def add(self, stat, layer: int):
        """One more of a per-layer counter; an outcome's own counter is created on first use."""
        counts = getattr(self, stat, None)
        if counts is None:
            counts = _zeros(stat, self.num_layers)
            setattr(self, stat, counts)
            self.extra.append(stat)
        counts[layer] += 1

    def count_precision(self, precision, nbytes, fetched=1):
        """``fetched`` demand fetches (0 for prefetches) moving ``nbytes`` in all at ``precision``."""
        i = self._precision_index.get(precision)
        if i is None:  # a precision beyond the store's: counted from now on
            i = self._precision_index[precision] = len(self.precisions)
            self.precisions.append(precision)
            for name in PER_PRECISION:
                setattr(self, name, array("q", getattr(self, name)) + array("q", [0]))
        self.count(i, nbytes, fetched)

    def count(self, i: int, nbytes: int, fetched: int):
        """:meth:`count_precision` by the precision's index in ``precisions`` (the request path's C call)."""
        if not 0 <= i < len(self.fetched_n):  # (an IndexError, never a stray write: compiled, unchecked below)
            raise IndexError(f"precision index {i} of {len(self.fetched_n)}")
        self.fetched_n[i] += fetched
        self.moved_bytes[i] += nbytes
        self.moved_any[i] = 1

    @property
    def fetched_by_precision(self) -> dict:
        """Demand fetches per precision (the precisions fetched at all)."""
        return {p: n for p, n in zip(self.precisions, self.fetched_n) if n}

    @property
    def bytes_by_precision(self) -> dict:
        """Bytes moved per precision, demand fetches and prefetches (the precisions counted at all)."""
        return {p: b for p, b, a in zip(self.precisions, self.moved_bytes, self.moved_any) if a}

    def total(self, name: str):
        return sum(getattr(self, name))

    def summary(self) -> dict:
        out = {name: self.total(name) for name in PER_LAYER}
        req = out["requests"]
        out["hit_rate"] = out["hits"] / req if req else 0.0
        # requests whose expert was in the cache, arrived or still in flight (a late prefetch): the cache
        # content's quality regardless of transfer timing (SpecMD's hit rates count cache membership)
        out["in_cache_rate"] = (out["hits"] + out["prefetch_late"]) / req if req else 0.0
        out["peak_bytes"] = self.peak_bytes
        for kind in ("prefill", "decode"):  # prefill windows and decode steps behave very differently
            ps = [p for p in self.passes if p.kind == kind]
            r = sum(p.requests for p in ps)
            out[f"{kind}_hit_rate"] = sum(p.hits for p in ps) / r if r else None
            out[f"{kind}_collision_misses"] = sum(p.collision_misses for p in ps)
        rr = out["requests_router"]
        out["miss_rate_vs_router"] = out["misses"] / rr if rr else 0.0  # Cache-Conditional Experts' normalisation
        out["collision_rate"] = out["collision_misses"] / req if req else 0.0
        pp, pa = out["pred_predicted"], out["pred_actual"]
        out["prefetch_precision"] = out["pred_true"] / pp if pp else None
        out["prefetch_recall"] = out["pred_true"] / pa if pa else None
        out["prefetch_accuracy"] = (out["prefetch_used"] / out["prefetch_issued"]) if out["prefetch_issued"] else None
        out["cache_lifetime"] = self.lifetime_sum / self.lifetime_n if self.lifetime_n else None
        out["miss_outcomes"] = {
            **{f"fetched_{p}": n for p, n in sorted(self.fetched_by_precision.items())},
            "dropped": out["dropped"], "substituted": out["substituted"], "host_computed": out["host_computed"],
            **{name: self.total(name) for name in self.extra},
            # misses a streamed layer call served from its staging area (hardware.stream_layers), when any
            **({"stream_served": out["stream_served"]} if out["stream_served"] else {}),
        }
        out["bytes_by_precision"] = dict(sorted(self.bytes_by_precision.items()))
        out["per_layer"] = {name: self.per_layer(name) for name in PER_LAYER}
        out["per_layer"]["hit_rate"] = [
            h / r if r else 0.0 for h, r in zip(self.hits, self.requests)
        ]
        out["per_layer"]["collision_rate"] = [
            c / r if r else 0.0 for c, r in zip(self.collision_misses, self.requests)
        ]
        return out

    def timing(self, clock: str = "simulated") -> dict:
        pre = [p for p in self.passes if p.kind == "prefill"]
        dec = [p for p in self.passes if p.kind == "decode"]
        total_t = sum(p.time_s for p in self.passes)
        total_tok = sum(p.tokens for p in self.passes)
        dec_t = sum(p.time_s for p in dec)
        return {
            "clock": clock,
            "passes": len(self.passes),
            "prefill_passes": len(pre),
            "decode_passes": len(dec),
            "ttft_s": sum(p.time_s for p in pre) / len(pre) if pre else None,
            "tpot_s": dec_t / len(dec) if dec else None,
            # all tokens the model processed per simulated second (prefill + decode)
            "tokens_per_s": total_tok / total_t if total_t > 0 else None,
            # generated tokens per second over decode passes (1/TPOT for batch 1)
            "decode_tokens_per_s": sum(p.tokens for p in dec) / dec_t if dec_t > 0 else None,
            "total_s": total_t,
            "stall_s": sum(p.stall_s for p in self.passes),
        }

    def fidelity(self) -> float:
        return self.slots_unchanged / self.slots_total if self.slots_total else 1.0
