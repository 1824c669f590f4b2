"""The replay driver: feeds a recorded (or imported) routing trace to the same engine the live hook feeds.

``python -m specmd replay.trace=PATH [replay.format=...] eviction=... prefetch=... hardware...``: every
group applies; the model and the task come from the trace. For each recorded forward pass the driver calls
``engine.begin_pass``, then per MoE layer call ``engine.route(record)`` and ``engine.layer(record)``, then
``engine.end_pass`` -- the order and the records the live hook produces, so for a stack that does not change
what the model computes (standard routing, every requested expert executed exactly: ``miss=fetch`` at native
precision, ``miss=cpu_compute`` or ``miss=hybrid`` without a low copy) the ``cache`` and ``timing`` sections
equal the live run's bit for bit.
Other stacks are applied to the recorded logits (later layers' routing cannot react to the change) and the
results say ``exact: false`` with the reasons.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..engine.engine import Engine
from ..engine.record import GateRecord, NoLogits, Scoring, fill
from ..errors import ConfigError
from ..readers import read_results
from .config import open_trace, refuse_batched
from .future import Future
from .trace import KINDS, Trace


class TraceRecord(GateRecord):
    """A layer call read from rows of a trace, its tensors built on first use: an exact replay of a stack
    that reads no router output (LRU, no prefetch) never builds any. Same values as the live record (index
    int64, logits fp32 as recorded). (An extension type: ``driver.pxd``; the replay loop makes each one
    with :func:`trace_record`, no constructor call.)"""

    def __init__(self, trace: Trace, rows: slice, layer: int, scoring: Scoring, requested: list, signal):
        trace_record(self, trace, rows.start, rows.stop - rows.start, layer, scoring, requested, signal,
                     trace.index.shape[1], None)

    @property
    def rows(self) -> slice:
        """The trace rows of this call (one per token)."""
        return slice(self.r0, self.r0 + self.n)

    @property
    def original(self) -> torch.Tensor:
        if self._original is None:
            self._original = torch.from_numpy(self.trace.index[self.rows].astype(np.int64))
        return self._original

    @property
    def original_weights(self) -> torch.Tensor:
        if self._original_weights is None:
            w = self.trace.weights
            self._original_weights = (torch.from_numpy(w[self.rows].astype(np.float32)) if w is not None
                                      else torch.full((self.n, self.k), 1.0 / self.k))
        return self._original_weights

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            if self.trace.logits is None:
                raise NoLogits(f"the trace {self.trace.path} has no router logits, which this stack reads (a routing "
                               f"policy such as max_rank or cache_prior); record one with trace.logits=fp32")
            self._logits = torch.from_numpy(np.ascontiguousarray(self.trace.logits[self.rows]))
        return self._logits

    @property
    def probs(self) -> torch.Tensor:
        """Router probabilities from the recorded logits. An import without logits approximates them by its
        recorded top-k weights (uniform 1/k when it has none) scattered over the experts, zero elsewhere:
        enough for policies that rank experts by score (``exact`` is false for imports anyway)."""
        if self._probs is None:
            if self.trace.logits is not None:
                self._probs = self.scoring.probs(self.logits)
            elif self.trace.meta.imported:
                self._probs = torch.zeros(self.n, self.trace.meta.geometry.router_width).scatter_(
                    -1, self.original, self.original_weights.float())
            else:
                raise NoLogits(f"the trace {self.trace.path} has no router logits, which this stack reads (router "
                               f"probabilities); record one with trace.logits=fp32")
        return self._probs

    def probs_rows(self):
        """``probs`` as float32 numpy rows, from the replay's :class:`ProbsTable` when it has one."""
        if self.table is None:
            return GateRecord.probs_rows(self)
        return self.table.rows(self.r0, self.n)

    @property
    def tokens(self) -> int:
        return self.n

    @property
    def top_k(self) -> int:
        return self.k


class ProbsTable:
    """Router probabilities of a trace's rows, computed ``chunk`` rows at a time as the replay reaches them
    (one softmax per chunk instead of one per layer call, for :meth:`TraceRecord.probs_rows`). Only for
    softmax routers: the softmax of a row is computed by the same kernel whatever the rows around it, so
    a chunk's rows have the bits of the call's own ``scoring.probs(logits)`` (tested); an elementwise
    sigmoid may take another code path for a row at another offset, so sigmoid routers keep the per-call
    computation (:func:`probs_table` returns None)."""

    def __init__(self, trace: Trace, scoring: Scoring, chunk: int = 8192):
        self.logits = trace.logits
        self.scoring = scoring
        self.chunk = chunk
        self.c0 = self.c1 = 0
        self.probs = None

    def rows(self, r0: int, n: int):
        """Rows ``r0 .. r0 + n``'s probabilities ([n, E] float32; a view: read, never write)."""
        if r0 < self.c0 or r0 + n > self.c1:
            self.c0 = r0
            self.c1 = min(len(self.logits), r0 + max(n, self.chunk))
            logits = torch.from_numpy(np.ascontiguousarray(self.logits[self.c0:self.c1]))
            self.probs = self.scoring.probs(logits).numpy()
        return self.probs[r0 - self.c0:r0 - self.c0 + n]


