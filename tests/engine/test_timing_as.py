"""hardware.timing_as: a small model's routing on a real model's sizes and compute (the proportional
mapping of layers and experts), and the diagnosis of structurally late prefetches."""

from pathlib import Path

import pytest

from specmd.engine import Engine, Geometry
from specmd.compose import spec_of
from specmd.engine.geometry import _regroup, timed_as
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.models.loader import shipped_geometry
from specmd.quant.base import ExpertStore
from specmd.replay.driver import run_replay
from specmd.replay.trace import read_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "embedded_trace"


def test_regroup_splits_source_layers_pro_rata():
    assert _regroup([1, 2, 3, 4], 2) == [3, 7]
    assert _regroup([1, 2, 3], 2) == [2.0, 4.0]  # 1.5 source layers each: 1 + 0.5*2, 0.5*2 + 3
    assert sum(_regroup([5] * 16, 3)) == pytest.approx(80)


def test_shipped_configs_give_the_real_models_sizes():
    olmoe, mixtral = shipped_geometry("olmoe"), shipped_geometry("mixtral")
    assert (olmoe.num_layers, olmoe.num_experts, olmoe.top_k) == (16, 64, 8)
    assert olmoe.expert_bytes == 3 * 2048 * 1024 * 2  # gate, up, down at bf16
    assert olmoe.total_bytes == pytest.approx(13.84e9, rel=1e-3)  # OLMoE-1B-7B: 6.92 B parameters
    assert (mixtral.num_layers, mixtral.num_experts, mixtral.top_k) == (32, 8, 2)
    assert mixtral.total_bytes == pytest.approx(93.4e9, rel=1e-3)  # Mixtral-8x7B: 46.7 B parameters
    with pytest.raises(ConfigError, match="'gpt5': no shipped model config; valid choices: mixtral, olmoe"):
        shipped_geometry("gpt5")


def test_mapping_keeps_the_real_models_bytes_and_compute():
    trace = read_trace(TRACE)
    routing = trace.meta.geometry  # 4 MoE layers, 64 experts, top-8
    olmoe = shipped_geometry("olmoe")
    geom, f_bytes, f_compute = timed_as(routing, olmoe)
    assert (f_bytes, f_compute) == (4.0, 4.0)  # each layer stands for 4 OLMoE layers
    assert (geom.num_layers, geom.num_experts, geom.top_k) == (4, 64, 8)
    assert geom.expert_bytes == 4 * olmoe.expert_bytes
    assert geom.num_layers * geom.num_experts * geom.expert_bytes == olmoe.num_layers * olmoe.num_experts * olmoe.expert_bytes
    assert sum(geom.dense_params) == pytest.approx(sum(olmoe.dense_params))
    assert geom.attn_layers == [4.0] * 4 and geom.tail_params == olmoe.tail_params
    assert geom.expert_params == 4 * olmoe.expert_params
    # wide routing on a deep real model: Mixtral (32 x 8, top-2) -> bytes x1, compute x2 per routing expert
    mixtral = shipped_geometry("mixtral")
    geom, f_bytes, f_compute = timed_as(routing, mixtral)
    assert (f_bytes, f_compute) == (1.0, 2.0)
    assert (geom.expert_bytes, geom.expert_params) == (mixtral.expert_bytes, 2 * mixtral.expert_params)


def test_store_sizes_keep_bytes_per_parameter():
    routing = Geometry(num_layers=2, num_experts=4, top_k=1, expert_bytes=400, total_bytes=4000, expert_params=100,
                       dtype_bytes=4)
    timing = Geometry(num_layers=4, num_experts=4, top_k=1, expert_bytes=2000, total_bytes=40000,
                      expert_params=1000, dtype_bytes=2)
    spec = spec_of(prefetch="none", hardware=HardwareConfig(capacity=0.25))  # 5% would hold no 4,000-byte expert
    spec.timing = ("real", timing)
    eng = Engine(routing, spec, ExpertStore(32, 400, {"int8": 110}))
    # a routing expert stands for 2 timing experts: 2000 parameters, native 2 bytes each, int8 1.1 bytes each
    assert eng.store.bytes_of == {"native": 4000, "int8": 2200}
    assert eng.geom.expert_bytes == 4000 and eng.results()["cache"]["timing_geometry"] == "real"


