"""Layer streaming (hardware.stream_layers; docs/semantics.md "Layer streaming"): hand-worked counts and
clock, the threshold's rounding and errors, and offload == simulated with streamed layers."""

import numpy as np
import pytest
import torch

from tests.conftest import at_equal_threads, sample_ids, tiny
from specmd.compose import spec_of
from specmd.engine import Geometry
from specmd.engine.engine import stream_at
from specmd.engine.store import StoreSizes
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.executor import EXECUTION
from specmd.hook import install
from specmd.models.adapters import adapter_for
from specmd.replay.driver import run_replay
from specmd.replay.trace import Trace, TraceMeta, full_calls

MS = 1e-3


def _trace():
    """Three MoE layers of 4 experts of 100 bytes, top-2.
    pass 0, prefill, 3 tokens: layer 0 {0,1,2}; layer 1 {0,1}; layer 2 {0,1}
    pass 1, decode, 1 token:   {0,1} at every layer
    pass 2, prefill, 3 tokens: layer 0 {0,1,2}; layer 1 {0,1,2,3}; layer 2 {0,1,2}"""
    passes = np.array([[0, 3, 3], [1, 1, 4], [0, 3, 3]], dtype=np.int64)
    rows = [[0, 1], [1, 2], [0, 2],  [0, 1], [0, 1], [1, 0],  [0, 1], [0, 1], [0, 1],
            [0, 1], [0, 1], [0, 1],
            [0, 1], [1, 2], [0, 2],  [0, 1], [2, 3], [0, 1],  [0, 1], [1, 2], [0, 1]]
    geom = Geometry(num_layers=3, num_experts=4, top_k=2, expert_bytes=100, total_bytes=1000)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="none", source={"format": "test"})
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, 3), index=np.asarray(rows, dtype=np.uint8))


def _hw(stream, **kw):
    """A global pool of two experts; a 100-byte expert crosses the link in 1 ms; each expert a layer runs
    costs 1 ms of compute, everything else ~0 (the clock's arithmetic is then worked by hand)."""
    return HardwareConfig(capacity=0.2, stream_layers=stream, bandwidth_gbps=1e-4, latency_us=0.0,
                          peak_tflops=1e12, mem_bandwidth_gbps=1e12, expert_overhead_us=1000.0, **kw)


def test_a_streamed_pass_by_hand():
    """stream_layers=0.75: a call of >= 3 of the 4 experts streams.
    pass 0: layer 0 streams (3 misses moved now, 300 B) and stages layer 1 (all 4 it lacks, 400 B ahead);
            layer 1 is staged, so streamed (2 misses from the stage), but requests 2 < 3: layer 2 is not
            staged; layer 2 fetches into the cache (2 misses, 200 B demand).
    pass 1: LRU on a 2-expert pool, nothing streams: layer 0 evicts layer 2's two, layer 1 layer 0's, layer 2
            layer 1's -- and those two were evicted earlier in the pass: collision misses.
    pass 2: layer 0 streams (300 B) and stages layer 1 (400 B); layer 1 requests all 4, so it stages layer 2:
            only the 2 experts the cache lacks (200 B); layer 2 streams: 2 hits (resident), 1 from the stage.
            Nothing is inserted or evicted by a streamed call."""
    eng = run_replay(_trace(), spec_of(prefetch="none", hardware=_hw(0.75)))
    st = eng.cache.stats
    assert list(st.layer_streams) == [2, 2, 1]
    assert list(st.stream_served) == [6, 6, 1]
    assert list(st.bytes_stream) == [600, 800, 200]
    assert list(st.bytes_demand) == [200, 200, 400]
    assert list(st.requests) == [3 + 2 + 3, 2 + 2 + 4, 2 + 2 + 3]
    assert list(st.hits) == [0, 0, 2]
    assert list(st.misses) == [8, 8, 5]
    assert list(st.evictions) == [2, 2, 2]
    assert list(st.collision_misses) == [0, 0, 2]
    assert list(st.streamed) == [0, 0, 0]
    assert sorted(eng.cache.entries) == [2 * 4 + 0, 2 * 4 + 1]  # layer 2's two, from pass 1
    eng.cache.check_invariants()
    res = eng.results()["cache"]
    assert res["layer_streams"] == 5 and res["bytes_stream"] == 1600
    # every byte that crossed the link, per counted token: 1600 streamed + 800 demand over 7 tokens
    assert res["union"]["bytes_per_token"] == pytest.approx(2400 / 7)


