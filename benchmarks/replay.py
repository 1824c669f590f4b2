"""Replay throughput: expert requests per second of each eviction policy through the engine, beside
libCacheSim's own C replay loop (LRU, same request sequence) and the live run of the same configuration.

    python benchmarks/replay.py                      # >= 1M requests, every eviction policy
    python benchmarks/replay.py --requests 200000 --policies lru least_stale

1. A live run of the embedded model (prefill + greedy decode, trace.save) gives the live wall time per
   request and a trace; the trace is replayed with the same stack (same cache/timing sections: checked).
2. The trace's decode passes are tiled until the trace holds >= --requests expert requests (real routing,
   repeated), then every policy replays it (prefetch=none, global pool, --capacity of the model bytes).
3. libCacheSim's LRU replays the same request sequence (keys layer*E+expert, one request per expert per
   layer call) from a text trace with its C loop (`process_trace`), capacity in experts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from specmd.compose import spec_of
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.models.loader import ModelConfig, load_model
from specmd.policies.eviction import EVICTION
from specmd.replay.driver import build_engine, run_replay
from specmd.replay.trace import Trace, TraceWriter, full_calls, read_trace


def live_run(model, spec, ids, new_tokens, path):
    with torch.no_grad():  # warm-up: the first forward passes select kernels
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    stack = install(model, spec)
    stack.writer = TraceWriter(path, stack.geom, stack.scoring, stack.store, 1)
    t0 = time.perf_counter()
    with torch.no_grad(), stack:
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    wall = time.perf_counter() - t0
    stack.writer.close()
    return stack.engine.results(), wall


def tile_decode(trace: Trace, requests: int) -> Trace:
    """The decode passes of ``trace`` repeated until the trace holds >= ``requests`` expert requests."""
    L = trace.meta["geometry"]["num_layers"]
    dec = np.flatnonzero(trace.passes[:, 0] == 1)
    rows = np.concatenate([np.arange(trace.calls[p * L, 2], trace.calls[p * L + L - 1, 2] + 1) for p in dec])
    per_pass = sum(len(np.unique(trace.index[trace.calls[p * L + l, 2]])) for p in dec for l in range(L)) / len(dec)
    reps = int(np.ceil(requests / (per_pass * len(dec))))
    rows = np.tile(rows, reps)
    passes = np.tile(trace.passes[dec], (reps, 1))
    passes[:, 2] = 1 + np.arange(len(passes)) % 2048  # context: keep attention time bounded
    meta = dict(trace.meta, depth=0)
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, L), index=np.asarray(trace.index[rows]),
                 weights=None, logits=np.asarray(trace.logits[rows]), path="tiled")


def lcs_lru(keys: np.ndarray, slots: int) -> tuple[float, float]:
    import libcachesim as lcs

    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "keys.txt")
        np.savetxt(f, keys + 1, fmt="%d")
        reader = lcs.TraceReader(f, lcs.TraceType.PLAIN_TXT_TRACE, lcs.ReaderInitParam(ignore_obj_size=True))
        cache = lcs.LRU(cache_size=slots)
        t0 = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        return time.perf_counter() - t0, 1.0 - miss_ratio


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=float, default=0.1)
    ap.add_argument("--decode", type=int, default=96, help="decode tokens of the live run")
    ap.add_argument("--policies", nargs="*", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    hw = HardwareConfig(capacity=args.capacity)
    ids = torch.randint(0, 4000, (1, 32), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        spec = spec_of(prefetch="none", hardware=hw)
        live, wall = live_run(model, spec, ids, args.decode, Path(d) / "trace")
        trace = read_trace(Path(d) / "trace")
        t0 = time.perf_counter()
        rep = run_replay(trace, spec).results()
        rwall = time.perf_counter() - t0
        assert rep["cache"] == live["cache"] and rep["timing"] == live["timing"], "replay != live"
        n = live["cache"]["requests"]
        print(f"live run (embedded model, lru, prefetch=none, capacity {args.capacity}): {n} requests, "
              f"{wall:.2f} s = {n / wall / 1e3:.1f} k req/s; replay of its trace {rwall * 1e3:.1f} ms = "
              f"{n / rwall / 1e6:.3f} M req/s ({wall / rwall:.0f}x faster; cache and timing identical)")
        big = tile_decode(trace, args.requests)
        spec0 = spec_of(eviction="lru", prefetch="none", hardware=hw)
        engine, ptr, experts = build_engine(big, spec0)
        E = big.meta["geometry"]["num_experts"]
        layer_of_req = np.repeat(big.calls[:, 1], np.diff(ptr))
        keys = layer_of_req * E + experts
        slots = engine.cache.pools[0].capacity // big.meta["geometry"]["expert_bytes"]
        print(f"tiled trace: {len(big.passes)} decode passes, {len(keys)} requests; capacity {slots} experts")
        print(f"{'policy':<12} {'M req/s':>8} {'seconds':>8} {'hit rate':>9}")
        for name in args.policies or EVICTION.names():
            spec_p = spec_of(eviction=name, prefetch="none", hardware=hw)
            engine, ptr, experts = build_engine(big, spec_p)
            t0 = time.perf_counter()
            res = run_replay(big, spec_p, engine, ptr, experts).results()
            dt = time.perf_counter() - t0
            print(f"{name:<12} {len(keys) / dt / 1e6:>8.3f} {dt:>8.2f} {res['cache']['hit_rate']:>9.4f}")
        try:
            dt, hr = lcs_lru(keys, slots)
            print(f"{'libCacheSim LRU (C loop)':<24} {len(keys) / dt / 1e6:>8.3f} M req/s  hit rate {hr:.4f}")
        except ImportError:
            print("libCacheSim not installed (pip install libcachesim==0.3.5)")


if __name__ == "__main__":
    main()
