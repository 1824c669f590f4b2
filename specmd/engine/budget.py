"""Per-layer budgets (``hardware.layer_budget=proportional``; docs/semantics.md "Per-layer budgets").

Per-layer pools (``hardware.scope=per_layer``: Cache-Conditional Experts', FlashMoE's) split the cache's bytes
evenly, although layers' working sets differ (one public DeepSeek-V4 analysis: a single layer needs 251 of its
256 experts to cover 99% of its routing, where others need far fewer). Proportional budgets give each layer a
share of the same total in proportion to its **working set**: Denning's ``W(t, tau)``, the distinct experts the
layer requested in the run's first ``WARMUP`` forward passes (``tau = t = 32``). Until then the pools are
uniform; at the start of pass ``WARMUP`` they are resized (a pool that shrinks evicts its policy's victims,
counted as ``evictions_pressure``).

Why a warm-up window in every driver, not the whole trace in a replay: the engine measures it, so a replay of a
recorded run sizes its pools exactly as the live run did (replay == live), and a live run -- which has no
future -- gets the same rule. A run of fewer passes keeps uniform pools and says so (``cache.layer_budget``).

The split: each layer keeps one expert of the fetched precision first (no pool holds nothing), and the rest of
the total is divided in proportion to the working sets, ``floor`` per layer (the total is never exceeded); a
layer never gets more than its experts at the largest stored precision (the rest stays unused).
"""

from __future__ import annotations

WARMUP = 32  # forward passes measured before the pools are resized (Denning's tau)


class LayerBudget:
    """The working sets measured over the warm-up, and the per-layer capacities they give."""

    def __init__(self, num_layers: int, num_experts: int):
        self.L = num_layers
        self.E = num_experts
        self.seen = bytearray(num_layers * num_experts)  # (layer, expert) requested during the warm-up
        self.working_set: list = []  # per layer, once measured

    def observe(self, layer: int, experts) -> None:
        """A warm-up layer call's requested experts."""
        base = layer * self.E
        seen = self.seen
        for e in experts:
            seen[base + e] = 1

    def measure(self) -> list:
        """Each layer's working set (distinct experts requested in the warm-up), at least 1."""
        E = self.E
        self.working_set = [max(1, sum(self.seen[l * E:(l + 1) * E])) for l in range(self.L)]
        return self.working_set

    def split(self, total: int, floor_bytes: int, ceilings: list) -> list:
        """Per-layer capacities of ``total`` bytes: ``floor_bytes`` (one expert) each, the rest in proportion to
        the working sets (``floor``), each at most its ceiling."""
        ws = self.working_set
        W = sum(ws)
        rest = total - floor_bytes * self.L
        if rest < 0:  # (less than one expert each: an even split, as uniform pools get)
            return [min(total // self.L, c) for c in ceilings]
        return [min(floor_bytes + rest * w // W, c) for w, c in zip(ws, ceilings)]
