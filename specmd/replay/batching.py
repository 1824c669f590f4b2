"""Replay at any batch size and concurrency, composed from a batch-1 trace (docs/replay.md "Batched and
continuous-batching replay").

A batch-1 trace (recorded by specmd at ``eval.batch_size=1``, or imported) is a sequence of **requests**: a
request is a prefill pass followed by the decode passes up to the next prefill pass. A serving engine runs
several requests at once; this module lays the same requests out as the passes such an engine would run,
as an ordinary :class:`~specmd.replay.trace.Trace`, so the replay driver, the engine and the oracles
(Belady's :class:`~specmd.replay.future.Future`) run on it unchanged:

* **static batching** (``replay.batch=B``): requests grouped ``B`` at a time in trace order. lm-eval batches
  consecutive requests of its own sorted order, and a batch-1 recording is in that order, so this is the
  grouping a live run at ``eval.batch_size=B`` makes. A group is one prefill pass holding every member's
  prompt, then decode steps: step ``s`` holds the ``s``-th decode pass of every member that has one (a
  finished sequence is no request: it is absent, not padded), so the group lasts as long as its longest
  member.
* **continuous batching** (``replay.concurrency=C``), vLLM v0's scheduler: ``C`` slots; at each engine step,
  if requests are waiting and slots are free the step is a prefill of the admitted requests' prompts (all
  that fit, in trace order), otherwise a decode step of every running request's next decode pass; a request
  leaves when its decode passes are exhausted (one with none, a loglikelihood window, right after its
  prefill). Prefill and decode never share a step (v0 without chunked prefill); "fit" counts slots only
  (v0's token budget per step, ``max_num_batched_tokens``, is not modelled: a prefill step may hold C
  prompts). Arrivals: all requests waiting at the start, or (``replay.arrival_rate``) a seeded Poisson
  process of that mean per engine step; a step with nothing running and nothing arrived skips to the next
  arrival (no empty passes).

A composed pass's layer call holds its members' rows of that layer, members in order (trace order), as the
batch's flattened rows are ordered live; a pass has every layer any member had (an import may lack some:
such a member contributes no rows there, and a call of no rows is not emitted). Its ``tokens`` are the
members' (live tokens only) and its ``context`` is :func:`batched_context` of theirs (the one rule, in
:mod:`specmd.engine.batch`, that the live hook records for a live batched pass too; importable from here
as well; :func:`batched_contexts` is its vectorised twin, held to the same integers). Every array is
gathered with one row permutation: nothing loops per row in Python, and the continuous schedule loops once
per admission, departure or arrival, never per step or row.

Composition is an **approximation** of a live batch, and a replay says so (``exact: false``) whenever a
step holds more than one request: each request's routing is the one it had alone, whereas a live batch's
numerics (padding, batched kernels' reduction order) can flip a near-tie in the router, and a live batch's
stop times can differ (a sampled or length-capped generation). What it keeps exact is everything the cache
sees from the routing: every expert a request selects, in the step it selects it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..engine.batch import batched_context  # noqa: F401 - the one context rule: the live hook records it too
from ..errors import ConfigError
from .trace import Trace

MODES = ("static", "continuous")
INEXACT = ("composed from independent batch-1 requests: an approximation of a live batch (routing of a request "
           "does not depend on its batch-mates; a live batch's numerics and stop times can differ)")


def batched_contexts(tokens: np.ndarray, contexts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """:func:`batched_context` of each segment of ``tokens`` / ``contexts`` (segments begin at ``starts``,
    each non-empty), vectorised: the same integers (halves up; no live token: 0), in int64 arithmetic."""
    t = np.asarray(tokens, dtype=np.int64)
    num = np.add.reduceat(t * np.asarray(contexts, dtype=np.int64), starts)
    den = np.add.reduceat(t, starts)
    return np.where(den > 0, (2 * num + den) // (2 * np.maximum(den, 1)), 0)


def request_bounds(trace: Trace) -> np.ndarray:
    """``[n + 1]``: the first pass of each of the trace's ``n`` requests, then the number of passes.

    A request is a prefill pass and the decode passes up to the next prefill. A trace that starts with a
    decode pass is refused: its first request's prompt is not in the trace, so it cannot be batched with
    others (its prefill would be missing from the group's prefill). Every importer starts each sequence
    with a prefill pass (:mod:`specmd.replay.formats`: the first token of a sequence is kind 0, vllm's prompt
    is one prefill), and the writer records one per prompt, so only a cut trace (``select_passes`` in the
    middle of a generation, a tiled decode-only benchmark trace) starts with a decode."""
    kinds = np.asarray(trace.passes[:, 0])
    P = len(kinds)
    if P and kinds[0] != 0:
        run = int(np.argmax(kinds == 0)) if (kinds == 0).any() else P
        raise ConfigError(f"{trace.path}: pass 0 is a decode pass (kind {int(kinds[0])}), and passes 0..{run - 1} "
                          f"precede the first prefill: a request is a prefill pass and the decode passes after "
                          f"it, so a trace to batch must start with a prefill (a cut or decode-only trace "
                          f"cannot be composed; replay it with replay.batch=1)")
    bad = (kinds != 0) & (kinds != 1)
    if bad.any():
        p = int(np.argmax(bad))
        raise ConfigError(f"{trace.path}: pass {p} has kind {int(kinds[p])} (0 prefill, 1 decode)")
    return np.append(np.flatnonzero(kinds == 0), P).astype(np.int64)


@dataclass
class Schedule:
    """Where each pass of a batch-1 trace runs in the composed trace: ``step`` ``[P]`` (the composed pass
    of each original pass), ``steps`` (composed passes), ``bounds`` (:func:`request_bounds`), and what
    made it (``mode``, ``batch``, ``concurrency``, ``arrival_rate``, ``seed``; ``arrival`` ``[n]`` the
    engine step each request arrived at, continuous mode only)."""

    step: np.ndarray
    steps: int
    bounds: np.ndarray
    mode: str
    batch: int = 1
    concurrency: Optional[int] = None
    arrival_rate: Optional[float] = None
    seed: int = 0
    arrival: Optional[np.ndarray] = None

    @property
    def requests(self) -> int:
        return len(self.bounds) - 1

    def members(self) -> list[list[int]]:
        """The requests of each composed pass, in order (for tests and reading; not on any hot path)."""
        req = np.repeat(np.arange(self.requests), np.diff(self.bounds))
        order = np.argsort(self.step, kind="stable")
        out: list[list[int]] = [[] for _ in range(self.steps)]
        for p in order.tolist():
            out[int(self.step[p])].append(int(req[p]))
        return out

    def info(self) -> dict:
        """The results' ``replay.batching`` section, and ``passes``: the batch-1 trace's (``steps`` equals it
        exactly when no step holds two requests: the composed trace is then the trace as recorded)."""
        return {"mode": self.mode, "batch": int(self.batch), "concurrency": self.concurrency,
                "arrival_rate": self.arrival_rate, "requests": int(self.requests), "steps": int(self.steps),
                "passes": int(self.bounds[-1])}


def _ordinals(bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request of each pass, its ordinal in its request: 0 the prefill, j the j-th decode)."""
    lengths = np.diff(bounds)
    req = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return req, np.arange(int(bounds[-1]), dtype=np.int64) - bounds[:-1][req]


def static_schedule(trace: Trace, batch: int) -> Schedule:
    """Requests ``batch`` at a time in trace order: a group's prefill, then its decode steps until its
    longest member's last (module docstring)."""
    bounds = request_bounds(trace)
    n = len(bounds) - 1
    req, ordinal = _ordinals(bounds)
    if n == 0:
        return Schedule(np.zeros(0, dtype=np.int64), 0, bounds, "static", batch)
    group_first = np.arange(0, n, batch)
    group_steps = np.maximum.reduceat(np.diff(bounds), group_first)  # 1 + the longest member's decodes
    group_base = np.concatenate(([0], np.cumsum(group_steps)[:-1]))
    step = group_base[req // batch] + ordinal
    return Schedule(step, int(group_steps.sum()), bounds, "static", batch)


def arrivals(n: int, rate: Optional[float], seed: int = 0) -> np.ndarray:
    """The engine step each of ``n`` requests arrives at (trace order): all at 0 when ``rate`` is None,
    else a Poisson process of ``rate`` arrivals per engine step (exponential gaps of mean ``1 / rate``,
    ``numpy.random.default_rng(seed)``), the arrivals of step ``t`` being those in ``[t, t + 1)``."""
    if rate is None:
        return np.zeros(n, dtype=np.int64)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def continuous_schedule(trace: Trace, concurrency: int, arrival_rate: Optional[float] = None, seed: int = 0,
                        arrival: Optional[np.ndarray] = None) -> Schedule:
    """vLLM v0's continuous batching over ``concurrency`` slots (module docstring); ``arrival``: the engine
    step each request arrives at, non-decreasing (a serving log's), instead of :func:`arrivals`' draw.

    The loop runs once per event -- an admission (one prefill step), a run of decode steps up to the next
    departure or arrival, a jump over idle time -- so at most 4 iterations per request. Running requests
    are kept as the decode count at which each finishes (a heap); a request admitted after ``d0`` decode
    steps runs in decode steps ``d0 .. d0 + decodes - 1``, so its j-th decode pass is the composed step of
    the ``(d0 + j)``-th decode step: placed afterwards with one ``searchsorted``."""
    bounds = request_bounds(trace)
    n = len(bounds) - 1
    decodes = (np.diff(bounds) - 1).tolist()
    given = arrival is not None
    arrival = arrivals(n, arrival_rate, seed) if not given else np.asarray(arrival, dtype=np.int64)
    if len(arrival) != n or (n and (arrival[0] < 0 or (np.diff(arrival) < 0).any())):
        raise ValueError(f"{n} requests need {n} non-decreasing arrival steps >= 0, got {arrival.tolist()[:8]}")
    arrive = arrival.tolist()
    prefill_step = np.zeros(n, dtype=np.int64)
    runs: list = []  # (is_decode, count) in step order
    running: list = []  # heap of the decode count at which each running request finishes
    s = t = d = nxt = 0  # composed steps, engine time (steps incl. idle), decode steps, next request to admit
    while nxt < n or running:
        free = concurrency - len(running)
        if free > 0 and nxt < n and arrive[nxt] <= t:  # a prefill step: every arrived request that fits
            m = nxt + 1
            last = min(n, nxt + free)
            while m < last and arrive[m] <= t:
                m += 1
            prefill_step[nxt:m] = s
            for r in range(nxt, m):
                if decodes[r]:
                    heapq.heappush(running, d + decodes[r])
            runs.append((False, 1))
            nxt = m
            s += 1
            t += 1
        elif running:  # decode steps until the next departure (or, with a free slot, the next arrival)
            k = running[0] - d
            if free > 0 and nxt < n:
                k = min(k, arrive[nxt] - t)
            runs.append((True, k))
            s += k
            t += k
            d += k
            while running and running[0] <= d:
                heapq.heappop(running)
        else:  # nothing running, nothing arrived: no pass until the next arrival
            t = arrive[nxt]
    is_decode = np.repeat(np.array([r[0] for r in runs], dtype=bool), [r[1] for r in runs])
    decode_steps = np.flatnonzero(is_decode)
    req, ordinal = _ordinals(bounds)
    first_decode = np.searchsorted(decode_steps, prefill_step)  # decode steps before each admission
    step = prefill_step[req]
    dec = ordinal > 0
    step[dec] = decode_steps[first_decode[req[dec]] + ordinal[dec] - 1]
    return Schedule(step, s, bounds, "continuous", 1, concurrency, arrival_rate, seed,
                    arrival if arrival_rate is not None or given else None)


def compose(trace: Trace, schedule: Schedule) -> Trace:
    """The trace whose passes are ``schedule``'s steps (module docstring): calls in (step, layer) order
    with their members' rows in trace order, every row array gathered with one permutation. The result
    carries ``batching`` (the results' section) and shares ``trace``'s meta and notes."""
    P = len(trace.passes)
    out = gather_steps(trace, np.arange(P, dtype=np.int64), np.asarray(schedule.step, dtype=np.int64), schedule.steps)
    out.batching = schedule.info()
    return out


def gather_steps(trace: Trace, members: np.ndarray, step: np.ndarray, S: int) -> Trace:
    """The trace of ``S`` composed passes: member ``j`` (a pass ``members[j]`` of ``trace``; a pass may be a
    member more than once -- a speculative replay re-runs rejected positions) runs in composed pass
    ``step[j]``; every composed pass has a member, all prefill or all decode. A composed pass's layer call holds
    its members' rows of that layer, members in their given order; its ``tokens`` are theirs summed and its
    ``context`` :func:`batched_context` of theirs. Each composed pass's live sequences (``contexts``, what their
    KV cache holds) are its members' (a member's own sequences where ``trace`` says them, else one of its
    ``context``). Every row array is gathered with one permutation."""
    passes = np.asarray(trace.passes, dtype=np.int64)
    order = np.argsort(step, kind="stable")  # members by composed step, then in their given order
    members, mstep = np.asarray(members, dtype=np.int64)[order], np.asarray(step, dtype=np.int64)[order]
    first = np.searchsorted(mstep, np.arange(S))  # every step has a member
    member = passes[members]
    out_passes = np.empty((S, 3), dtype=np.int64)
    out_passes[:, 0] = member[first, 0]
    out_passes[:, 1] = np.add.reduceat(member[:, 1], first) if S else 0
    out_passes[:, 2] = batched_contexts(member[:, 1], member[:, 2], first) if S else 0
    if S and not np.array_equal(np.minimum.reduceat(member[:, 0], first), np.maximum.reduceat(member[:, 0], first)):
        raise AssertionError("a composed step mixes prefill and decode passes")  # the schedules never do

    calls = np.asarray(trace.calls, dtype=np.int64)
    calls = calls[calls[:, 3] > 0]  # a call of no rows contributes none
    # each member's calls (the trace's calls are in pass order): a member repeated brings its calls again
    cptr = np.searchsorted(calls[:, 0], np.arange(len(passes) + 1))
    ncalls = cptr[members + 1] - cptr[members]
    cidx = np.repeat(cptr[members] - (np.cumsum(ncalls) - ncalls), ncalls) + np.arange(int(ncalls.sum()), dtype=np.int64)
    calls, cstep = calls[cidx], np.repeat(mstep, ncalls)
    # by (step, layer); stable, so a step's calls at one layer keep their members' order (one int64 key: 4x
    # faster than a lexsort of three)
    corder = np.argsort(cstep * (int(calls[:, 1].max(initial=0)) + 1) + calls[:, 1], kind="stable")
    sc, cstep = calls[corder], cstep[corder]
    lens = sc[:, 3]
    R = int(lens.sum())
    new = np.ones(len(sc), dtype=bool)
    new[1:] = (cstep[1:] != cstep[:-1]) | (sc[1:, 1] != sc[:-1, 1])
    cfirst = np.flatnonzero(new)
    out_calls = np.empty((len(cfirst), 4), dtype=np.int64)
    out_calls[:, 0] = cstep[cfirst]
    out_calls[:, 1] = sc[cfirst, 1]
    out_calls[:, 3] = np.add.reduceat(lens, cfirst) if len(cfirst) else 0
    out_calls[:, 2] = np.cumsum(out_calls[:, 3]) - out_calls[:, 3]
    dst = np.cumsum(lens) - lens
    perm = np.repeat(sc[:, 2] - dst, lens) + np.arange(R, dtype=np.int64)

    def gather(a):
        return None if a is None else np.asarray(a)[perm]

    if trace.contexts is None:  # one sequence per member pass
        ptr, values = np.append(first, len(member)).astype(np.int64), member[:, 2].copy()
    else:  # the members' own sequences, in member order
        src_ptr, src_values = trace.contexts
        n = src_ptr[members + 1] - src_ptr[members]
        values = np.asarray(src_values)[np.repeat(src_ptr[members] - (np.cumsum(n) - n), n)
                                        + np.arange(int(n.sum()), dtype=np.int64)]
        ptr = np.concatenate(([0], np.cumsum(np.add.reduceat(n, first)) if S else [])).astype(np.int64)
    return Trace(meta=trace.meta, passes=out_passes, calls=out_calls, index=gather(trace.index),
                 weights=gather(trace.weights), logits=gather(trace.logits),
                 signal_index=gather(trace.signal_index), signal_logits=gather(trace.signal_logits),
                 path=trace.path, notes=list(trace.notes), batching=trace.batching, contexts=(ptr, values),
                 speculative=trace.speculative)


def compose_trace(trace: Trace, batch: int = 1, concurrency: Optional[int] = None,
                  arrival_rate: Optional[float] = None, seed: int = 0) -> Trace:
    """``trace`` composed at static batch ``batch`` or at ``concurrency`` (the config's checks are
    :class:`~specmd.replay.config.ReplayConfig`'s; this repeats the ones that would mis-compose)."""
    if concurrency is not None:
        if batch != 1:
            raise ConfigError(f"replay.batch={batch} and replay.concurrency={concurrency}: choose one")
        if concurrency < 1:
            raise ConfigError(f"replay.concurrency={concurrency} must be >= 1 (slots) or null")
        return compose(trace, continuous_schedule(trace, int(concurrency), arrival_rate, seed))
    if batch < 1:
        raise ConfigError(f"replay.batch={batch} must be >= 1")
    if arrival_rate is not None:
        raise ConfigError(f"replay.arrival_rate={arrival_rate} needs replay.concurrency (arrivals are "
                          f"continuous batching's)")
    return compose(trace, static_schedule(trace, int(batch)))


def requests_in(trace: Trace) -> int:
    """Requests of a trace as recorded, for the results of an uncomposed replay (a leading run of decode
    passes, which composition refuses, counts as one)."""
    kinds = np.asarray(trace.passes[:, 0])
    return int((kinds == 0).sum()) + int(len(kinds) > 0 and kinds[0] != 0)
