"""Golden values of whole replays of the embedded model's recorded routing (tests/data/embedded_trace,
recorded by tests/data/record_embedded_trace.py): any change to the cache, clock or policy semantics that
moves a number shows here. Re-pin only on purpose, saying why in the commit. The timings are on
``HardwareConfig()``, i.e. the default profile (specmd/conf/hardware/a100_pcie.yaml: 1,935 GB/s HBM) since
the code's defaults are read from it (re-pinned then: the counts did not move, the dense compute did)."""

from pathlib import Path

import pytest

from specmd.compose import spec_of
from specmd.hardware import HardwareConfig
from specmd.replay.driver import exactness, run_replay
from specmd.replay.trace import read_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "embedded_trace"

GOLDEN = {
    "lru, no prefetch, 25% global": (
        dict(eviction="lru", prefetch="none", hardware=HardwareConfig(capacity=0.25)),
        dict(requests=640, hits=94, misses=546, collision_misses=46, evictions=468, prefetch_issued=0,
             prefetch_late=0, prefetch_wasted=0, streamed=0),
        dict(total_s=0.021655762869250385, stall_s=0.021562195199999773, ttft_s=0.007206509362273868,
             tpot_s=0.0009053430180878312)),
    "least_stale, lookahead depth 2, 30% per layer": (
        dict(eviction="least_stale", prefetch={"name": "lookahead", "depth": 2},
             hardware=HardwareConfig(capacity=0.3, scope="per_layer")),
        dict(requests=640, hits=100, misses=540, collision_misses=37, evictions=296, prefetch_issued=276,
             prefetch_late=223, prefetch_wasted=50, streamed=205),
        dict(total_s=0.022559463301291723, stall_s=0.02246589563204111, ttft_s=0.0073498224950903955,
             tpot_s=0.0009824772888888664)),
}


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_replay(name):
    case, counts, times = GOLDEN[name]
    trace = read_trace(TRACE)
    assert trace.passes[:, 1].tolist() == [24, 1, 1, 1, 1] * 2
    spec = spec_of(**case)
    assert not exactness(trace, spec)
    res = run_replay(trace, spec).results()
    assert {k: res["cache"][k] for k in counts} == counts
    for k, v in times.items():
        assert res["timing"][k] == pytest.approx(v, rel=1e-6), k
