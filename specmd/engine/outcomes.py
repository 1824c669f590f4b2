"""Miss outcomes: what happens to one requested expert that is not in the cache.

Each outcome is one small class with one method, ``serve(call, expert)``, that does both halves of its
job: the accounting (counters, transfers, host time, through the :class:`~specmd.engine.cache.LayerCall`)
and how the layer executes (through ``call.plan()``, the :class:`Execution` the experts module runs).
A new outcome is a new class here (or anywhere): neither the hook nor the cache manager changes.
``prepare(call, expert)`` runs for every outcome of a layer call before any is served (a substitute pins
its replacement there, so no fetch of the same call evicts it).
"""

from __future__ import annotations

from typing import Optional

import torch

from .record import expert_counts

NATIVE = "native"


class Execution:
    """How a layer call runs when it differs from "every selected expert, native precision, on the device".

    ``index`` [T, k] / ``weights`` [T, k]: what the experts kernel receives; ``kept`` [T, k] bool: the
    router's own selections that run unchanged (routing fidelity); ``slots``/``n_run``: the token-expert
    pairs and experts the device computes (roofline; slots a routing policy emptied, ``void``, never
    count); ``precisions``: expert -> stored precision it runs at (non-native only); ``expert_map`` [E]
    long (vLLM's ``expert_map``): the expert whose weights each expert runs from on the device, -1 = not
    run there (dropped, or computed on the host: ``host``). The executor maps it to its own slots."""

    __slots__ = ("index", "weights", "kept", "slots", "n_run", "precisions", "void", "expert_map", "host")

    def __init__(self, index: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor, slots: int, n_run: int,
                 void: Optional[torch.Tensor] = None, num_experts: Optional[int] = None):
        self.index = index
        self.weights = weights
        self.kept = kept
        self.slots = slots
        self.n_run = n_run
        self.precisions: dict[int, str] = {}
        self.void = void  # [T, k] slots a routing policy emptied (weight 0: not run, counted once by the engine)
        self.host: list[int] = []  # experts computed on the host (exact, full precision)
        E = num_experts if num_experts is not None else int(index.max()) + 1
        runs = expert_counts(index.cpu(), E) > 0  # [E], host-side: the executor reads it (an identity expert: none)
        self.expert_map = torch.where(runs, torch.arange(E), torch.full((E,), -1))  # [E]

    def slots_of(self, expert: int, mask: Optional[torch.Tensor] = None) -> int:
        """Slots of ``expert`` that really run (emptied slots excluded)."""
        if mask is None:
            mask = self.index == expert
        if self.void is not None:
            mask = mask & ~self.void
        return int(mask.sum())


class Outcome:
    kind: str = ""  # a short name (what tests and logs print)
    stat: str = ""  # per-layer counter in CacheStats (results.json ``miss_outcomes``)
    precision: Optional[str] = None  # the precision a fetched copy runs at (None: not fetched / default)

    def prepare(self, call, expert: int) -> None:
        pass

    def serve(self, call, expert: int) -> None:
        raise NotImplementedError

    def __repr__(self):
        return type(self).__name__


class Fetched(Outcome):
    """Blocking transfer of the expert at ``precision`` (None: the miss policy's ``fetch_precision``);
    inserted if room can be made, else streamed. A non-native copy runs at its precision."""

    kind = "fetch"

    def __init__(self, precision: Optional[str] = None):
        self.precision = precision

    def serve(self, call, expert):
        prec = self.precision or call.fetch_precision
        call.fetch(expert, prec)
        if prec != NATIVE:
            call.plan().precisions[expert] = prec

    def __repr__(self):
        return f"Fetched({self.precision})"

    def __eq__(self, other):
        return isinstance(other, Fetched) and other.precision == self.precision

    def __hash__(self):
        return hash(("fetch", self.precision))


class Dropped(Outcome):
    """The expert does not run in this call: its tokens' weight for it is zeroed (the others are not
    renormalised); its slots leave the device's compute."""

    kind = "drop"

    stat = "dropped"

    def serve(self, call, expert):
        call.count(self.stat)
        plan = call.plan()
        mask = plan.index == expert
        plan.weights = plan.weights.masked_fill(mask, 0)
        plan.kept &= ~mask
        plan.slots -= plan.slots_of(expert, mask)
        plan.n_run -= 1
        plan.expert_map[expert] = -1

    def __eq__(self, other):
        return isinstance(other, Dropped)

    def __hash__(self):
        return hash("drop")


class Substituted(Outcome):
    """Each token that selected the missing expert uses ``substitute[t]`` (a resident expert) instead, with
    the missing expert's weight. The substitutes are pinned for the call."""

    kind = "substitute"

    stat = "substituted"

    def __init__(self, substitute: torch.Tensor):
        self.substitute = substitute  # [T] long

    def prepare(self, call, expert):
        for s in self.substitute.unique().tolist():
            if s != expert:
                call.pin(s)

    def serve(self, call, expert):
        call.count(self.stat)
        plan = call.plan()
        hit = plan.index == expert
        sub = self.substitute.to(plan.index.device).unsqueeze(-1).expand_as(plan.index)
        before = set(plan.index.unique().tolist())
        plan.index = torch.where(hit, sub, plan.index)
        plan.kept &= ~hit
        after = set(plan.index.unique().tolist())
        plan.n_run += len(after) - len(before)
        for e in after - before:
            plan.expert_map[e] = e
        if expert not in after:
            plan.expert_map[expert] = -1


class HostComputed(Outcome):
    """Computed on the host at full precision (exact output), in parallel with the layer's transfers; the
    expert is not inserted and leaves the device's compute."""

    kind = "host"

    stat = "host_computed"

    def serve(self, call, expert):
        call.count(self.stat)
        plan = call.plan()
        slots = plan.slots_of(expert)
        call.host(slots)
        plan.slots -= slots
        plan.n_run -= 1
        plan.expert_map[expert] = -1
        plan.host.append(expert)

    def __eq__(self, other):
        return isinstance(other, HostComputed)

    def __hash__(self):
        return hash("host")
