"""Every rounding and clamping of a capacity or a count, pinned by hand-worked values: a change of ``round`` to
``int``, of ``ceil`` to ``round``, or a clamp added or dropped moves one of them.

- ``hardware.experts_per_layer`` as a fraction: nearest slot (halves to even), 0 slots an error;
- ``hardware.capacity``: bytes truncated (``int``), split evenly between per-layer pools (``//``);
- the smallest capacity an error suggests: rounded *up* to 3 digits, so that it is enough;
- a pool's capacity in experts (ARC's and LeCaR's ``c``): whole copies (``//``), at least one;
- prefetch overfetch: ``ceil(k x overfetch)`` up to float error, at least one, at most the layer's experts;
- ``hardware.timing_as``: one routing expert's bytes to the nearest byte.
"""

import pytest

from specmd.engine import Geometry
from specmd.engine.geometry import pool_capacities, slots_per_layer
from specmd.errors import ConfigError


@pytest.mark.parametrize("fraction,experts,slots", [
    (0.35, 8, 3),      # 2.8 -> 3 (int() would give 2: the example)
    (0.3125, 8, 2),    # 2.5 -> 2: halves to even
    (0.4375, 8, 4),    # 3.5 -> 4: halves to even
    (0.5, 64, 32),     # Cache-Conditional Experts' N/2
    (0.07, 64, 4),     # 4.48 -> 4
    (0.0625, 8, 0),    # 0.5 -> 0 (halves to even): no slot, an error
    (0.07, 8, 1),      # 0.56 -> 1
    (4.0, 64, 4),      # a whole number is a slot count, not a fraction
    (1.0, 8, 1),
])
def test_experts_per_layer_rounds_to_the_nearest_slot(fraction, experts, slots):
    if slots == 0:
        with pytest.raises(ConfigError, match="rounds to 0 slots"):
            slots_per_layer(fraction, experts)
        return
    assert slots_per_layer(fraction, experts) == slots


def test_capacity_bytes_are_truncated_and_split_evenly():
    g = Geometry(num_layers=4, num_experts=8, top_k=2, expert_bytes=100, total_bytes=4003)
    assert pool_capacities(g, 0.1, None, "global") == [400]  # 400.3 -> 400
    assert pool_capacities(g, 0.99999, None, "global") == [4002]  # 4002.96 -> 4002, never more than asked
    assert pool_capacities(g, 1.0, None, "per_layer") == [1000] * 4  # 4003 // 4; 3 bytes unused
    assert pool_capacities(g, 0.35, 0.35, "per_layer") == [300] * 4  # 2.8 slots -> 3 x 100 bytes
    assert pool_capacities(g, 0.35, 0.35, "global") == [1200]


def test_the_smallest_capacity_suggested_is_enough():
    """The capacity the error suggests, set as given, holds one expert (rounded up, never to a value just
    below the bound)."""
    import re
    from types import SimpleNamespace

    from specmd.engine.engine import check_capacity
    from specmd.engine.store import StoreSizes

    for total, nbytes, scope, L in [(46_416_896, 147_456, "global", 4), (3_485_952, 98_304, "per_layer", 4),
                                    (10 ** 9 + 7, 3, "global", 16), (7_777_777, 12_345, "per_layer", 3)]:
        g = Geometry(num_layers=L, num_experts=8, top_k=2, expert_bytes=nbytes, total_bytes=total)
        store = StoreSizes(16, nbytes, {})
        hw = SimpleNamespace(capacity=1e-12, scope=scope)
        with pytest.raises(ConfigError) as exc:
            check_capacity(pool_capacities(g, 1e-12, None, scope), hw, g, store, ["native"])
        need = float(re.search(r"holds one expert is ([0-9.e-]+)", str(exc.value)).group(1))
        check_capacity(pool_capacities(g, need, None, scope), SimpleNamespace(capacity=need, scope=scope), g, store,
                       ["native"])  # no error
        assert need <= 1.01 * nbytes * (L if scope == "per_layer" else 1) / total  # and not more than 3 digits add


