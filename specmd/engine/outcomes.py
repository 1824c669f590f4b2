"""Miss outcomes: what happens to one requested expert that is not in the cache.

Each outcome is one small class with one method, ``serve(call, expert)``, that says what becomes of the
expert in one verb of the :class:`~specmd.engine.call.LayerCall`: ``call.fetch(expert, precision)``,
``call.drop(expert, stat)``, ``call.substitute(expert, substitute, stat)``, ``call.compute_on_host(expert,
stat)``. A verb does both halves of the outcome's job together -- the accounting (counters, transfers, host
time) and how the layer executes (the call's :class:`Execution`, through the plan's own method of the same
name) -- so an outcome cannot set one field of the plan and forget another: what runs, at which precision,
from where, what was moved and what it cost always agree (:meth:`Execution.problems` says so, and
``tests/engine/test_outcomes.py`` asks it of every registered miss and routing policy). A new outcome is a new
class here (or anywhere) composing the verbs: neither the hook nor the cache manager changes.
``prepare(call, expert)`` runs for every outcome of a layer call before any is served (a substitute pins
its replacement there with ``call.pin``, so no fetch of the same call evicts it).
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

    # -- what an outcome does to the plan: each sets every field it touches (LayerCall's verbs call these) --
    def run_at(self, expert: int, precision: str) -> None:
        """``expert`` runs on the device from its stored ``precision`` copy (native: nothing to record)."""
        if precision != NATIVE:
            self.precisions[expert] = precision

    def drop(self, expert: int, renormalise: bool = False) -> None:
        """``expert`` does not run in this call: its tokens' weight for it is zeroed (``renormalise``: each
        token's other weights scaled back to their sum before, else left as they are), its slots are no longer
        the router's own, leave the device's compute, and it leaves the expert map."""
        mask = self.index == expert  # [T, k]
        w = self.weights.masked_fill(mask, 0)
        if renormalise:
            w = w * (self.weights.sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp_min(1e-30))
        self.weights = w
        self.kept &= ~mask
        self.slots -= self.slots_of(expert, mask)
        self.n_run -= 1
        self.expert_map[expert] = -1

    def substitute(self, expert: int, substitute: torch.Tensor) -> None:
        """Each token that selected ``expert`` uses ``substitute[t]`` ([T] long, resident experts) instead, with
        the missing expert's weight: those slots are no longer the router's own; the experts that now run (and
        the one that no longer does) enter (leave) the expert map and the device's count."""
        hit = self.index == expert  # [T, k]
        sub = substitute.to(self.index.device).unsqueeze(-1).expand_as(self.index)  # [T, k]
        before = set(self.index.unique().tolist())
        self.index = torch.where(hit, sub, self.index)
        self.kept &= ~hit
        after = set(self.index.unique().tolist())
        self.n_run += len(after) - len(before)
        for e in after - before:
            self.expert_map[e] = e
        if expert not in after:
            self.expert_map[expert] = -1

    def to_host(self, expert: int) -> int:
        """``expert`` is computed on the host (exact, full precision): its slots leave the device's compute and it
        leaves the expert map (its slots stay the router's own). Returns its slots (what the host computes)."""
        slots = self.slots_of(expert)
        self.slots -= slots
        self.n_run -= 1
        self.expert_map[expert] = -1
        self.host.append(expert)
        return slots

    def problems(self) -> list:
        """What in the plan disagrees with itself (empty: consistent): the shapes of ``index``/``weights``/
        ``kept``; ``n_run`` against the experts the map runs; ``slots`` against the non-empty slots whose expert
        runs on the device (an identity expert, id >= E, counts: the engine takes those out); a host expert or
        a dropped one still in the map, or a dropped one's slot still weighted or the router's own; a precision
        recorded for an expert the device does not run. For tests and checks; never on a run's path."""
        out = []
        if not (self.index.shape == self.weights.shape == self.kept.shape) or self.kept.dtype != torch.bool:
            return [f"index {tuple(self.index.shape)}, weights {tuple(self.weights.shape)}, kept "
                    f"{tuple(self.kept.shape)} {self.kept.dtype}: one [T, k] shape, kept bool"]
        E = self.expert_map.numel()
        runs = self.expert_map >= 0  # [E]
        if int(runs.sum()) != self.n_run:
            out.append(f"n_run {self.n_run}, the expert map runs {int(runs.sum())}")
        if not bool(((self.expert_map == torch.arange(E)) | ~runs).all()):
            out.append("the expert map names an expert other than itself")
        live = torch.ones_like(self.kept) if self.void is None else ~self.void.to(self.kept.device)  # [T, k]
        index = self.index.cpu()
        on_device = (index >= E) | runs[index.clamp(max=E - 1)]  # [T, k]
        counted = int((on_device & live.cpu()).sum())
        if counted != self.slots:
            out.append(f"slots {self.slots}, the device runs {counted}")
        for e in self.host:
            if bool(runs[e]):
                out.append(f"expert {e} is computed on the host and in the expert map")
        dropped = ~on_device & live.cpu()  # [T, k] slots whose expert runs nowhere on the device ...
        for e in self.host:
            dropped &= index != e  # ... nor on the host
        if bool((self.weights.cpu()[dropped] != 0).any()) or bool(self.kept.cpu()[dropped].any()):
            out.append("a dropped expert's slot keeps its weight or stays the router's own")
        for e in self.precisions:
            if not bool(runs[e]):
                out.append(f"expert {e} has a precision ({self.precisions[e]}) but does not run on the device")
        return out


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
        call.fetch(expert, self.precision or call.fetch_precision)

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
        call.drop(expert, self.stat)

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
        call.substitute(expert, self.substitute, self.stat)


class HostComputed(Outcome):
    """Computed on the host at full precision (exact output), in parallel with the layer's transfers; the
    expert is not inserted and leaves the device's compute."""

    kind = "host"

    stat = "host_computed"

    def serve(self, call, expert):
        call.compute_on_host(expert, self.stat)

    def __eq__(self, other):
        return isinstance(other, HostComputed)

    def __hash__(self):
        return hash("host")
