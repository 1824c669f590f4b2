"""Replay throughput: expert requests per second of each eviction policy through the engine, beside
libCacheSim's own C replay loop on the same problem, the live run of the same configuration, and a
100-configuration sweep.

    python benchmarks/replay.py                      # >= 1M requests, every eviction policy, the sweep
    python benchmarks/replay.py --requests 200000 --policies lru least_stale --no-sweep
    SPECMD_PURE_PYTHON=1 python benchmarks/replay.py # the same with the engine's pure-Python sources
    python benchmarks/replay.py --compare-pure       # ... both, in one run (the pure one in a subprocess)

1. A live run of the embedded model (prefill + greedy decode, trace.save) gives the live wall time per
   request and a trace; the trace is replayed with the same stack (same cache/timing sections: checked).
2. The trace's decode passes are tiled until the trace holds >= --requests expert requests (real routing,
   repeated), then every policy replays it (prefetch=none, global pool, --capacity of the model bytes).
3. libCacheSim's LRU (its C loop, ``process_trace`` over a plain-text trace, capacity in experts) replays the request sequence specmd's LRU served: keys ``layer * E + expert``, one request
   per distinct expert per layer call, in the engine's serve order (a call's hits first, then its misses,
   each ascending: docs/semantics.md). Both LRUs then see the same sequence and capacity; specmd also never
   evicts the running call's experts, which an LRU of >= top-k slots never picks anyway, so the two hit
   rates must be equal, and the benchmark checks they are before it prints a speed ratio.
4. The sweep: every eviction policy but ``ml`` x 10 capacities over the tiled trace, the configurations
   split over the cores, each process decoding the trace once and replaying its configurations on it.
5. Batched replay (``--batch``, default 32; 0 skips): a trace of requests made from the live run's (its
   prefill, then a window of its decode passes of 16..96 steps, each request's expert ids rotated so that
   batch-mates differ), >= --requests expert requests at batch 1, replayed as recorded and composed at
   ``replay.batch=B`` and ``replay.concurrency=B`` (specmd.replay.batching): the seconds to compose, the
   replay's expert requests per second beside batch 1's, and their ratio.
6. Device memory (``--batch`` too): the same request trace at batch 1 and at ``replay.concurrency=B``, timed as
   OLMoE-1B-7B, replayed at a fixed capacity and with ``hardware.memory_gb`` (the capacity per pass: the KV
   cache of each pass's sequences computed and the pools resized), repeats alternated: requests per second of
   each, and memory's over fixed's (the target: >= 0.8).
"""

from __future__ import annotations

import dataclasses
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
from specmd.pool import replay_many
from specmd.replay.trace import Trace, TraceWriter, full_calls, read_trace
from specmd.cli import script


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
    L = trace.meta.geometry.num_layers
    dec = np.flatnonzero(trace.passes[:, 0] == 1)
    rows = np.concatenate([np.arange(trace.calls[p * L, 2], trace.calls[p * L + L - 1, 2] + 1) for p in dec])
    per_pass = sum(len(np.unique(trace.index[trace.calls[p * L + l, 2]])) for p in dec for l in range(L)) / len(dec)
    reps = int(np.ceil(requests / (per_pass * len(dec))))
    rows = np.tile(rows, reps)
    passes = np.tile(trace.passes[dec], (reps, 1))
    passes[:, 2] = 1 + np.arange(len(passes)) % 2048  # context: keep attention time bounded
    meta = dataclasses.replace(trace.meta, depth=0)
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, L), index=np.asarray(trace.index[rows]),
                 weights=None, logits=np.asarray(trace.logits[rows]), path="tiled")


