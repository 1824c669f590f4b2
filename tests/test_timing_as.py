"""hardware.timing_as: a small model's routing on a real model's sizes and compute (the proportional
mapping of layers and experts), and the diagnosis of structurally late prefetches."""

from pathlib import Path

import pytest

from specmd.engine import Engine, Geometry, StackSpec
from specmd.engine.geometry import _regroup, timed_as
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.models.loader import shipped_geometry
from specmd.quant.base import ExpertStore
from specmd.replay.driver import run_replay
from specmd.replay.trace import read_trace

TRACE = Path(__file__).resolve().parent / "data" / "embedded_trace"


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
    routing = Geometry.from_dict(trace.meta["geometry"])  # 4 MoE layers, 64 experts, top-8
    olmoe = shipped_geometry("olmoe")
    geom, f_bytes, f_compute = timed_as(routing, olmoe)
    assert (f_bytes, f_compute) == (4.0, 4.0)  # each layer stands for 4 OLMoE layers
    assert (geom.num_layers, geom.num_experts, geom.top_k) == (4, 64, 8)
    assert geom.expert_bytes == 4 * olmoe.expert_bytes
    assert geom.num_layers * geom.num_experts * geom.expert_bytes == olmoe.num_layers * olmoe.num_experts * olmoe.expert_bytes
    assert sum(geom.dense_params) == pytest.approx(sum(olmoe.dense_params))
    assert geom.attn_layers == [4.0] * 4 and geom.tail_params == olmoe.tail_params
    # wide routing on a deep real model: Mixtral (32 x 8, top-2) -> bytes x1, compute x2 per routing expert
    _, f_bytes, f_compute = timed_as(routing, shipped_geometry("mixtral"))
    assert (f_bytes, f_compute) == (1.0, 2.0)


def test_store_sizes_keep_bytes_per_parameter():
    routing = Geometry(num_layers=2, num_experts=4, top_k=1, expert_bytes=400, total_bytes=4000, expert_params=100,
                       dtype_bytes=4)
    timing = Geometry(num_layers=4, num_experts=4, top_k=1, expert_bytes=2000, total_bytes=40000,
                      expert_params=1000, dtype_bytes=2)
    spec = StackSpec.of(prefetch="none")
    spec.timing = ("real", timing)
    eng = Engine(routing, spec, ExpertStore(32, 400, {"int8": 110}))
    # a routing expert stands for 2 timing experts: 2000 parameters, native 2 bytes each, int8 1.1 bytes each
    assert eng.store.bytes_of == {"native": 4000, "int8": 2200}
    assert eng.geom.expert_bytes == 4000 and eng.results()["cache"]["timing_geometry"] == "real"


def test_replay_timed_as_olmoe():
    trace = read_trace(TRACE)
    own = run_replay(trace, StackSpec.of(prefetch="none")).results()
    real = run_replay(trace, StackSpec.of(prefetch="none", hardware=HardwareConfig(timing_as="olmoe"))).results()
    olmoe = shipped_geometry("olmoe")
    assert own["cache"]["timing_geometry"] == "model" and real["cache"]["timing_geometry"] == "olmoe"
    assert real["cache"]["expert_bytes"] == 4 * olmoe.expert_bytes
    assert real["cache"]["model_bytes"] == olmoe.total_bytes
    assert real["cache"]["capacity_bytes"] == int(0.05 * olmoe.total_bytes)
    # OLMoE's experts take 93% of its bytes (the embedded model's 81%): 5% holds more routing experts
    assert real["cache"]["hit_rate"] >= own["cache"]["hit_rate"]
    assert real["timing"]["ttft_s"] > 100 * own["timing"]["ttft_s"]


@pytest.mark.parametrize("bandwidth,structural", [(5.0, True), (1e6, False)])
def test_prefetch_lateness_is_diagnosed(bandwidth, structural):
    trace = read_trace(TRACE)
    hw = HardwareConfig(capacity=0.5, bandwidth_gbps=bandwidth, latency_us=0.0)
    res = run_replay(trace, StackSpec.of(prefetch="topk", hardware=hw)).results()["cache"]
    late = res["prefetch_lateness"]
    assert late["structural"] is structural
    assert (late["transfer_s"] > late["decode_window_s"]) is structural
    if structural:
        assert res["prefetch_late"] > 0
    none = run_replay(trace, StackSpec.of(prefetch="none", hardware=hw)).results()["cache"]
    assert none["prefetch_lateness"] is None