def probs_table(trace: Trace, scoring: Scoring) -> Optional[ProbsTable]:
    """The replay's :class:`ProbsTable`, or None where records compute their own (no logits, sigmoid)."""
    if trace.logits is None or scoring.elementwise:
        return None
    return ProbsTable(trace, scoring)


def trace_record(rec: TraceRecord, trace, r0: int, n: int, layer: int, scoring, requested, signal, k: int,
                 table) -> TraceRecord:
    """``rec``'s fields: the gate record's (:func:`~specmd.engine.record.fill`), then the trace's rows
    ``r0 .. r0 + n``."""
    fill(rec, layer, scoring, signal, requested)
    rec.trace = trace
    rec.r0 = r0
    rec.k = k
    rec.n = n
    rec._slots = n * k
    rec._original = rec._original_weights = rec._logits = None
    rec.table = table
    return rec


class TraceSignal:
    """The recorded prefetch signal of one layer call: ``target``'s logits and top-k at depth
    ``target - layer - 1``."""

    __slots__ = ("trace", "rows", "layer")

    def __init__(self, trace: Trace, rows: slice, layer: int):
        self.trace = trace
        self.rows = rows
        self.layer = layer

    def __call__(self, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = target - self.layer - 1
        tr = self.trace
        if not 0 <= d < tr.depth or tr.signal_logits is None:
            raise NoLogits(f"the trace records the prefetch signal {tr.depth} layer(s) ahead with "
                           f"logits={tr.meta.logits}; layer {self.layer} asked for layer {target}")
        logits = torch.from_numpy(np.ascontiguousarray(tr.signal_logits[self.rows, d]))
        index = torch.from_numpy(tr.signal_index[self.rows, d].astype(np.int64))
        return logits, index


def requested_per_call(trace: Trace, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(call_ptr [C+1], experts): the ascending distinct experts (below ``num_experts``: an identity expert's id
    is none to serve) of the router's own top-k of each call.
    Calls hold consecutive rows in call order (both the writer and the importers lay them out so).
    A [calls, router width] membership mask per chunk of calls (sliced to E), whose nonzeros are call-major and
    ascending: 24x
    faster than sorting (call, expert) keys (0.03 s instead of 0.70 s for 1 M requests)."""
    calls = trace.calls
    if len(calls) and not (calls[0, 2] == 0 and np.all(calls[1:, 2] == calls[:-1, 2] + calls[:-1, 3])):
        raise ConfigError(f"{trace.path}: the layer calls must hold consecutive rows in call order")
    counts = np.zeros(len(calls) + 1, dtype=np.int64)
    experts = []
    step = max(1, (1 << 24) // max(num_experts, 1))  # calls per chunk: a 16 MB mask
    for c0 in range(0, len(calls), step):
        part = calls[c0:c0 + step]
        r0, r1 = int(part[0, 2]), int(part[-1, 2] + part[-1, 3])
        call_of_row = np.repeat(np.arange(len(part), dtype=np.int64), part[:, 3])
        mask = np.zeros((len(part), trace.meta.geometry.router_width), dtype=bool)
        mask[call_of_row[:, None], np.asarray(trace.index[r0:r1], dtype=np.int64)] = True
        mask = mask[:, :num_experts]
        counts[c0 + 1:c0 + 1 + len(part)] = mask.sum(1)
        experts.append(np.nonzero(mask)[1])
    return np.cumsum(counts), np.concatenate(experts) if experts else np.zeros(0, dtype=np.int64)


def changes_computation(spec) -> list[str]:
    """Why ``spec`` makes the model compute something else than its router chose (empty: it does not, so a
    run of it records the unmodified model's routing and a replay of it is exact)."""
    reasons = []
    if spec.routing[0].name != "standard":
        reasons.append(f"routing={spec.routing[0].name} changes the selection; later layers' routing is the recorded one")
    mcls, mparams = spec.miss
    if not mcls.lossless(mparams):
        reasons.append(f"miss={mcls.name} changes what the model computes; later layers' routing is the recorded one")
    return reasons


def exactness(trace: Trace, spec) -> list[str]:
    """Why a replay of ``spec`` on ``trace`` may differ from the live run (empty: exact)."""
    reasons = []
    src = trace.meta.source
    if trace.meta.imported:
        reasons.append(f"imported {trace.meta.imported} trace (no live run to match)")
    if src.get("exact") is False:
        reasons.append(f"the recording run's stack ({src.get('stack')}) changed what the model computed, so the "
                       f"recorded routing is not the unmodified model's")
    if src.get("device", "cpu") != "cpu":
        reasons.append(f"recorded on {src['device']}: router probabilities recomputed on the CPU can differ in the "
                       f"last bits")
    reasons += changes_computation(spec)
    if trace.meta.logits != "fp32":
        reasons.append(f"router logits recorded as {trace.meta.logits}")
    if trace.speculative is not None:
        from .speculative import APPROXIMATION

        reasons.append(APPROXIMATION)
    b = trace.batching
    if b and b["steps"] < b["passes"]:  # some step holds several requests (none does: the trace as recorded)
        from .batching import INEXACT

        reasons.append(INEXACT)
    return reasons


def signal_fallback(trace: Trace, spec, set_by_user=()):
    """``spec``, or a copy with ``prefetch=none`` where it is the *default* prefetcher and reads a prefetch signal
    an imported trace cannot have (no engine's capture records later layers' routers on this layer's input):
    the default stack then replays an import as written in the docs, with a note. A prefetcher the user named
    (``prefetch=...`` on the command line or in a sweep) is never replaced: :func:`check` refuses it, naming
    the ones that run; so is an experiment's (its stack is one choice), and any prefetcher of a run whose
    caller did not pass the command line's overrides (``execute(cfg)`` from Python: what was named is unknown)."""
    pcls, pparams = spec.prefetch
    if not trace.meta.imported or pcls.signal_depth(pparams) <= trace.depth:
        return spec
    if any(key == "prefetch" or key.startswith("prefetch.") for key in set_by_user):
        return spec
    import dataclasses

    from ..policies.prefetch import PREFETCH

    trace.notes.append(f"prefetch={pcls.name} (the default) reads a prefetch signal this imported trace does not "
                       f"have (no capture records later layers' routers on a layer's input): replayed with "
                       f"prefetch=none (name prefetch=oracle for the upper bound)")
    return dataclasses.replace(spec, prefetch=PREFETCH.params({"name": "none"}))


def check(trace: Trace, spec) -> None:
    """Config errors a replay can find before it starts."""
    pcls, pparams = spec.prefetch
    need = pcls.signal_depth(pparams)
    if need > trace.depth:
        how = (f"record it with trace.depth={need}" if not trace.meta.imported
               else "an imported trace has no prefetch signal: use prefetch=none or prefetch=oracle")
        raise ConfigError(f"prefetch={pcls.name} reads the prefetch signal {need} layer(s) ahead; the trace "
                          f"{trace.path} records {trace.depth} ({how})")
    if need and trace.signal_logits is None:
        raise ConfigError(f"prefetch={pcls.name} needs the recorded signal logits; the trace {trace.path} has "
                          f"logits={trace.meta.logits} (record it with trace.logits=fp32)")
    if spec.measure == "decode" and not (trace.passes[:, 0] == 1).any():
        raise ConfigError(f"stack.measure=decode counts decode passes only, and the trace {trace.path} has none "
                          f"({len(trace.passes)} prefill passes): use stack.measure=all or a trace of a generation task")
    mcls, mparams = spec.miss
    stored = trace.meta.store.bytes_of
    missing = [p for p in mcls.required_precisions(mparams) if p not in stored]
    if missing:
        raise ConfigError(f"miss={mcls.name} needs precision(s) {missing}; the trace {trace.path} stores only "
                          f"{', '.join(stored)} (record it with quant=hqq quant.precisions including {missing})")


def build_engine(trace: Trace, spec, ptr=None, experts=None):
    """The engine for one replay of ``trace``, and the requests per call (``ptr``/``experts``: pass the
    arrays :func:`requested_per_call` made for an earlier configuration of the same trace to reuse them)."""
    geom, store = trace.meta.geometry, trace.meta.store
    if ptr is None or experts is None:
        ptr, experts = requested_per_call(trace, geom.num_experts)
    future = Future(trace.calls[:, 1], ptr, experts, geom.num_experts)
    return Engine(geom, spec, store, future), ptr, experts


def pass_contexts(trace: Trace) -> list:
    """Each pass's live sequences' contexts (lists): a composed trace's members', else one sequence per pass of
    the pass's ``context``. A trace recorded at a batch above 1 records only the batch's mean context, not each
    sequence's: refused (a ConfigError naming the way that is exact: record at batch 1 and compose)."""
    if trace.contexts is not None:
        ptr, values = trace.contexts
        values = values.tolist()
        return [values[a:b] for a, b in zip(ptr[:-1].tolist(), ptr[1:].tolist())]
    refuse_batched(trace, "hardware.memory_gb", ", and records each pass's mean context, not each sequence's KV "
                   "cache; record it at eval.batch_size=1 and replay it with replay.batch={batch} (exact per sequence)")
    return [[c] for c in trace.passes[:, 2].tolist()]


def check_memory(trace: Trace, engine) -> None:
    """A replay whose largest pass's KV cache leaves the dense weights no room is refused before any pass runs
    (the engine would refuse at that pass): the error names the pass and the memory's parts."""
    mem = engine.memory
    if mem is None:
        return
    for p, contexts in enumerate(pass_contexts(trace)):
        if mem.excess(contexts) > 0:
            raise ConfigError(f"hardware.memory_gb={engine.spec.hardware.memory_gb:g} cannot hold forward pass {p} "
                              f"of {trace.path}: {mem.describe(contexts)}")


def run_replay(trace: Trace, spec, engine=None, ptr=None, experts=None) -> Engine:
    """Drive ``engine`` (built from ``spec`` when not given) through every pass and layer call of ``trace``."""
    if engine is None:
        check(trace, spec)
        engine, ptr, experts = build_engine(trace, spec)
    scoring = trace.meta.scoring
    has_signal = trace.depth > 0 and trace.signal_logits is not None
    table = probs_table(trace, scoring)
    eng = engine
    k = trace.index.shape[1]
    c = 0
    # Neither the lists below nor the loop make a reference cycle (its records and handles die by reference
    # counting), so the cyclic collector would only re-scan the engine's and the process's live objects:
    # ~18% of an LRU replay in the loop, and ~5% more while ``tolist`` makes a million small lists.
    collecting = gc.isenabled()
    gc.disable()
    try:
        # the calls and their request offsets read in C (memoryviews of writable copies: as source, each
        # read is a Python int, 2.5x faster than a numpy scalar); the requested experts as one list of ints,
        # sliced per call (the list the cache manager serves)
        calls = memoryview(np.array(trace.calls, dtype=np.int64, ndmin=2))
        offsets = memoryview(np.array(ptr, dtype=np.int64))
        requested = experts.tolist()  # (typed, compiled: sliced as a list, without a slice object per call)
        C = calls.shape[0]
        if calls.shape[1] < 4 or offsets.shape[0] != C + 1:  # (read unchecked below)
            raise ValueError(f"{trace.path}: {C} layer calls of {calls.shape[1]} fields (4 expected) and "
                             f"{offsets.shape[0]} request offsets ({C + 1} expected)")
        sequences = pass_contexts(trace) if eng.memory is not None else None  # (what the KV cache holds)
        for p, (kind, tokens, context) in enumerate(trace.passes.tolist()):
            if sequences is None:
                eng.begin_pass(KINDS[kind], tokens, context)
            else:
                eng.begin_pass(KINDS[kind], tokens, context, sequences[p])
            while c < C and calls[c, 0] == p:
                layer, r0, n = calls[c, 1], calls[c, 2], calls[c, 3]
                rec = trace_record(TraceRecord.__new__(TraceRecord), trace, r0, n, layer, scoring,
                                   requested[offsets[c]:offsets[c + 1]],
                                   TraceSignal(trace, slice(r0, r0 + n), layer) if has_signal else None, k, table)
                eng.route(rec)
                eng.layer(rec)
                c += 1
            eng.end_pass()
    finally:
        if collecting:
            gc.enable()
    return engine


def batching_section(trace: Trace) -> dict:
    """The results' ``replay.batching``: how the replayed passes were composed (:mod:`.batching`), or mode
    None for the passes as recorded."""
    from .batching import requests_in

    if trace.batching:
        return {k: trace.batching[k] for k in ("mode", "batch", "concurrency", "arrival_rate", "requests", "steps")}
    return {"mode": None, "batch": 1, "concurrency": None, "arrival_rate": None, "requests": requests_in(trace),
            "steps": int(len(trace.passes))}


def replay(run, run_dir) -> tuple[dict, Engine]:
    """One replay run (from :func:`specmd.app.execute`): results.json's dict."""
    t0 = time.perf_counter()
    trace = open_trace(run.replay)
    chosen = set(getattr(run, "set_by_user", ()))
    if (run.raw or {}).get("experiment") or not getattr(run, "overrides_known", False):
        chosen.add("prefetch")  # an experiment's stack is chosen as a whole; unknown overrides: as if named
    spec = signal_fallback(trace, run.spec, chosen)
    check(trace, spec)
    engine, ptr, experts = build_engine(trace, spec)
    check_memory(trace, engine)
    run_replay(trace, spec, engine, ptr, experts)
    reasons = exactness(trace, spec)
    config = dict(run.raw)
    if spec is not run.spec:  # the prefetcher replayed is not the one composed: say so where the config is read
        config["prefetch"] = {"name": spec.prefetch[0].name}
    model = trace.meta.source.get("model")  # a live run's model config; a bare name (TraceMeta.model); none
    config["model"] = model if isinstance(model, dict) else {"name": trace.meta.model or
                                                              f"trace:{Path(trace.path).name}",
                                                              "source": trace.meta.source}
    from ..provenance import provenance
    from ..results import assemble

    wall_s = time.perf_counter() - t0
    src = trace.meta.source
    recorded = Path(trace.path).parent / "results.json"  # a recorded run writes its trace into <run dir>/trace
    tasks = {}
    if not reasons and src.get("exact") and recorded.exists():
        # an exact replay of a lossless recording computes what the recorded run computed: its task scores hold
        tasks = read_results(recorded).get("tasks") or {}  # (checked: a damaged record is one line naming it)
    sections = {"replay": {
        "trace": str(trace.path), "format": run.replay.format, "exact": not reasons, "inexact_because": reasons,
        "passes": int(len(trace.passes)), "layer_calls": int(len(trace.calls)), "requests": int(len(experts)),
        "notes": list(trace.notes), "source": trace.meta.source,
        "tasks_from": str(recorded) if tasks else None, "batching": batching_section(trace),
    }}
    from .speculative import speculative_section

    sections["speculative"] = speculative_section(trace, engine)
    if run.replay.reuse_horizon:
        from .analysis import reuse_by_rank

        sections["analysis"] = {"reuse_by_rank": reuse_by_rank(trace, int(run.replay.reuse_horizon))}
    results = assemble(config, tasks, wall_s, provenance(trace_path=trace.path), engine, **sections)
    if run.replay.oracle:  # the requests are known: Belady's hit rates beside the realized ones
        results["cache"]["oracle"] = oracle_rates(trace, spec, ptr, experts, exact=not reasons)
    return results, engine


# The oracle beside a realized hit rate: Belady's eviction on the same requests, at the same capacity and batch,
# the rest of the stack unchanged (docs/semantics.md "Batches and concurrency"). Users compare what a policy
# realized with what no policy can beat: the gap says where a better eviction policy could still help. Belady
# needs the future, so the oracle exists wherever the requests are known: a replay, and a live run that
# recorded its routing (trace.save=true), whose trace is replayed once more under Belady.
ORACLE_KEYS = ("hit_rate", "in_cache_rate", "prefill_hit_rate", "decode_hit_rate")


def oracle_rates(trace, spec, ptr=None, experts=None, exact: bool = True) -> dict:
    """``cache.oracle`` of a run: ``{"eviction": "belady", "hit_rate", "in_cache_rate", "prefill_hit_rate",
    "decode_hit_rate", "exact"}`` -- the stack ``spec`` with its eviction replaced by Belady, replayed on
    ``trace`` (``ptr``/``experts``: the requests per call an earlier replay of the trace made, reused).
    ``exact``: the replay reproduces the run's requests (false for a composed batch or a lossy stack: then
    the oracle is of the replayed requests). A stack Belady cannot run with (its config error) gives
    ``{"eviction": "belady", "error": ...}`` instead of rates: an oracle never fails a run."""
    from ..policies.eviction import EVICTION

    try:
        ospec = dataclasses.replace(spec, eviction=EVICTION.params({"name": "belady"}))
        engine, ptr, experts = build_engine(trace, ospec, ptr, experts)
        run_replay(trace, ospec, engine, ptr, experts)
    except ConfigError as exc:
        return {"eviction": "belady", "error": str(exc)}
    cache = engine.results()["cache"]
    out = {"eviction": "belady", **{k: cache.get(k) for k in ORACLE_KEYS}, "exact": bool(exact)}
    return out
