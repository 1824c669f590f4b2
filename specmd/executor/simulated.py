"""``execution=simulated`` (the default): the whole model stays on the device and the engine only accounts
for a cache. Lossless layer calls run the family's own experts forward unchanged; a call with experts at a
stored low precision runs :func:`~specmd.executor.kernel.run_experts` with those experts' dequantized copies
in place of the native views (nothing is swapped into the live parameters)."""

from __future__ import annotations

from .base import EXECUTION, Executor, full_selection, upload
from .kernel import expert_tensors, run_experts, views_of


class Simulated(Executor):
    name = "simulated"

    def attach(self, stack) -> None:
        super().attach(stack)
        self._views = None  # per layer: {name: [E views]}, built on the first lossy call

    def run(self, mod, hidden, index, weights, plan, rec=None):
        if plan is None:
            return mod.inner(hidden, index, weights)
        dev = hidden.device
        sel, sel_w = full_selection(rec, plan.index, plan.weights)  # pad rows: the router's own (every expert is here)
        if not plan.precisions:
            return mod.inner(hidden, upload(sel, dev), upload(sel_w, dev))
        stack = self.stack
        E = stack.geom.num_experts
        if self._views is None:
            self._views = [None] * stack.geom.num_layers
        views = self._views[mod.layer]
        if views is None:
            views = self._views[mod.layer] = views_of(expert_tensors(mod.inner, E), E)
        sources = {n: list(v) for n, v in views.items()}  # this call's: low-precision experts replaced
        for e, prec in plan.precisions.items():
            for name, w in stack.store.weights(mod.layer, e, prec).items():
                sources[name][e] = w
        return run_experts(mod.inner, stack.adapter.experts_layout, hidden, upload(sel, dev), upload(sel_w, dev),
                           sources)

    def run_idle(self, mod, hidden, index, weights):
        """Every expert is on the device: the model's own outputs (generation stays the unhooked model's)."""
        return mod.inner(hidden, index, weights)


EXECUTION.register(Simulated)
