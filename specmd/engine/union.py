"""Union accounting: how many distinct experts a step loads, against the independent-routing line
(docs/semantics.md "Batches and concurrency").

At batch b a decode step's layer call requests the union of its b live tokens' experts. Under independent
routing that union is ``n (1 - (1 - k/n)^b)`` (:func:`~specmd.engine.batch.independent_union`); requests
that share experts make it smaller. What caching can save shrinks as the union approaches the layer: the
question a serving engine asks ("an expert cache won't be effective for decodes with decent batch size").

Computed once, at the end of a run, from the pass records (each pass's live tokens and its requests, the
distinct experts summed over its layer calls) and the per-layer counters: nothing on the request path.
"""

from __future__ import annotations

from typing import Optional

from .batch import independent_union


def _quantile(xs: list, q: float):
    """The ``q`` quantile of ``xs`` by linear interpolation (numpy's default), None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def union_section(stats, num_layers: int, num_experts: int, top_k: int, measure: str,
                  slots: Optional[int] = None) -> dict:
    """The ``cache.union`` section: per pass kind (``prefill``, ``decode``) over the counted passes:
    ``steps``; ``tokens_per_step`` (live tokens: the batch, for decode steps); ``distinct_per_layer`` (mean,
    p50, p95 over steps of a step's distinct experts per layer call) and its ``fraction`` of the layer's
    experts; ``independent_per_layer`` (the independent-routing union at each step's tokens, averaged the
    same way) and ``sharing`` (1 - measured / independent: how far below the line requests share experts);
    ``loads_per_token`` (distinct experts summed over layers / live tokens: what one token costs in expert
    loads); ``hit_rate``. Then ``by_layer`` (each MoE layer's mean distinct experts per counted step) and
    ``bytes_per_token`` (bytes moved, demand, prefetch and layer streams, per counted live token), and
    ``static_share``: ``slots`` (the experts the cache holds at the fetch precision; None: not known, no
    figure) over the model's experts,
    the hit rate a *static* cache of the same bytes gets once every step requests every expert (any fixed
    set of experts, picked at random: reuse between steps, what a cache exists for, is then gone). A dynamic
    policy whose decode hit rate is at or below it has stopped paying: pinning any experts would do as well
    (the criterion of ``+experiment=batch_union``'s verdict, docs/semantics.md "Batches and concurrency")."""
    passes = [p for p in stats.passes if measure == "all" or p.kind == measure]
    out: dict = {}
    L = max(1, num_layers)
    for kind in ("prefill", "decode"):
        ps = [p for p in passes if p.kind == kind and p.tokens > 0]
        if not ps:
            out[kind] = None
            continue
        per_layer = [p.requests / L for p in ps]
        ind = [independent_union(num_experts, top_k, p.tokens) for p in ps]
        tokens = sum(p.tokens for p in ps)
        req = sum(p.requests for p in ps)
        mean = sum(per_layer) / len(ps)
        ind_mean = sum(ind) / len(ps)
        out[kind] = {
            "steps": len(ps),
            "tokens_per_step": tokens / len(ps),
            "distinct_per_layer": {"mean": mean, "p50": _quantile(per_layer, 0.5), "p95": _quantile(per_layer, 0.95)},
            "fraction": mean / num_experts if num_experts else None,
            "independent_per_layer": ind_mean,
            "independent_fraction": ind_mean / num_experts if num_experts else None,
            "sharing": 1.0 - mean / ind_mean if ind_mean > 0 else None,
            "loads_per_token": req / tokens,
            "hit_rate": sum(p.hits for p in ps) / req if req else None,
        }
    steps = len(passes)
    out["by_layer"] = [r / steps for r in stats.requests] if steps else []
    tokens = sum(p.tokens for p in passes)
    moved = sum(stats.bytes_demand) + sum(stats.bytes_prefetch) + sum(stats.bytes_stream)
    out["bytes_per_token"] = moved / tokens if tokens else None
    out["static_share"] = min(1.0, slots / (L * num_experts)) if num_experts and slots is not None else None
    return out