def test_the_capacity_check_uses_the_smallest_precision_fetched():
    from types import SimpleNamespace

    from specmd.engine.engine import check_capacity
    from specmd.engine.store import StoreSizes

    g = Geometry(num_layers=2, num_experts=8, top_k=2, expert_bytes=1000, total_bytes=100_000)
    store = StoreSizes(16, 1000, {"int8": 520, "int4": 270})
    hw = SimpleNamespace(capacity=0.003, scope="global")
    check_capacity([300], hw, g, store, ["int8", "int4"])  # holds one int4 copy
    with pytest.raises(ConfigError, match=r"less than one expert at int8 precision \(520 bytes"):
        check_capacity([300], hw, g, store, ["int8"])
    with pytest.raises(ConfigError, match=r"at native precision \(1,000 bytes"):
        check_capacity([999], hw, g, store, ["native"])
    check_capacity([1000], hw, g, store, ["native"])  # exactly one expert


@pytest.mark.parametrize("overfetch,k,count", [
    (1.0, 8, 8),        # the router's own top-k
    (1.1, 8, 9),        # 8.8 -> 9: rounded up
    (1.2, 5, 6),        # 6.0 -> 6
    (0.28, 25, 7),      # 7.000000000000001 -> 7, not 8 (the 1e-9)
    (0.5, 3, 2),        # 1.5 -> 2
    (0.01, 8, 1),       # at least one
    (2.0, 8, 16),
])
def test_overfetch_counts_round_up(overfetch, k, count):
    from specmd.policies.prefetch.base import overfetch_count

    assert overfetch_count(overfetch, k) == count


def test_overfetch_beyond_the_layers_experts_is_an_error_not_a_clamp():
    from specmd.policies.prefetch.base import overfetch_errors

    g = Geometry(num_layers=4, num_experts=64, top_k=8, expert_bytes=1, total_bytes=1)
    assert overfetch_errors(8.0, g) == []  # 64: every expert
    (msg,) = overfetch_errors(8.01, g)  # 64.08 -> 65
    assert "predicts 65 experts per token" in msg and "at most 8" in msg


@pytest.mark.parametrize("capacity,unit,expected", [
    (2999, "fetch", 2),     # 2.999 native copies: 2 whole ones
    (3000, "fetch", 3),
    (999, "native", 1),     # below one native copy (a quantized cascade fills it): still c = 1
    (2999, "native", 2),
])
def test_a_pools_capacity_in_experts_counts_whole_copies(capacity, unit, expected):
    """ARC's and LeCaR's ``c``: whole copies of the fetched (or native) size, at least one."""
    from types import SimpleNamespace

    from specmd.policies.eviction.base import EvictionPolicy

    g = Geometry(num_layers=1, num_experts=8, top_k=2, expert_bytes=1000, total_bytes=8000)
    pol = EvictionPolicy()
    pol.attach(SimpleNamespace(geometry=g, fetch_precision="native", bytes_of=lambda p: 1000), capacity)
    assert pol.capacity_experts(unit) == expected


def test_timing_as_rounds_a_routing_experts_bytes_to_the_nearest_byte():
    from specmd.engine.geometry import timed_as

    routing = Geometry(num_layers=3, num_experts=7, top_k=2, expert_bytes=10, total_bytes=210)
    timing = Geometry(num_layers=4, num_experts=8, top_k=2, expert_bytes=1001, total_bytes=10 ** 6)
    geom, f_bytes, _ = timed_as(routing, timing)
    assert f_bytes == 32 / 21
    assert geom.expert_bytes == 1525  # 1001 x 32/21 = 1525.33 -> 1525 (to the nearest)
    timing2 = Geometry(num_layers=4, num_experts=8, top_k=2, expert_bytes=1004, total_bytes=10 ** 6)
    assert timed_as(routing, timing2)[0].expert_bytes == 1530  # 1529.90 -> 1530 (int() would give 1529)
