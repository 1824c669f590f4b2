"""Batched and continuous-batching replay composed from batch-1 traces (specmd/replay/batching.py,
docs/replay.md "Batched and continuous-batching replay"): the composed passes, calls and rows exactly, on a
hand-made trace; unions; the schedules; seeded arrivals; B=1 is the trace as recorded; full replays with
Belady and LRU; the config's checks."""

import json
import math

import numpy as np
import pytest

from specmd.compose import spec_of
from specmd.engine import Geometry
from specmd.engine.store import StoreSizes
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.replay.batching import (INEXACT, batched_context, batched_contexts, compose_trace,
                                    continuous_schedule, request_bounds, static_schedule)
from specmd.replay.config import ReplayConfig, open_trace
from specmd.replay.driver import exactness, requested_per_call, run_replay
from specmd.replay.trace import Trace, TraceMeta, full_calls

L, E, K = 2, 4, 2
# Three requests (r0: a 2-token prompt + 2 decodes; r1: 3 + 1; r2: 1 + 3), passes [kind, tokens, context]
PASSES = [[0, 2, 2], [1, 1, 3], [1, 1, 4],   # r0: passes 0-2
          [0, 3, 3], [1, 1, 4],              # r1: passes 3-4
          [0, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 4]]  # r2: passes 5-8
# the router's top-2 per row, per (pass, layer); rows of pass p, layer l are consecutive (full_calls' layout):
# pass 0: rows 0-1 (L0), 2-3 (L1); pass 1: 4, 5; pass 2: 6, 7; pass 3: 8-10, 11-13; pass 4: 14, 15;
# pass 5: 16, 17; pass 6: 18, 19; pass 7: 20, 21; pass 8: 22, 23
ROUTES = {
    (0, 0): [[0, 1], [1, 2]], (0, 1): [[2, 3], [3, 0]],
    (1, 0): [[0, 1]], (1, 1): [[2, 3]],
    (2, 0): [[0, 2]], (2, 1): [[1, 3]],
    (3, 0): [[2, 3], [3, 0], [2, 0]], (3, 1): [[0, 1], [0, 2], [1, 2]],
    (4, 0): [[1, 0]], (4, 1): [[3, 2]],
    (5, 0): [[1, 3]], (5, 1): [[2, 0]],
    (6, 0): [[1, 0]], (6, 1): [[3, 2]],
    (7, 0): [[0, 3]], (7, 1): [[1, 0]],
    (8, 0): [[2, 1]], (8, 1): [[0, 3]],
}


def meta(logits="fp32"):
    geom = Geometry(num_layers=L, num_experts=E, top_k=K, expert_bytes=100, total_bytes=100 * E * L, layer_ids=[0, 1])
    return TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits=logits, source={"format": "test"})


def with_rows(passes, calls, index) -> Trace:
    """A trace whose row arrays encode the row number (to follow the permutation): weights [r, -r], logits
    r + expert, the prefetch signal's top-k (r % E, (r + 1) % E) and logits -r - expert."""
    R = len(index)
    r = np.arange(R, dtype=np.float32)
    return Trace(meta=meta(), passes=np.asarray(passes, dtype=np.int64), calls=np.asarray(calls, dtype=np.int64),
                 index=np.asarray(index, dtype=np.uint8),
                 weights=np.stack([r, -r], 1).astype(np.float16),
                 logits=(r[:, None] + np.arange(E, dtype=np.float32)).astype(np.float32),
                 signal_index=np.stack([np.arange(R) % E, (np.arange(R) + 1) % E], 1)[:, None, :].astype(np.uint8),
                 signal_logits=(-r[:, None] - np.arange(E, dtype=np.float32))[:, None, :].astype(np.float32),
                 path="hand")


def hand_trace(drop=()) -> Trace:
    """The trace above; ``drop``: (pass, layer) calls an import lacked (rows re-packed consecutively)."""
    calls, index = [], []
    for p, (_, tokens, _) in enumerate(PASSES):
        for layer in range(L):
            if (p, layer) in drop:
                continue
            rows = ROUTES[(p, layer)]
            assert len(rows) == tokens
            calls.append([p, layer, len(index), tokens])
            index += rows
    return with_rows(PASSES, calls, index)


