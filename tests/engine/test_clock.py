"""The simulated clock on a hand-computed two-layer example.

Setup: expert = 100 B, link 1000 B/s + 10 ms latency -> 0.11 s per transfer. Roofline peak 1000 FLOP/s:
dense part of each layer 50 params x 1 token -> 100 FLOP = 0.1 s; an expert slot 2 x 25 FLOP = 0.05 s.
"""

import pytest

from tests.engine.test_cache_manager import manager, run_pass


def test_two_layer_no_prefetch_exact_ttft_and_stall():
    # L0: dense 0 -> 0.1; demand (0,0) 0.1 -> 0.21, (0,1) 0.21 -> 0.32: stall 0.22; experts 2 slots -> 0.42
    # L1: dense -> 0.52; demand 0.52 -> 0.63 -> 0.74: stall 0.22; experts -> 0.84.   TTFT 0.84, stall 0.44
    m = manager(4, dense=(50, 50), expert_params=25)
    run_pass(m, [[0, 1], [2, 3]])
    p = m.stats.passes[0]
    assert p.time_s == pytest.approx(0.84)
    assert p.stall_s == pytest.approx(0.44)
    assert list(m.stats.stall_s) == pytest.approx([0.22, 0.22])
    assert m.stats.timing()["ttft_s"] == pytest.approx(0.84)


def test_two_layer_prefetch_overlaps_compute_and_late_prefetch_stalls():
    # As above, but at L0 (t = 0.32, after its stall) prefetch L1 {2, 3}: transfers 0.32 -> 0.43 -> 0.54.
    # L0 experts -> 0.42, L1 dense -> 0.52. (1,2) arrived at 0.43: hit. (1,3) arrives 0.54: late, stall 0.02.
    # L1 experts -> 0.64.  TTFT 0.64, stall 0.22 + 0.02.
    m = manager(4, dense=(50, 50), expert_params=25)
    run_pass(m, [[0, 1], [2, 3]], prefetch={0: [(1, [2, 3])]})
    st = m.stats
    assert st.passes[0].time_s == pytest.approx(0.64)
    assert st.passes[0].stall_s == pytest.approx(0.24)
    assert list(st.hits) == [0, 1] and list(st.prefetch_late) == [0, 1] and list(st.prefetch_used) == [0, 2]
    assert list(st.bytes_demand) == [200, 0] and list(st.bytes_prefetch) == [0, 200]


def test_demand_is_served_before_queued_prefetch():
    from specmd.engine.link import Transfer, TransferChannel

    ch = TransferChannel(1000.0, 0.0)  # 100 B = 0.1 s
    a, b = Transfer(100, 0.0), Transfer(100, 0.0)
    ch.submit(a)
    ch.submit(b)
    # at t=0.05 prefetch a is in flight (0 -> 0.1), b is queued; the demand goes before b
    assert ch.demand(0.05, 100) == pytest.approx(0.2)
    ch.advance(1.0)
    assert a.ready_at == pytest.approx(0.1) and b.ready_at == pytest.approx(0.3)


def test_demand_fetches_need_no_handle_and_the_next_wait_covers_them():
    """The simulated clock returns no handle for a demand fetch (no object per fetch on the replay's path):
    the next ``wait`` waits for the latest demand anyway, given no handle or only earlier ones."""
    m = manager(4, dense=(50, 50), expert_params=25)
    clock = m.clock
    assert clock.demand(100) is None and clock.demand(100) is None  # 0 -> 0.11 -> 0.22
    assert clock.wait([]) == pytest.approx(0.22)
    assert clock.now == pytest.approx(0.22)
    assert clock.wait([]) == 0.0  # nothing outstanding: no stall
    handle = clock.host(0, 0)  # a handle done now
    clock.demand(100)  # 0.22 -> 0.33
    assert clock.wait([handle]) == pytest.approx(0.11)  # the demand is waited for beside the handle given