def request_trace(trace: Trace, requests: int, seed: int = 0) -> Trace:
    """Requests made from ``trace``'s first prefill and its decode passes, until the trace holds >= ``requests``
    expert requests: request i is the prefill, then decode passes ``o_i .. o_i + d_i - 1`` (cyclically; d_i in
    16..96), every expert id rotated by ``s_i`` (the router's structure kept, batch-mates made to differ)."""
    L, E = trace.meta.geometry.num_layers, trace.meta.geometry.num_experts
    dec = np.flatnonzero(trace.passes[:, 0] == 1)
    pre = int(np.flatnonzero(trace.passes[:, 0] == 0)[0])
    prompt = int(trace.passes[pre, 1])
    first_row = np.concatenate(([0], np.cumsum(trace.passes[:, 1] * L)))
    per_dec = sum(len(np.unique(trace.index[trace.calls[p * L + l, 2]])) for p in dec for l in range(L)) / len(dec)
    per_pre = sum(len(np.unique(trace.index[first_row[pre] + l * prompt:first_row[pre] + (l + 1) * prompt]))
                  for l in range(L))
    rng = np.random.default_rng(seed)
    plist, shifts, kinds, ctx, total = [], [], [], [], 0.0
    while total < requests:
        d = int(rng.integers(16, 97))
        o = int(rng.integers(len(dec)))
        plist.append(np.concatenate(([pre], dec[(o + np.arange(d)) % len(dec)])))
        shifts.append(int(rng.integers(E)))
        kinds.append(np.r_[0, np.ones(d, dtype=np.int64)])
        ctx.append(np.r_[prompt, prompt + 1 + np.arange(d)])
        total += per_pre + per_dec * d
    src = np.concatenate(plist)
    tokens = trace.passes[src, 1]
    rows = np.repeat(first_row[src] - np.concatenate(([0], np.cumsum(tokens * L)[:-1])), tokens * L) + \
        np.arange(int((tokens * L).sum()))
    shift = np.repeat(np.repeat(shifts, [len(p) for p in plist]), tokens * L)
    passes = np.stack([np.concatenate(kinds), tokens, np.concatenate(ctx)], 1).astype(np.int64)
    index = ((np.asarray(trace.index[rows], dtype=np.int64) + shift[:, None]) % E).astype(trace.index.dtype)
    logits = np.take_along_axis(np.asarray(trace.logits[rows]), (np.arange(E)[None, :] - shift[:, None]) % E, 1)
    meta = dataclasses.replace(trace.meta, depth=0)
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, L), index=index, weights=None, logits=logits,
                 path="requests")


def batched(trace: Trace, batch: int, hw, requests: int) -> None:
    """Section 5: the request trace replayed at batch 1, composed at ``replay.batch=batch`` and at
    ``replay.concurrency=batch`` (lru, prefetch=none)."""
    from specmd.replay.batching import compose_trace

    reqs = request_trace(trace, requests)
    spec = spec_of(eviction="lru", prefetch="none", hardware=hw)
    n_req = int((reqs.passes[:, 0] == 0).sum())
    print(f"batched replay: {n_req} requests (a prefill of {int(reqs.passes[0, 1])} tokens, 16..96 decode "
          f"steps), lru, prefetch=none")
    print(f"{'replay':<16} {'passes':>7} {'requests':>9} {'compose s':>9} {'replay s':>8} {'M req/s':>8} "
          f"{'hit rate':>9} {'vs B=1':>7}")
    base = None
    for label, how in (("as recorded", None), (f"batch={batch}", dict(batch=batch)),
                       (f"concurrency={batch}", dict(concurrency=batch))):
        t0 = time.perf_counter()
        tr = reqs if how is None else compose_trace(reqs, **how)
        dc = time.perf_counter() - t0
        engine, ptr, experts = build_engine(tr, spec)
        t0 = time.perf_counter()
        res = run_replay(tr, spec, engine, ptr, experts).results()
        dt = time.perf_counter() - t0
        speed = len(experts) / dt
        base = base or speed
        print(f"{label:<16} {len(tr.passes):>7} {len(experts):>9} {dc:>9.3f} {dt:>8.2f} {speed / 1e6:>8.3f} "
              f"{res['cache']['hit_rate']:>9.4f} {speed / base:>7.2f}")