def unions(trace) -> list:
    """(pass, layer, sorted distinct experts) of each call, from the driver's own request table."""
    ptr, ex = requested_per_call(trace, E)
    return [(int(p), int(layer), ex[ptr[c]:ptr[c + 1]].tolist()) for c, (p, layer, _, _) in enumerate(trace.calls)]


# ---- requests and the static batch --------------------------------------------------------------------------
def test_requests_are_a_prefill_and_the_decodes_after_it():
    assert request_bounds(hand_trace()).tolist() == [0, 3, 5, 9]


def test_static_batch_of_two_hand_worked():
    """Groups {r0, r1}, {r2}. Step 0: both prompts (5 tokens, context round((2*2 + 3*3) / 5) = 3); step 1: both
    first decodes (context (3 + 4) / 2 = 3.5 -> 4, halves up); step 2: r0's second decode alone (r1 finished:
    absent, not padded); steps 3-6: r2 alone, exactly its own passes."""
    c = compose_trace(hand_trace(), batch=2)
    assert c.passes.tolist() == [[0, 5, 3], [1, 2, 4], [1, 1, 4], [0, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 4]]
    assert c.calls.tolist() == [[0, 0, 0, 5], [0, 1, 5, 5], [1, 0, 10, 2], [1, 1, 12, 2], [2, 0, 14, 1],
                                [2, 1, 15, 1], [3, 0, 16, 1], [3, 1, 17, 1], [4, 0, 18, 1], [4, 1, 19, 1],
                                [5, 0, 20, 1], [5, 1, 21, 1], [6, 0, 22, 1], [6, 1, 23, 1]]
    # each call's rows are its members' rows of that layer, members in trace order (r0's, then r1's)
    perm = [0, 1, 8, 9, 10, 2, 3, 11, 12, 13, 4, 14, 5, 15, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23]
    t = hand_trace()
    assert c.weights[:, 0].astype(int).tolist() == perm  # weights encode the row number
    for name in ("index", "weights", "logits", "signal_index", "signal_logits"):
        assert np.array_equal(getattr(c, name), getattr(t, name)[perm]), name
    assert c.index[0:5].tolist() == [[0, 1], [1, 2], [2, 3], [3, 0], [2, 0]]
    assert unions(c)[:6] == [(0, 0, [0, 1, 2, 3]), (0, 1, [0, 1, 2, 3]), (1, 0, [0, 1]), (1, 1, [2, 3]),
                             (2, 0, [0, 2]), (2, 1, [1, 3])]
    assert c.batching == {"mode": "static", "batch": 2, "concurrency": None, "arrival_rate": None,
                          "requests": 3, "steps": 7, "passes": 9}
    assert static_schedule(t, 2).members() == [[0, 1], [0, 1], [0], [2], [2], [2], [2]]


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_a_steps_requests_are_the_union_of_its_members_experts(batch):
    """Each composed call requests exactly the set union of its members' experts at that layer."""
    t = hand_trace()
    sched = static_schedule(t, batch)
    c = compose_trace(t, batch=batch)
    own = {(p, layer): set(ex) for p, layer, ex in unions(t)}
    want = []
    for s, members in enumerate(sched.members()):
        step_passes = [p for p in range(len(PASSES)) if sched.step[p] == s]
        assert len(step_passes) == len(members)
        for layer in range(L):
            want.append((s, layer, sorted(set().union(*(own[(p, layer)] for p in step_passes)))))
    assert unions(c) == want


def test_the_finished_member_is_absent():
    """At batch 3 r1 (one decode) is gone from step 2 and r0 (two) from step 3: each step holds the rows of
    the members that still decode, nothing else."""
    c = compose_trace(hand_trace(), batch=3)
    # contexts: 14 / 6 -> 2; (3 + 4 + 2) / 3 = 3; (4 + 3) / 2 -> 4 (halves up); r2's own 4
    assert c.passes.tolist() == [[0, 6, 2], [1, 3, 3], [1, 2, 4], [1, 1, 4]]
    assert [n for _, layer, _, n in c.calls.tolist() if layer == 0] == [6, 3, 2, 1]
    # step 2: r0's second decode (rows 6, 7) and r2's second (rows 20, 21); step 3: r2's third (22, 23)
    assert c.weights[:, 0].astype(int).tolist()[-6:] == [6, 20, 7, 21, 22, 23]