def test_the_stage_ahead_overlaps_the_layer_before():
    """Pass 0's clock by hand (1 ms per expert moved, 1 ms per expert run).
    Streamed: layer 0 waits 3 ms for its 3 experts, the stage of layer 1's 4 starts then (ready at 7 ms)
    while layer 0 computes 3 ms (to 6 ms): layer 1 waits 1 ms, runs 2 ms (9 ms); layer 2 fetches 2 (11 ms)
    and runs 2: 13 ms, 6 ms of them stalled.
    Not streamed: 3 + 3, 2 + 2, 2 + 2 = 14 ms, 7 ms stalled: the stage hid 3 of layer 1's 4 ms of bytes
    behind layer 0's compute (and moved 2 bytes' worth more than layer 1 needed: the price of not knowing
    its routing yet)."""
    on = run_replay(_trace(), spec_of(prefetch="none", hardware=_hw(0.75))).cache.stats.passes[0]
    off = run_replay(_trace(), spec_of(prefetch="none", hardware=_hw(None))).cache.stats.passes[0]
    assert on.time_s == pytest.approx(13 * MS, rel=1e-9) and on.stall_s == pytest.approx(6 * MS, rel=1e-9)
    assert off.time_s == pytest.approx(14 * MS, rel=1e-9) and off.stall_s == pytest.approx(7 * MS, rel=1e-9)


def test_only_calls_at_the_threshold_stream():
    """stream_layers=1.0: only pass 2's layer 1 requests all 4 experts. Pass 2's layer 0 is not streamed
    now: it fetches its 3 into the 2-expert pool (evicting layer 2's two; the third runs streamed the old
    way, one expert without a slot, as in pass 0). Layer 1 streams its 4 and stages layer 2 -- all 4, the cache holds none
    of them now -- whose 3 requests all come from the stage. Off, nothing streams and no byte is staged."""
    st = run_replay(_trace(), spec_of(prefetch="none", hardware=_hw(1.0))).cache.stats
    assert list(st.layer_streams) == [0, 1, 1] and list(st.stream_served) == [0, 4, 3]
    assert list(st.bytes_stream) == [0, 400, 400] and list(st.streamed) == [2, 0, 0]
    assert list(st.hits) == [0, 0, 0]
    off = run_replay(_trace(), spec_of(prefetch="none", hardware=_hw(None))).results()["cache"]
    assert off["layer_streams"] == off["stream_served"] == off["bytes_stream"] == 0


def test_a_staged_call_whose_requests_are_all_cached_does_not_wait_for_the_stage():
    """Two layers of 8 experts, a pool of 4 (1 ms per expert moved or run), stream_layers=0.5 (4 experts).
    Pass 0 (decode, 1 token) fetches {0, 1} at both layers. Pass 1, a prefill of 4 tokens: layer 0 requests
    {0..3} and streams (2 hits, 2 misses moved now: 2 ms stalled) and stages layer 1's 6 lacking experts (6 ms
    on the link, from 2 ms: ready at 8 ms, while layer 0 computes until 6 ms); layer 1 then requests {0, 1},
    both cached: its call is streamed (staged) but misses nothing, so it never waits for the stage. The pass:
    2 ms stalled + 4 + 2 ms of compute = 8 ms (waiting for the stage would make it 10)."""
    passes = np.array([[1, 1, 1], [0, 4, 4]], dtype=np.int64)
    rows = [[0, 1], [0, 1],
            [0, 1], [2, 3], [0, 1], [2, 3],  [0, 1], [1, 0], [0, 1], [1, 0]]
    geom = Geometry(num_layers=2, num_experts=8, top_k=2, expert_bytes=100, total_bytes=1000)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="none", source={"format": "test"})
    trace = Trace(meta=meta, passes=passes, calls=full_calls(passes, 2), index=np.asarray(rows, dtype=np.uint8))
    hw = HardwareConfig(capacity=0.4, stream_layers=0.5, bandwidth_gbps=1e-4, latency_us=0.0,
                        peak_tflops=1e12, mem_bandwidth_gbps=1e12, expert_overhead_us=1000.0)
    st = run_replay(trace, spec_of(prefetch="none", hardware=hw)).cache.stats
    assert list(st.layer_streams) == [1, 1] and list(st.stream_served) == [2, 0] and list(st.hits) == [2, 2]
    assert list(st.bytes_stream) == [200, 600]
    p = st.passes[1]
    assert p.stall_s == pytest.approx(2 * MS, rel=1e-9)  # layer 0's misses only: layer 1 never waits
    assert p.time_s == pytest.approx((2 + 4 + 2) * MS, rel=1e-9)


