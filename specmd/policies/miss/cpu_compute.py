from .base import MISS, Fetched, HostComputed, MissPolicy, expert_scores


class CPUCompute(MissPolicy):
    """CPU-assisted computing (Zhu et al. 2025, Algorithm 2; Fiddler-style): the misses of a layer call,
    sorted by gate score (the family's selection score, ``expert_scores``; highest first), are split with a
    two-pointer sweep between transfers to the device (from the front: high-score experts are loaded, they are more likely to be reused) and computation on
    the host (from the back), always extending whichever side has the smaller accumulated time (ties: load), which balances
    ``max(T_load, T_cpu)``. This greedy does not minimise it in every case: with ``C_load = 1`` and one
    expert's ``C_cpu = 5`` it still sends the lowest-scored miss to the host (max 5) where loading all four
    would take 4 -- it is Zhu's schedule as published, not an optimiser. ``C_load`` is one expert's transfer time on the emulated link;
    ``C_cpu`` the host roofline time of that expert for its tokens (hardware ``host_tflops``,
    ``host_mem_bandwidth_gbps``). Host-computed experts run at full precision (exact output) and are not
    inserted into the cache; their time overlaps the layer's transfers."""

    name = "cpu_compute"

    reads_logits = False  # (Policy.reads_logits)

    @classmethod
    def lossless(cls, params):
        return True

    @classmethod
    def computes_on_host(cls, params):
        return True

    def handle(self, layer, missing, record, cache):
        scores = expert_scores(record, missing)
        order = sorted(range(len(missing)), key=lambda i: (-float(scores[i]), missing[i]))
        c_load = cache.clock.transfer_time(self.fetch_precision)
        counts = [int((record.index == missing[i]).sum()) for i in order]
        t_load = t_cpu = 0.0
        lo, hi = 0, len(order) - 1
        host = set()
        while lo <= hi:
            if t_load <= t_cpu:
                t_load += c_load
                lo += 1
            else:
                t_cpu += cache.clock.host_time(counts[hi], 1)
                host.add(order[hi])
                hi -= 1
        fetch, on_host = Fetched(), HostComputed()
        return [on_host if i in host else fetch for i in range(len(missing))]


MISS.register(CPUCompute)