def test_a_layer_a_member_lacks_gets_no_rows_from_it_and_no_empty_call():
    """An import lacking (pass 3, layer 1) and (pass 2, layer 1): step 0's layer-1 call holds r0's rows only;
    step 2 (r0's second decode alone) has no layer-1 call at all; an input call of zero rows is dropped."""
    t = hand_trace(drop={(3, 1), (2, 1)})
    calls = t.calls.tolist()
    at = calls.index([2, 0, 6, 1])
    calls.insert(at + 1, [2, 1, 7, 0])  # pass 2 at layer 1: a call of zero rows
    t = with_rows(t.passes, calls, t.index)
    c = compose_trace(t, batch=2)
    assert c.calls[:6, [0, 1, 3]].tolist() == [[0, 0, 5], [0, 1, 2], [1, 0, 2], [1, 1, 2], [2, 0, 1], [3, 0, 1]]
    assert (c.calls[:, 3] > 0).all()
    assert unions(c)[1] == (0, 1, [0, 2, 3])
    assert c.passes[0].tolist() == [0, 5, 3]  # the pass's tokens are its members' whatever calls they lack


def test_a_trace_starting_with_a_decode_is_refused_naming_it():
    t = hand_trace()
    bad = with_rows(t.passes[1:], [[p - 1, layer, r0 - 4, n] for p, layer, r0, n in t.calls.tolist() if p > 0],
                    t.index[4:])
    bad.path = "cut.trace"
    with pytest.raises(ConfigError, match=r"cut.trace: pass 0 is a decode pass .*passes 0\.\.1 precede"):
        compose_trace(bad, batch=2)
    with pytest.raises(ConfigError, match="cut.trace: pass 0 is a decode"):
        compose_trace(bad, concurrency=2)


# ---- continuous batching -----------------------------------------------------------------------------------
def test_continuous_two_slots_hand_worked():
    """Step 0 admits r0 and r1 (both slots); step 1 decodes both, r1 leaves; step 2 admits r2 (a waiting request
    and a free slot: a prefill step, no decode); step 3 decodes r0's second and r2's first; r0 leaves; r2
    decodes alone."""
    t = hand_trace()
    sched = continuous_schedule(t, 2)
    assert sched.members() == [[0, 1], [0, 1], [2], [0, 2], [2], [2]]
    c = compose_trace(t, concurrency=2)
    assert c.passes.tolist() == [[0, 5, 3], [1, 2, 4], [0, 1, 1], [1, 2, 3], [1, 1, 3], [1, 1, 4]]
    assert c.weights[:, 0].astype(int).tolist() == [0, 1, 8, 9, 10, 2, 3, 11, 12, 13, 4, 14, 5, 15, 16, 17,
                                                    6, 18, 7, 19, 20, 21, 22, 23]
    assert continuous_schedule(t, 3).members() == [[0, 1, 2], [0, 1, 2], [0, 2], [2]]
    assert c.batching["mode"] == "continuous" and c.batching["concurrency"] == 2 and c.batching["steps"] == 6


def test_a_request_without_decodes_leaves_after_its_prefill():
    """r1 as a loglikelihood window (its decode removed): at two slots it leaves after step 0, so r2 is
    admitted in step 1 while r0 waits for its first decode."""
    t = hand_trace()
    keep = [p for p in range(len(PASSES)) if p != 4]
    calls = [[keep.index(p), layer, 0, n] for p, layer, _, n in t.calls.tolist() if p != 4]
    rows = [r for p, _, r0, n in t.calls.tolist() if p != 4 for r in range(r0, r0 + n)]
    for i in range(1, len(calls)):
        calls[i][2] = calls[i - 1][2] + calls[i - 1][3]
    w = with_rows(t.passes[keep], calls, t.index[rows])
    assert continuous_schedule(w, 2).members() == [[0, 1], [2], [0, 2], [0, 2], [2]]


