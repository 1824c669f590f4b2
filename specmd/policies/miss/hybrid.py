from dataclasses import dataclass
from typing import Optional

from .base import MISS, Fetched, HostComputed, MissPolicy, percentile_bands


@dataclass
class HybridParams:
    low: Optional[str] = None  # a stored precision fetched for low-scored misses (null: lossless)
    percentile: float = 60.0  # misses scored below this percentile of the call's experts may take ``low``

    def __post_init__(self):
        from ...engine.store import BITS

        if self.low is not None and self.low not in BITS:
            raise ValueError(f"low={self.low!r}; valid: null, {', '.join(BITS)}")
        if not 0.0 <= self.percentile <= 100.0:
            raise ValueError(f"percentile={self.percentile} must be in [0, 100]")


class Hybrid(MissPolicy):
    """Hybrid misses: each missed expert is fetched over the link or computed on the host from the host tier,
    whichever the costs say lets the layer finish first given what the link and the host already have queued,
    so both resources work at once (FreeToken, Fiddler; Zhu et al.'s pipeline: "while the CPU computes one
    expert (E2), another (E0) can be simultaneously loaded into GPU memory via PCIe"). ``fetch`` (every miss
    over the link) and ``cpu_compute``'s host side are its two ends; with ``low`` set, a fetch of the stored
    ``low`` copy is a third option for the misses scored below the ``percentile``-th percentile of the call
    (lossy, as ``fetch_priority`` degrades them).

    The costs are the clock's, through the cache view's ``clock``: ``transfer_time`` (one expert on the link),
    ``host_time`` (the host's batch of experts: the profile's host roofline plus its per-call, per-expert and
    per-token costs, which ``specmd calibrate`` measures on the model's own experts; a miss added to the
    host's batch costs the difference) and
    ``device_time`` (its compute once on the device); ``link_backlog`` / ``host_backlog`` (what is queued:
    a transfer on the link, a prefetch promoted by this call's hits). The layer ends when the device has
    computed every expert it runs -- after the last fetch lands -- and the host has computed its share. The
    host runs beside the link; beside the device's compute too where it is a processor of its own
    (``host_beside_device``, a GPU's host: ``max(link + device, host)``), before it where it shares the
    device's cores (a CPU: ``max(link, host) + device``), as the clock charges it (``SimClock``). Misses are
    placed one by one, each where the layer's end comes out earlier:

    - **order: most tokens first** (longest host job first, the LPT rule for a makespan; ties: lower id).
      Zhu's Algorithm 2 sweeps by gate score and balances ``max(T_load, T_cpu)`` only; it neither sees the
      link's backlog nor the device's share, and always loads the top expert even when the host would
      finish it sooner (``tests/policies/test_policies.py`` shows both cases).
    - **ties go to the fetch**: a fetched expert is inserted into the cache and may hit later ("we
      prioritize loading high-scoring experts into GPU memory because ... these experts are more likely to be
      reused", Zhu et al. §V-A); a host-computed one is not.
    - a score (for ``low``) is the expert's highest routing weight over the tokens that selected it (the
      weight its output gets, read back with the routing, so the policy needs no logits).

    Host-computed experts run at full precision (exact output) and are not inserted."""

    name = "hybrid"

    reads_logits = False  # (Policy.reads_logits: the routing weights suffice)

    Params = HybridParams

    @classmethod
    def lossless(cls, params):
        return params.low is None

    @classmethod
    def computes_on_host(cls, params):
        return True

    @classmethod
    def required_precisions(cls, params):
        return ["native"] + ([params.low] if params.low else [])

    def setup(self, model):
        self.num_experts = model.num_experts
        # the outcomes it answers with, made once (they hold no per-call state)
        self._fetch, self._fetch_low, self._on_host = Fetched("native"), Fetched(self.params.low), HostComputed()
        if self.params.low:
            model.store.check([self.params.low], f"miss={self.name}")

    def handle(self, layer, missing, record, cache):
        import numpy as np

        index = record.index  # [T, k] on the host
        per_expert = np.bincount(index.numpy().reshape(-1), minlength=self.num_experts)  # [E] tokens per expert
        identity = 0
        if per_expert.shape[0] > self.num_experts:  # identity experts' slots (LongCat-Flash's): no compute
            identity = int(per_expert[self.num_experts:].sum())
            per_expert = per_expert[:self.num_experts]
        counts = dict(zip(missing, per_expert[missing].tolist()))  # the misses' tokens
        hit_n = int(np.count_nonzero(per_expert)) - len(missing)
        hit_slots = index.numel() - identity - sum(counts.values())
        device = cache.clock.device_time(hit_slots, hit_n) if hit_n else 0.0  # the device's compute: the hits first
        link = None  # when the last fetch lands (seconds from now); None: no fetch, the device waits for none
        backlog = cache.clock.link_backlog()
        host_free = cache.clock.host_backlog()
        host, hs, hn = host_free, 0, 0  # when the host's share ends; its slots and experts so far
        c_fetch = cache.clock.transfer_time("native")
        low = self._degraded(record, missing) if self.params.low else ()
        c_low = cache.clock.transfer_time(self.params.low) if low else 0.0
        fetch, fetch_low, on_host = self._fetch, self._fetch_low, self._on_host
        out = [fetch] * len(missing)
        end = _beside if cache.clock.host_beside_device() else _before
        for i in sorted(range(len(missing)), key=lambda i: (-counts[missing[i]], missing[i])):
            c = counts[missing[i]]
            d = cache.clock.device_time(c, 1)
            start = backlog if link is None else link
            best, choice = end(start + c_fetch, device + d, host), (start + c_fetch, device + d, host, fetch)
            if i in low:
                t = end(start + c_low, device + d, host)
                if t < best:
                    best, choice = t, (start + c_low, device + d, host, fetch_low)
            h = host_free + cache.clock.host_time(hs + c, hn + 1)  # (one batch: the host's per-call cost once)
            t = end(0.0 if link is None else link, device, h)
            if t < best:
                best, choice = t, (link, device, h, on_host)
            link, device, host, out[i] = choice
            if out[i] is on_host:
                hs, hn = hs + c, hn + 1
        if not hn and fetch_low not in out:
            return None  # every miss fetched native: the cache manager's fast path (no execution plan)
        return out

    def _degraded(self, record, missing) -> set:
        """Positions in ``missing`` whose score is below the percentile of the call's requested experts."""
        import torch

        index, weights = record.index, record.weights
        requested = index.unique().tolist()
        idx = index.new_tensor(requested)
        w = torch.where(index.unsqueeze(-1) == idx, weights.unsqueeze(-1).float(), weights.new_zeros((), dtype=torch.float))
        scores = w.amax(1).amax(0)  # [n] highest routing weight per requested expert
        band = dict(zip(requested, percentile_bands(scores, self.params.percentile, 1)))
        return {i for i, e in enumerate(missing) if band[e] > 0}


def _beside(link: float, device: float, host: float) -> float:
    """When the layer ends (seconds from now) with the host beside the device (a GPU's host CPU): the device
    computes after the last fetch lands, the host meanwhile."""
    return max(link + device, host)


def _before(link: float, device: float, host: float) -> float:
    """... with the host on the device's cores (a CPU): the device's experts wait for the link and the host."""
    return max(link, host) + device


MISS.register(Hybrid)