def test_replay_timed_as_olmoe():
    trace = read_trace(TRACE)
    own = run_replay(trace, spec_of(prefetch="none")).results()
    real = run_replay(trace, spec_of(prefetch="none", hardware=HardwareConfig(timing_as="olmoe"))).results()
    olmoe = shipped_geometry("olmoe")
    assert own["cache"]["timing_geometry"] == "model" and real["cache"]["timing_geometry"] == "olmoe"
    assert real["cache"]["expert_bytes"] == 4 * olmoe.expert_bytes
    assert real["cache"]["model_bytes"] == olmoe.total_bytes
    assert real["cache"]["capacity_bytes"] == int(0.05 * olmoe.total_bytes)
    # OLMoE's experts take 93% of its bytes (the embedded model's 81%): 5% holds more routing experts
    assert real["cache"]["hit_rate"] >= own["cache"]["hit_rate"]
    assert real["timing"]["ttft_s"] > 100 * own["timing"]["ttft_s"]


def _decode_windows(geom, hw, depth):
    """Hand-computed: the roofline time of a decode token's experts of layer l plus layer l+1's dense part,
    summed over ``depth`` consecutive layers, for every layer a prefetch can be issued from."""
    peak, mem = hw.peak_tflops * 1e12, hw.mem_bandwidth_gbps * 1e9
    k = geom.top_k
    step = []
    for l in range(geom.num_layers - 1):
        experts = max(2.0 * k * geom.expert_params / peak, k * geom.expert_bytes / mem)
        p, a = geom.dense_params[l + 1], geom.attn_layers[l + 1]
        dense = max((2.0 * p + 4.0 * geom.hidden_size * a) / peak, p * geom.dtype_bytes / mem)
        step.append(experts + dense)
    return [sum(step[l:l + depth]) for l in range(geom.num_layers - depth)]


@pytest.mark.parametrize("prefetch,depth", [("topk", 1), ({"name": "lookahead", "depth": 2}, 2)])
def test_prefetch_lateness_is_diagnosed(prefetch, depth):
    trace = read_trace(TRACE)
    geom = trace.meta.geometry
    windows = _decode_windows(geom, HardwareConfig(), depth)
    # a link whose one-expert transfer falls between the shortest and the longest window: not structural
    # (some layer has time), and links far slower / faster than every window
    middle = geom.expert_bytes / ((min(windows) + max(windows)) / 2) / 1e9
    for bandwidth, structural in ((5.0, True), (middle, False), (1e6, False)):
        hw = HardwareConfig(capacity=0.5, bandwidth_gbps=bandwidth, latency_us=0.0)
        res = run_replay(trace, spec_of(prefetch=prefetch, hardware=hw)).results()["cache"]
        late = res["prefetch_lateness"]
        assert late["decode_window_s"] == pytest.approx(max(windows), rel=1e-9)
        assert late["structural"] is structural, bandwidth
        if structural:
            assert res["prefetch_late"] > 0
    hw = HardwareConfig(capacity=0.5)
    assert run_replay(trace, spec_of(prefetch="none", hardware=hw)).results()["cache"]["prefetch_lateness"] is None


def test_no_lateness_diagnosis_without_decode_passes():
    from specmd.replay.trace import Trace, full_calls

    trace = read_trace(TRACE)
    keep = trace.passes[:, 0] == 0  # prefill passes only
    L = trace.meta.geometry.num_layers
    rows = [r for p in range(len(trace.passes)) if keep[p]
            for c in trace.calls[p * L:(p + 1) * L] for r in range(c[2], c[2] + c[3])]
    passes = trace.passes[keep]
    pre = Trace(meta=trace.meta, passes=passes, calls=full_calls(passes, L), index=trace.index[rows],
                weights=None, logits=trace.logits[rows], path="prefill-only",
                signal_index=trace.signal_index[rows], signal_logits=trace.signal_logits[rows])
    res = run_replay(pre, spec_of(prefetch="topk", hardware=HardwareConfig(capacity=0.5))).results()["cache"]
    assert res["prefetch_issued"] > 0 and res["prefetch_lateness"] is None
