"""The oracle beside a realized hit rate: Belady's eviction on the same requests, at the same capacity and
batch, with the rest of the stack unchanged (docs/semantics.md "Batches and concurrency").

Users compare what a policy realized with what no policy can beat, side by side: the gap says where a
better eviction policy could still help, and where nothing can (the requests' own union fills the cache).
Belady needs the future, so the oracle exists wherever the requests are known: a replay, and a live run
that recorded its routing (``trace.save=true``), whose trace is replayed once more under Belady.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError

KEYS = ("hit_rate", "in_cache_rate", "prefill_hit_rate", "decode_hit_rate")


def oracle_rates(trace, spec, ptr=None, experts=None, exact: bool = True) -> dict:
    """``cache.oracle`` of a run: ``{"eviction": "belady", "hit_rate", "in_cache_rate", "prefill_hit_rate",
    "decode_hit_rate", "exact"}`` -- the stack ``spec`` with its eviction replaced by Belady, replayed on
    ``trace`` (``ptr``/``experts``: the requests per call an earlier replay of the trace made, reused).
    ``exact``: the replay reproduces the run's requests (false for a composed batch or a lossy stack: then
    the oracle is of the replayed requests). A stack Belady cannot run with (its config error) gives
    ``{"eviction": "belady", "error": ...}`` instead of rates: an oracle never fails a run."""
    from ..policies.eviction import EVICTION
    from .driver import build_engine, run_replay

    try:
        ospec = dataclasses.replace(spec, eviction=EVICTION.params({"name": "belady"}))
        engine, ptr, experts = build_engine(trace, ospec, ptr, experts)
        run_replay(trace, ospec, engine, ptr, experts)
    except ConfigError as exc:
        return {"eviction": "belady", "error": str(exc)}
    cache = engine.results()["cache"]
    out = {"eviction": "belady", **{k: cache.get(k) for k in KEYS}, "exact": bool(exact)}
    return out
