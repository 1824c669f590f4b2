"""Statistics of a routing trace itself (no cache involved): what the papers measure to motivate a policy.

``replay.reuse_horizon=H`` adds ``analysis.reuse_by_rank`` to a replay's results.json.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .trace import Trace


def reuse_by_rank(trace: Trace, horizon: int) -> dict:
    """Zhu et al. 2025 Fig. 6/7: "experts that achieve higher scores, even if they are inactive in a particular
    iteration, have a greater inherent probability of being reused in the next 3 iterations".

    For every decode step of one token and every MoE layer, rank all E experts by the router's logits
    (descending; rank 0 = the top-1) and ask whether the expert at each rank is among the router's top-k
    at the same layer in any of the next ``horizon`` decode steps of the same generation (a prefill pass
    starts a new one; steps too close to the end to have ``horizon`` successors are not counted). Returns
    ``{"horizon", "samples", "top_k", "probability": [E], "active", "first_inactive", "inactive"}``: the
    fraction of samples per rank, its mean over the active ranks (< k), at rank k, and over ranks >= k (the
    paper's point is that inactive high-score experts are reused more than low-score ones)."""
    if trace.logits is None:
        raise ConfigError(f"replay.reuse_horizon needs router logits; the trace {trace.path} has none (record it "
                          f"with trace.logits=fp32 or fp16)")
    if horizon < 1:
        raise ConfigError(f"replay.reuse_horizon={horizon} must be >= 1")
    E = trace.meta.geometry.router_width  # (every router column: identity experts' too, LongCat-Flash's)
    kinds = trace.passes[:, 0]
    sums, samples = np.zeros(E), 0
    # decode calls of one token, per layer, in order; a segment id that changes at every prefill pass
    segment = np.cumsum(kinds == 0)
    for layer in np.unique(trace.calls[:, 1]):
        calls = trace.calls[(trace.calls[:, 1] == layer) & (trace.calls[:, 3] == 1)]
        calls = calls[kinds[calls[:, 0]] == 1]
        if len(calls) <= horizon:
            continue
        rows = calls[:, 2]
        seg = segment[calls[:, 0]]
        order = np.argsort(-np.asarray(trace.logits[rows], dtype=np.float32), axis=1, kind="stable")  # [N, E]
        selected = np.zeros((len(rows), E), dtype=bool)  # [N, E]
        np.put_along_axis(selected, np.asarray(trace.index[rows], dtype=np.int64), True, axis=1)
        n = len(rows) - horizon
        future = np.zeros((n, E), dtype=bool)  # [N - H, E]: selected in any of the next H steps
        same = np.ones(n, dtype=bool)
        for h in range(1, horizon + 1):
            future |= selected[h:h + n]
            same &= seg[h:h + n] == seg[:n]
        reused = np.take_along_axis(future, order[:n], axis=1)[same]  # [S, E] by rank
        sums += reused.sum(axis=0)
        samples += len(reused)
    k = trace.meta.geometry.top_k
    if not samples:
        return {"horizon": horizon, "samples": 0, "top_k": k, "probability": [None] * E, "active": None,
                "first_inactive": None, "inactive": None}
    prob = sums / samples
    return {"horizon": horizon, "samples": int(samples), "top_k": k, "probability": prob.tolist(),
            "active": float(prob[:k].mean()), "first_inactive": float(prob[k]) if k < E else None,
            "inactive": float(prob[k:].mean()) if k < E else None}