def test_one_slot_and_batch_one_are_the_trace_as_recorded():
    t = hand_trace()
    for c in (compose_trace(t, batch=1), compose_trace(t, concurrency=1)):
        for name in ("passes", "calls", "index", "weights", "logits", "signal_index", "signal_logits"):
            assert np.array_equal(getattr(c, name), getattr(t, name)), name
        assert c.batching["steps"] == c.batching["passes"] == 9
        assert INEXACT not in exactness(c, spec_of(prefetch="none"))


def test_arrivals_are_seeded_and_idle_time_emits_no_pass():
    t = hand_trace()
    # explicit arrivals: r0 at step 0, r1 and r2 at step 10: r0 runs alone (prefill, two decodes), nothing runs
    # at steps 3..9 (no pass), then r1 and r2 are admitted together
    sched = continuous_schedule(t, 2, arrival=np.array([0, 10, 10]))
    assert sched.members() == [[0], [0], [0], [1, 2], [1, 2], [2], [2]]
    # r1 arrives while r0 decodes with a slot free: it is admitted at once (a prefill step between r0's decodes)
    assert continuous_schedule(t, 2, arrival=np.array([0, 2, 30])).members() == [[0], [0], [1], [0, 1], [2], [2],
                                                                                   [2], [2]]
    a = continuous_schedule(t, 2, arrival_rate=0.3, seed=0)
    b = continuous_schedule(t, 2, arrival_rate=0.3, seed=0)
    assert np.array_equal(a.arrival, b.arrival) and a.members() == b.members()
    assert np.array_equal(compose_trace(t, concurrency=2, arrival_rate=0.3).index,
                          compose_trace(t, concurrency=2, arrival_rate=0.3, seed=0).index)
    draws = {tuple(continuous_schedule(t, 2, arrival_rate=0.3, seed=s).arrival) for s in range(4)}
    assert len(draws) == 4  # different seeds, different arrivals
    # many requests: different seeds give different schedules; every pass has a member
    many = compose_trace(tiled(40), concurrency=4, arrival_rate=0.5, seed=1)
    other = compose_trace(tiled(40), concurrency=4, arrival_rate=0.5, seed=2)
    assert not np.array_equal(many.passes, other.passes)
    assert (many.passes[:, 1] > 0).all()
    assert many.batching["arrival_rate"] == 0.5 and many.batching["requests"] == 120


def tiled(times: int) -> Trace:
    """The hand trace's three requests repeated ``times`` times (rows shifted; experts rotated per copy)."""
    t = hand_trace()
    P, R = len(t.passes), len(t.index)
    passes = np.tile(t.passes, (times, 1))
    calls = np.concatenate([t.calls + [i * P, 0, i * R, 0] for i in range(times)])
    index = np.concatenate([(t.index + i) % E for i in range(times)])
    return with_rows(passes, calls, index)


def test_batched_contexts_is_the_shared_rule():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, 60)
    contexts = rng.integers(1, 3000, 60)
    starts = np.array([0, 1, 5, 6, 20, 33, 34, 59])
    got = batched_contexts(tokens, contexts, starts)
    ends = np.append(starts[1:], 60)
    assert got.tolist() == [batched_context(tokens[a:b].tolist(), contexts[a:b].tolist()) for a, b in zip(starts, ends)]
    assert batched_contexts([0, 0], [5, 7], np.array([0])).tolist() == [0]  # no live token
    assert batched_context([1, 1], [3, 4]) == 4 and batched_context([3], [17]) == 17  # halves up; one member: its own


# ---- replays of composed traces -----------------------------------------------------------------------------
def replay(trace, eviction, slots=3):
    spec = spec_of(eviction=eviction, prefetch="none",
                   hardware=HardwareConfig(experts_per_layer=slots, scope="global", bandwidth_gbps=1e3))
    return run_replay(trace, spec).results()


def test_batch_one_replays_identically():
    t = hand_trace()
    for ev in ("lru", "belady"):
        assert replay(compose_trace(t, batch=1), ev) == replay(t, ev)


@pytest.mark.parametrize("how", [dict(batch=2), dict(batch=32), dict(concurrency=2), dict(concurrency=8),
                                 dict(concurrency=4, arrival_rate=0.5)])
