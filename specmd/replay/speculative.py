"""Speculative decoding replayed from a batch-1 trace (docs/replay.md "Speculative decoding").

A speculating server drafts ``K`` tokens (a draft model, an MTP head, prompt lookup) and runs one **verify
step**: the sequence's current token and its ``K`` drafts, ``K + 1`` tokens, through every layer at once -- one
MoE layer call of ``K + 1`` tokens, whose requests are the union of their experts, exactly as a batch of ``K + 1``
sequences would request (DESIGN.md, "verify step"). The target model keeps the drafts up to the first it
rejects and adds one token of its own, so a step advances the sequence by ``A + 1`` tokens for ``A`` accepted
drafts.

The replay composes those steps from a trace's requests (a prefill pass, then one-token decode passes): the
verify step at decode position ``t`` is the ``m = min(K + 1, left)`` recorded tokens ``t .. t + m - 1``; ``A``
is drawn as the leading run of independent acceptances of probability ``replay.acceptance`` (the standard
model, Leviathan et al. 2023, §3.1: "each ... accepted with probability alpha", i.i.d.), at most ``m - 1``;
the next step starts at ``t + A + 1``. Rejected drafts are routed as the tokens the model then produced
there -- the one approximation (a rejected draft is another token; its experts are unknown), stated in the
run's ``inexact_because``. Positions re-run after a rejection are requested again, as a server re-runs them.

The steps are composed as :mod:`.batching` composes a batch: each step's layer call holds its tokens' rows,
its ``tokens`` is ``m`` and its ``context`` the sequence's through its last draft -- the live hook's record of a
one-sequence pass of several tokens (``past + tokens``), so a live speculative run and its replay agree -- which
is also what its KV cache holds (``hardware.memory_gb``).
The composed trace is a batch-1 trace of verify steps: ``replay.batch`` / ``replay.concurrency`` then batch
those (several sequences speculating at once).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .batching import gather_steps, request_bounds
from .trace import Trace

MAX_TOKENS = 64  # drafts per verify step: EAGLE-3's tree is 60 nodes, Medusa's 64; beyond is a typo
APPROXIMATION = ("speculative verify steps composed from the recorded tokens: a rejected draft is routed as the "
                 "token the model produced in its place (the draft's own experts are not in the trace)")


def accepted_drafts(rng: np.random.Generator, n: int, K: int, acceptance: float) -> np.ndarray:
    """``[n]`` drafts accepted per step: the leading run of successes among ``K`` independent draws of
    probability ``acceptance`` (a geometric count, capped at ``K``)."""
    if acceptance >= 1.0:
        return np.full(n, K, dtype=np.int64)
    if acceptance <= 0.0:
        return np.zeros(n, dtype=np.int64)
    return np.minimum(rng.geometric(1.0 - acceptance, n) - 1, K).astype(np.int64)


def speculate(trace: Trace, K: int, acceptance: float, seed: int = 0) -> Trace:
    """``trace`` (batch 1: one-token decode passes) as verify steps of ``K`` drafts each accepted with
    probability ``acceptance`` (module docstring); the result's ``speculative`` holds the totals the results
    report. ``K = 0`` returns ``trace`` (no speculation)."""
    if K == 0:
        return trace
    if isinstance(trace.meta.source.get("speculative"), dict) and not trace.meta.imported:
        raise ConfigError(f"replay.speculative_tokens={K}: the trace {trace.path} was recorded speculating "
                          f"(eval.speculative={trace.meta.source['speculative'].get('method')}): its decode passes are "
                          f"verify steps already; replay it as recorded (replay.speculative_tokens=0)")
    passes = np.asarray(trace.passes, dtype=np.int64)
    dec = passes[:, 0] == 1
    if (passes[dec, 1] != 1).any():
        p = int(np.flatnonzero(dec & (passes[:, 1] != 1))[0])
        raise ConfigError(f"replay.speculative_tokens={K}: pass {p} of {trace.path} is a decode pass of "
                          f"{int(passes[p, 1])} tokens; verify steps are composed from one sequence's one-token "
                          f"decode passes (a trace recorded at eval.batch_size=1)")
    bounds = request_bounds(trace)
    draws = accepted_drafts(np.random.default_rng(seed), int(dec.sum()) + 1, K, acceptance)
    src, step_of = [], []  # members (source passes) and their composed step
    accepted = verified = steps = 0
    s = d = 0
    for r in range(len(bounds) - 1):
        b0, b1 = int(bounds[r]), int(bounds[r + 1])
        src.append(np.array([b0], dtype=np.int64))  # the prefill, as recorded
        step_of.append(s)
        s += 1
        t = b0 + 1
        while t < b1:
            m = min(K + 1, b1 - t)
            a = min(int(draws[d]), m - 1)
            d += 1
            src.append(np.arange(t, t + m, dtype=np.int64))
            step_of.extend([s] * m)
            s += 1
            steps += 1
            verified += m
            accepted += a + 1
            t += a + 1
    members = np.concatenate(src) if src else np.zeros(0, dtype=np.int64)
    step = np.asarray(step_of, dtype=np.int64)
    out = gather_steps(trace, members, step, s)
    # each step is one sequence through its last token: its context, as the live hook records a one-sequence
    # pass of several tokens (past + tokens), and its KV cache
    first = np.searchsorted(step, np.arange(s))
    kv = (np.maximum.reduceat(passes[members, 2], first) if s else np.zeros(0, dtype=np.int64)).astype(np.int64)
    out.passes[:, 2] = kv
    out.contexts = (np.arange(s + 1, dtype=np.int64), kv)
    out.speculative = {"tokens": int(K), "acceptance": float(acceptance), "seed": int(seed),
                       "verify_steps": steps, "verified_tokens": verified, "accepted_tokens": accepted,
                       "decode_passes": int(dec.sum())}
    out.notes = list(trace.notes)
    return out


def speculative_section(trace: Trace, engine) -> dict:
    """A replay's ``speculative`` section: the composition's totals; a live speculative run's recording (its
    ``meta.json`` says so: its decode passes are its verify steps, replayed as they ran and composable with
    ``replay.batch``, its accepted tokens recorded when it ended); without speculation ``tokens`` 0, every
    decode token accepted, so a sweep's K = 0 row compares. Then :func:`per_accepted_token`."""
    if trace.speculative is not None:
        return per_accepted_token({"method": "replayed", **trace.speculative}, engine)
    dec = [p for p in engine.cache.stats.passes if p.kind == "decode"]
    tokens = sum(p.tokens for p in dec)
    recorded = trace.meta.source.get("speculative") if not trace.meta.imported else None
    if isinstance(recorded, dict):  # a live speculative run's trace: its decode passes are its verify steps
        return per_accepted_token({"method": f"recorded {recorded.get('method')}", "tokens": recorded.get("tokens"),
                                   "acceptance": None, "seed": None, "verify_steps": recorded.get("verify_steps"),
                                   "verified_tokens": tokens, "accepted_tokens": recorded.get("accepted_tokens"),
                                   "decode_passes": None}, engine)
    return per_accepted_token({"method": None, "tokens": 0, "acceptance": None, "seed": None,
                               "verify_steps": None if trace.batching else len(dec), "verified_tokens": tokens,
                               "accepted_tokens": tokens, "decode_passes": None}, engine)