def test_threshold_as_a_count():
    assert stream_at(None, 64) == 0
    assert stream_at(0.5, 64) == 32 and stream_at(0.3, 10) == 3 and stream_at(0.31, 10) == 4
    assert stream_at(1e-9, 64) == 1 and stream_at(1.0, 60) == 60


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), float("inf"), True, "half"])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ConfigError, match="stream_layers"):
        HardwareConfig(stream_layers=bad)


def _live_spec(execution, miss, stream=0.25):
    spec = spec_of(miss=miss, prefetch="topk", hardware=HardwareConfig(capacity=0.1, stream_layers=stream))
    spec.execution = EXECUTION.params(at_equal_threads({"name": execution, "check": True} if execution == "offload"
                                                       else {"name": execution}))
    return spec


@pytest.mark.parametrize("family,miss", [("olmoe", "fetch"), ("mixtral", "drop"), ("qwen2_moe", "fetch")])
def test_offload_equals_simulated_with_streamed_layers(family, miss):
    """The prefill's calls stream (a quarter of a tiny layer's experts); the offload executor stages the
    streamed experts per call (its stream banks) and gives the simulated run's logits bit for bit and its
    every counter; a lossless stack stays equal to the unhooked model."""
    model = tiny(family)
    ids = sample_ids(2, 12, seed=3)
    out = {}
    with torch.no_grad():
        ref = model(ids).logits
        for execution in ("simulated", "offload"):
            stack = install(model, _live_spec(execution, miss), adapter_for(family))
            try:
                first = model(ids, use_cache=True)
                nxt = first.logits[:, -1].argmax(-1, keepdim=True)
                second = model(nxt, past_key_values=first.past_key_values)
                out[execution] = (first.logits, second.logits, stack.engine.results())
            finally:
                stack.remove()
    sim, off = out["simulated"], out["offload"]
    assert sim[2]["cache"]["layer_streams"] > 0 and sim[2]["cache"]["stream_served"] > 0
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1])
    assert off[2] == sim[2]
    if miss == "fetch":
        assert torch.equal(sim[0], ref)


def test_a_recorded_streamed_run_replays_exactly(tmp_path):
    """A live batched run with streamed layers, recorded, replays to the same cache, timing and routing
    sections: the stream is the engine's decision, whichever driver feeds it."""
    from specmd.replay.trace import TraceWriter, read_trace

    model = tiny("olmoe")
    spec = _live_spec("simulated", "fetch")
    stack = install(model, spec)
    stack.writer = TraceWriter(tmp_path / "trace", stack.geom, stack.scoring, stack.store, 1)
    with torch.no_grad(), stack:
        model.generate(sample_ids(3, 10, seed=5), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    stack.writer.close()
    want = stack.engine.results()
    assert want["cache"]["layer_streams"] > 0
    got = run_replay(read_trace(tmp_path / "trace"), spec).results()
    assert got["cache"] == want["cache"] and got["timing"] == want["timing"] and got["routing"] == want["routing"]