def test_composed_traces_replay_with_belady_and_lru(how):
    t = tiled(12)
    c = compose_trace(t, **how)
    ptr, _ = requested_per_call(c, E)
    lru, opt = replay(c, "lru"), replay(c, "belady")
    for res in (lru, opt):
        assert res["cache"]["requests"] == int(ptr[-1])  # one request per distinct expert per composed call
    assert opt["cache"]["hits"] >= lru["cache"]["hits"]  # the oracle reads the composed future
    assert len(c.passes) < len(t.passes) and INEXACT in exactness(c, spec_of(prefetch="none"))


# ---- the config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(batch=0), ["replay.batch=0", "whole numbers in 1..2147483648"]),
    (dict(batch=-3), ["replay.batch=-3", "1..2147483648"]),
    (dict(batch=2**63), [f"replay.batch={2**63}", "1..2147483648"]),  # (overflowed numpy's arange in the replay)
    (dict(concurrency=0), ["replay.concurrency=0", "null", ">= 1"]),
    (dict(concurrency=2**31 + 1), [f"replay.concurrency={2**31 + 1}", "1..2147483648"]),
    (dict(batch=4, concurrency=2), ["replay.batch=4 and replay.concurrency=2", "not both"]),
    (dict(concurrency=2, arrival_rate=0.0), ["replay.arrival_rate=0.0", "finite number >= 1e-09", "null"]),
    (dict(concurrency=2, arrival_rate=-1.0), ["replay.arrival_rate=-1.0", ">= 1e-09"]),
    # (issue 57: 1e-300 overflowed the arrival steps to int64's minimum; -1 reached numpy in the replay stage)
    (dict(concurrency=2, arrival_rate=1e-300), ["replay.arrival_rate=1e-300", ">= 1e-09"]),
    (dict(concurrency=2, seed=-1), ["replay.seed=-1", "whole numbers in 0..4294967295"]),
    (dict(concurrency=2, seed=2**32), [f"replay.seed={2**32}", "0..4294967295"]),  # (eval.seed's range)
    (dict(concurrency=2, arrival_rate=math.nan), ["replay.arrival_rate=nan", "finite"]),
    (dict(concurrency=2, arrival_rate=math.inf), ["replay.arrival_rate=inf", "finite"]),
    (dict(arrival_rate=1.0), ["replay.arrival_rate=1.0 needs replay.concurrency"]),
    (dict(trace=None, batch=4), ["replay.batch=4", "replay.trace is null", "eval.batch_size"]),
])
def test_bad_batching_settings_are_config_errors_naming_the_value(kw, words):
    with pytest.raises(ConfigError) as e:
        ReplayConfig(**{"trace": "t", **kw})
    for w in words:
        assert w in str(e.value)


def test_bad_batching_settings_from_the_command_line():
    from tests.system.test_configs import compose_run

    for args, words in ((["replay.trace=x", "replay.batch=0"], "replay.batch=0"),
                        (["replay.trace=x", "replay.concurrency=2", "replay.arrival_rate=nan"], "arrival_rate=nan"),
                        (["replay.trace=x", "replay.batch=2", "replay.concurrency=2"], "not both"),
                        (["replay.trace=x", "replay.concurrency=2", "replay.seed=-1"], "replay.seed=-1")):
        with pytest.raises(ConfigError, match=words):
            compose_run(args)


def write_trace(t: Trace, d) -> None:
    """``t`` as a specmd trace directory (what TraceWriter writes)."""
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps(t.meta.to_dict()))
    t.passes.astype(np.int64).tofile(d / "passes.bin")
    t.index.tofile(d / "index.bin")
    t.weights.tofile(d / "weights.bin")
    t.logits.tofile(d / "logits.bin")