def live_section(engine, tokens: int, accepted: int, method: str = "prompt_lookup") -> dict:
    """A live speculative run's ``speculative`` section (``eval.speculative``: ``method``): every decode pass is a
    verify step (a step that found no draft is one token); ``accepted``: the tokens they produced (each
    generation's output less its prompt and the prefill's token)."""
    dec = [p for p in engine.cache.stats.passes if p.kind == "decode"]
    return per_accepted_token({"method": method, "tokens": int(tokens), "acceptance": None, "seed": None,
                               "verify_steps": len(dec), "verified_tokens": sum(p.tokens for p in dec),
                               "accepted_tokens": int(accepted), "decode_passes": None}, engine)


def per_accepted_token(info: dict, engine) -> dict:
    """``info`` with, per **accepted** token -- the tokens the sequences advanced by, what a user's throughput is
    made of -- the decode passes' expert loads (misses), requests, bytes moved and simulated seconds, beside the
    accepted tokens per verify step and the decode layer calls' union. Over the passes the cache section counts
    (the decode passes' records are kept under ``stack.measure=decode`` too)."""
    dec = [p for p in engine.cache.stats.passes if p.kind == "decode"]
    acc = info["accepted_tokens"]  # (None: not known -- a recorded run that stopped before it ended)
    steps = info["verify_steps"]
    L = engine.geom.num_layers
    return {**info,
            "accepted_per_step": acc / steps if steps and acc is not None else None,
            "verified_per_step": info["verified_tokens"] / steps if steps else None,
            "loads_per_accepted_token": sum(p.misses for p in dec) / acc if acc else None,
            "bytes_per_accepted_token": sum(p.bytes_moved for p in dec) / acc if acc else None,
            "requests_per_accepted_token": sum(p.requests for p in dec) / acc if acc else None,
            "union_per_layer_call": sum(p.requests for p in dec) / (len(dec) * L) if dec else None,
            "decode_seconds_per_accepted_token": sum(p.time_s for p in dec) / acc if acc else None}