def device_memory(trace: Trace, batch: int, requests: int, repeats: int = 3) -> None:
    """Section 6: fixed capacity against ``hardware.memory_gb`` on the request trace (lru, prefetch=none,
    timed as OLMoE-1B-7B: 0.89 GiB dense, 128 KiB of KV per token; 2 GiB leaves ~1.1 GiB, ~8.6% of its experts)."""
    from specmd.replay.batching import compose_trace

    reqs = request_trace(trace, requests)
    fixed = spec_of(eviction="lru", prefetch="none", hardware=HardwareConfig(capacity=0.086, timing_as="olmoe"))
    mem = spec_of(eviction="lru", prefetch="none", hardware=HardwareConfig(memory_gb=2.0, timing_as="olmoe"))
    print(f"device memory: fixed capacity 0.086 vs memory_gb=2 (timed as olmoe), lru, prefetch=none; {repeats} "
          f"repeats alternated, median (min-max)")
    print(f"{'replay':<16} {'requests':>9} {'fixed M req/s':>22} {'memory M req/s':>22} {'ratio':>6} {'mean slots':>10}")
    for label, how in (("as recorded", None), (f"concurrency={batch}", dict(concurrency=batch))):
        tr = reqs if how is None else compose_trace(reqs, **how)
        speeds: dict = {"fixed": [], "memory": []}
        slots = None
        for _ in range(repeats):
            for name, spec in (("fixed", fixed), ("memory", mem)):
                engine, ptr, experts = build_engine(tr, spec)
                t0 = time.perf_counter()
                res = run_replay(tr, spec, engine, ptr, experts).results()
                speeds[name].append(len(experts) / (time.perf_counter() - t0))
                if name == "memory":
                    slots = res["cache"]["memory"]["capacity_experts"]["mean"]
        f, m = (sorted(speeds[k]) for k in ("fixed", "memory"))
        cell = [f"{v[len(v) // 2] / 1e6:.3f} ({v[0] / 1e6:.3f}-{v[-1] / 1e6:.3f})" for v in (f, m)]
        print(f"{label:<16} {len(experts):>9} {cell[0]:>22} {cell[1]:>22} {m[len(m) // 2] / f[len(f) // 2]:>6.2f} "
              f"{slots:>10.1f}")


class ServeOrder:
    """Logs the keys an eviction policy is told about, in the order the engine serves them: ``on_access``
    (a hit, or a late prefetch) and ``on_admit`` (a miss about to be fetched) -- with prefetch=none, every
    request exactly once."""

    @staticmethod
    def of(policy_cls):
        log = []

        class Logged(policy_cls):
            def on_access(self, key):
                log.append(key)
                super().on_access(key)

            def on_admit(self, key):
                log.append(key)
                super().on_admit(key)

        Logged.name = policy_cls.name
        return Logged, log


def served_keys(big: Trace, spec) -> tuple[np.ndarray, float]:
    """The request keys in the order ``spec``'s eviction policy saw them, and its hit rate."""
    cls, params = spec.eviction
    logged, log = ServeOrder.of(cls)
    spec_l = dataclasses.replace(spec, eviction=(logged, params))
    res = run_replay(big, spec_l).results()
    return np.asarray(log, dtype=np.int64), res["cache"]["hit_rate"]


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


USER_LRU = '''
from specmd.policies.eviction.base import EVICTION, OrderedEviction


@EVICTION.register("user_lru")
class UserLRU(OrderedEviction):
    """LRU as a user writes it: one plain-Python file, registered, never compiled."""

    def on_access(self, key):
        order = self._order
        del order[key]
        order[key] = None
'''