def test_open_trace_composes_and_refuses_a_trace_recorded_in_batches(tmp_path):
    """The batch a trace was recorded at comes from its own meta.json (a stopped run's trace has no results.json
    beside it: issue 57), from its run's results.json for an older trace, and a trace that says neither is
    refused by name, never composed as if its passes were single requests."""
    t = hand_trace()
    t.meta.source = {"exact": True, "batch_size": 1}
    write_trace(dataclass_copy(t), tmp_path / "run" / "trace")
    path = str(tmp_path / "run" / "trace")
    c = open_trace(ReplayConfig(trace=path, batch=2))
    assert c.passes.tolist() == compose_trace(t, batch=2).passes.tolist() and c.path == path
    assert open_trace(ReplayConfig(trace=path)).batching is None
    t.meta.source = {"exact": True, "batch_size": 2}  # a stopped run recorded at eval.batch_size=2: no results.json
    write_trace(dataclass_copy(t), tmp_path / "stopped" / "trace")
    with pytest.raises(ConfigError, match="recorded at eval.batch_size=2.*eval.batch_size=1"):
        open_trace(ReplayConfig(trace=str(tmp_path / "stopped" / "trace"), batch=2))
    t.meta.source = {"exact": True}  # an older trace: its run's results.json says, or nothing does
    write_trace(dataclass_copy(t), tmp_path / "old" / "trace")
    path = str(tmp_path / "old" / "trace")
    with pytest.raises(ConfigError, match="does not say which eval.batch_size it was recorded at"):
        open_trace(ReplayConfig(trace=path, batch=2))
    (tmp_path / "old" / "results.json").write_text(json.dumps({"config": {"eval": {"batch_size": 4}}}))
    with pytest.raises(ConfigError, match="recorded at eval.batch_size=4.*eval.batch_size=1"):
        open_trace(ReplayConfig(trace=path, concurrency=2))
    assert open_trace(ReplayConfig(trace=path)).batching is None  # as recorded: fine
    (tmp_path / "old" / "results.json").write_text(json.dumps({"config": {"eval": {"batch_size": 1}}}))
    assert open_trace(ReplayConfig(trace=path, batch=2)).batching["batch"] == 2


def dataclass_copy(t: Trace) -> Trace:
    import dataclasses

    return dataclasses.replace(t, signal_index=None, signal_logits=None)


def test_a_replay_run_reports_its_batching(tmp_path):
    """``python -m specmd replay.trace=... replay.batch=2``'s results: the batching section and the reason."""
    from tests.system.test_configs import compose_run

    from specmd.replay.driver import replay as replay_run

    f = tmp_path / "routes.jsonl"
    with open(f, "w") as out:
        for seq, n in enumerate((3, 2, 4)):
            for tok in range(n):
                for layer in range(L):
                    out.write(json.dumps({"seq": seq, "token": tok, "layer": layer,
                                          "experts": [(seq + tok + layer) % E, (seq + tok + layer + 1 + tok % 3) % E]}) + "\n")
    base = [f"replay.trace={f}", "replay.format=jsonl", "replay.num_experts=4", "prefetch=none",
            "hardware.experts_per_layer=2"]
    res, _ = replay_run(compose_run([*base, "replay.batch=2"]), tmp_path)
    assert res["replay"]["batching"] == {"mode": "static", "batch": 2, "concurrency": None, "arrival_rate": None,
                                         "requests": 3, "steps": 7}  # max(3, 2) + 4 passes
    assert res["replay"]["passes"] == 7 and not res["replay"]["exact"] and INEXACT in res["replay"]["inexact_because"]
    res, _ = replay_run(compose_run([*base, "replay.concurrency=2", "replay.arrival_rate=0.5", "replay.seed=3"]),
                        tmp_path)
    b = res["replay"]["batching"]
    assert (b["mode"], b["concurrency"], b["arrival_rate"], b["requests"]) == ("continuous", 2, 0.5, 3)
    res, _ = replay_run(compose_run(base), tmp_path)
    assert res["replay"]["batching"] == {"mode": None, "batch": 1, "concurrency": None, "arrival_rate": None,
                                         "requests": 3, "steps": 9}
    assert INEXACT not in res["replay"]["inexact_because"]


def test_a_composed_recording_is_recorded_at_batch_one():
    from specmd.recorder import recording_config

    raw = {"eval": {"batch_size": 8, "tasks": ["gsm8k"]}, "trace": {}, "model": {"name": "tiny"}}
    assert recording_config({**raw, "replay": {"trace": "record", "batch": 4}})["eval"]["batch_size"] == 1
    assert recording_config({**raw, "replay": {"trace": "record", "concurrency": 4}})["eval"]["batch_size"] == 1
    assert recording_config({**raw, "replay": {"trace": "record"}})["eval"]["batch_size"] == 8