def load_user_policy(d: str) -> None:
    """Registers ``user_lru`` from a plain file in ``d``, as a user's own policy is loaded."""
    import importlib.util
    import sys

    path = Path(d) / "user_lru.py"
    path.write_text(USER_LRU)
    spec = importlib.util.spec_from_file_location("user_lru", path)
    mod = sys.modules["user_lru"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


def sweep(trace: Trace, policies: list[str], capacities: list[float], procs: int) -> tuple[float, list]:
    """Every (policy, capacity) replayed over ``trace`` by the product's own sweep (what ``specmd mrc``
    runs: ``procs`` forked processes over the one decoded trace, each taking the next configuration)."""
    configs = [(p, c) for p in policies for c in capacities]
    specs = [spec_of(eviction=p, prefetch="none", hardware=HardwareConfig(capacity=c)) for p, c in configs]
    t0 = time.perf_counter()
    res = replay_many(trace, specs, procs)
    return time.perf_counter() - t0, [(p, c, r["cache"]["hit_rate"]) for (p, c), r in zip(configs, res)]


def parse(argv: list):
    ap = script.ArgumentParser()
    ap.add_argument("--requests", type=script.whole(1), default=1_000_000)
    ap.add_argument("--capacity", type=float, default=0.1)
    ap.add_argument("--decode", type=script.whole(1), default=96, help="decode tokens of the live run")
    ap.add_argument("--policies", nargs="*", default=None)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--procs", type=script.whole(1), default=os.cpu_count() or 1, help="processes of the sweep")
    ap.add_argument("--compare-pure", action="store_true", help="also run this benchmark with SPECMD_PURE_PYTHON=1")
    ap.add_argument("--batch", type=script.whole(0), default=32,
                    help="batched replay at this batch/concurrency (0: skip)")
    ap.add_argument("--only-batch", action="store_true", help="only the live run and the batched replay (5)")
    return ap.parse_args(argv)


def main(argv: list) -> int:
    args = parse(argv)
    from specmd import native

    print(f"engine: {native.summary()}")
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    hw = HardwareConfig(capacity=args.capacity)
    trace, live_rate = live_and_replayed(model, hw, args)  # 1.
    if args.only_batch:
        batched(trace, args.batch, hw, args.requests)
        device_memory(trace, args.batch, args.requests)
        return 0
    big = tile_decode(trace, args.requests)
    speed, slots, n = every_policy(big, hw, args.policies)  # 2.
    beside_libcachesim(big, hw, speed, slots, n, live_rate)  # 3.
    if not args.no_sweep:  # 4. the sweep
        pols = [p for p in EVICTION.names() if p not in ("ml", "user_lru")]
        caps = [round(0.05 * i, 2) for i in range(1, 11)]
        dt, res = sweep(big, pols, caps, args.procs)
        print(f"sweep: {len(res)} configurations ({len(pols)} evictions x {len(caps)} capacities) over "
              f"{n} requests on {args.procs} processes: {dt:.1f} s")
    if args.batch > 0:  # 5. batched and continuous-batching replay composed from the batch-1 requests
        batched(trace, args.batch, hw, args.requests)
        device_memory(trace, args.batch, args.requests)  # 6. the capacity per pass
    if args.compare_pure:
        import subprocess
        import sys

        argv = [a for a in sys.argv[1:] if a != "--compare-pure"]
        print("\n--- the same, SPECMD_PURE_PYTHON=1 ---", flush=True)
        subprocess.run([sys.executable, __file__, *argv], env={**os.environ, "SPECMD_PURE_PYTHON": "1"}, check=True)


def live_and_replayed(model, hw, args) -> tuple:
    """1. The live run and the replay of its trace (checked equal): ``(trace, live requests per second)``."""
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
    return trace, n / wall


def every_policy(big, hw, policies) -> tuple:
    """2. Every eviction policy (and a user's policy file) on the tiled trace: ``(requests per second by policy,
    the capacity in experts, the requests)``."""
    spec0 = spec_of(eviction="lru", prefetch="none", hardware=hw)
    engine, ptr, experts = build_engine(big, spec0)
    slots = engine.cache.pools[0].capacity // big.meta.geometry.expert_bytes
    print(f"tiled trace: {len(big.passes)} decode passes, {len(experts)} requests; capacity {slots} experts")
    print(f"{'policy':<12} {'M req/s':>8} {'seconds':>8} {'hit rate':>9}")
    speed = {}
    load_user_policy(tempfile.mkdtemp())
    for name in (policies or [p for p in EVICTION.names() if p != "user_lru"]) + ["user_lru"]:
        spec_p = spec_of(eviction=name, prefetch="none", hardware=hw)
        engine, ptr, experts = build_engine(big, spec_p)
        t0 = time.perf_counter()
        res = run_replay(big, spec_p, engine, ptr, experts).results()
        dt = time.perf_counter() - t0
        speed[name] = len(experts) / dt
        print(f"{name:<12} {speed[name] / 1e6:>8.3f} {dt:>8.2f} {res['cache']['hit_rate']:>9.4f}")
    return speed, slots, len(experts)


def beside_libcachesim(big, hw, speed: dict, slots: int, n: int, live_rate: float) -> None:
    """3. libCacheSim's LRU on the sequence specmd's LRU served (their hit rates checked equal), each policy's
    speed as a fraction of its."""
    keys, hr_specmd = served_keys(big, spec_of(eviction="lru", prefetch="none", hardware=hw))
    assert len(keys) == n, (len(keys), n)
    try:
        dt, hr = lcs_lru(keys, slots)
    except ImportError:
        print("libCacheSim not installed (pip install libcachesim==0.3.5)")
        return
    lcs_speed = len(keys) / dt
    same = abs(hr - hr_specmd) < 5e-5
    print(f"{'libCacheSim LRU (C loop)':<24} {lcs_speed / 1e6:>8.3f} M req/s  hit rate {hr:.4f} "
          f"(specmd lru {hr_specmd:.4f}: {'equal' if same else 'DIFFERENT, the ratio is meaningless'})")
    for name, v in speed.items():
        print(f"  {name:<12} {v / lcs_speed:>7.3f} of libCacheSim's speed (1/{lcs_speed / v:.0f})")
    print(f"  replay vs live, same configuration: {speed.get('lru', 0) / live_rate:.0f}x (lru on the tiled trace)")


if __name__ == "__main__":
    script.run("benchmarks/replay.py", main)
