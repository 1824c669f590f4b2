"""How far to trust the clock (issue 45): the roofline's serial share and the host/link contention worked by
hand, the profile's provenance (calibrated_on) and what a run says about it, calibrate's saved measurements,
and ``specmd fidelity``'s figures (error, noise, components, ranking) on hand-made cells and on a real
tiny grid."""

import math

import numpy as np
import pytest
import torch

from specmd.engine.link import TransferChannel
from specmd.engine.simclock import Roofline, SimClock
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig, profile_mismatch


# ---- the clock ------------------------------------------------------------------------------------------
def test_roofline_serial_adds_that_share_of_the_shorter_bound():
    """compute 2 s, memory 3 s: the ideal roofline takes 3, serial 0.5 takes 3 + 1, serial 1 their sum."""
    assert Roofline(100.0, 10.0).time(200.0, 30.0) == 3.0
    assert Roofline(100.0, 10.0, 0.5).time(200.0, 30.0) == 4.0
    assert Roofline(100.0, 10.0, 1.0).time(200.0, 30.0) == 5.0


def _clock(geom, serial=0.0, contention=0.0, bw=1e15):
    return SimClock(geom, TransferChannel(bw, 0.0), Roofline(100.0, 10.0, serial), Roofline(100.0, 10.0, serial),
                    contention=contention)


def test_roofline_serial_is_the_experts_and_dense_time(geom_small):
    """The clock's own expert and dense times follow the serial share (its compiled arithmetic, not only the
    Roofline helper): an expert of the small geometry, 1 slot."""
    g = geom_small
    c = 2.0 * g.expert_params / 100.0
    m = g.expert_bytes / 10.0
    assert _clock(g).experts_time(1, 1) == max(c, m)
    assert _clock(g, serial=1.0).experts_time(1, 1) == pytest.approx(c + m, rel=1e-12)
    p = g.dense_params[0]
    dc, dm = 2.0 * p / 100.0 + 4.0 * g.hidden_size * g.attn_layers[0] / 100.0, p * g.dtype_bytes / 10.0
    assert _clock(g, serial=0.5).dense_time(0, 1, 1) == pytest.approx(max(dc, dm) + 0.5 * min(dc, dm), rel=1e-12)


def test_a_one_row_product_reads_its_weights_at_the_gemv_rate():
    """Memory 30 bytes at 10 B/s, 10 of them by one-row products at 20 B/s: 20 / 10 + 10 / 20 = 2.5 s. Without
    a GEMV rate, the one-row bytes read at the memory bandwidth: 3 s, the same bits as before it existed."""
    assert Roofline(100.0, 10.0, 0.0, 20.0).time(0.0, 30.0, 10.0) == 2.5
    assert Roofline(100.0, 10.0).time(0.0, 30.0, 10.0) == Roofline(100.0, 10.0).time(0.0, 30.0) == 3.0


@pytest.mark.parametrize("slots,experts,one", [
    (4, 4, 4),     # a decode step at batch 1: every expert one row
    (16, 14, 12),  # batch 4, top-4: two experts shared by two tokens
    (128, 60, 0),  # a prefill: none
    (5, 3, 1),     # 1 + 2 + 2 (the fewest one-row experts 5 slots over 3 experts allow)
    (3, 4, 4),     # fewer slots than experts (a void slot): at most every expert
    (0, 0, 0),
])
def test_one_row_experts_are_the_fewest_the_counts_allow(slots, experts, one):
    from specmd.engine.simclock import one_row

    assert one_row(slots, experts) == one


def _gemv_clock(geom, gemv):
    return SimClock(geom, TransferChannel(1e15, 0.0), Roofline(1e15, 10.0, 0.0, gemv), Roofline(1e15, 10.0, 0.0, gemv))


def test_the_clock_times_one_row_experts_and_batch_1_dense_layers_at_the_gemv_rate(geom_small):
    """The small geometry (400-byte experts, 50 dense params of 4 bytes), memory 10 B/s, GEMV 40 B/s: 2 experts
    of one row each read 800 bytes at 40 B/s (20 s); 3 slots over 2 experts, one of them one row: 400 / 40 +
    400 / 10 = 50 s; one token's dense layer 200 bytes at 40 (5 s), two tokens' at 10 (20 s). The host's
    kernel follows the same rule. gemv 0 (off): everything at 10 B/s."""
    g = geom_small
    c = _gemv_clock(g, 40.0)
    assert c.experts_time(2, 2) == 20.0 and c.experts_time(3, 2) == 50.0 and c.experts_time(4, 2) == 80.0
    assert c.dense_time(0, 1, 0) == 5.0 and c.dense_time(0, 2, 0) == 20.0
    assert c.host_time(2, 2) == 20.0 and c.host_time(3, 2) == 50.0
    off = _gemv_clock(g, 0.0)
    assert off.experts_time(2, 2) == 80.0 and off.dense_time(0, 1, 0) == 20.0 and off.host_time(2, 2) == 80.0
    c.experts(2, 2)  # (the charge itself, not only the prediction)
    assert c.now == 20.0


def test_the_link_runs_at_the_rate_of_the_models_expert_size(geom_small):
    """A copy's first small_copy_mb at small_copy_gbps, the rest at bandwidth_gbps: the small geometry's
    400-byte expert under a 1,000-byte knee copies at the small rate; over a 100-byte knee, 100 bytes at 4
    B/s and 300 at 1 (325 s: 400 / 325 B/s); without a knee at 1 B/s."""
    from specmd.engine.link import copy_rate

    assert copy_rate(1.0, 4.0, 1000.0, 400.0) == 4.0
    assert copy_rate(1.0, 4.0, 100.0, 400.0) == 400.0 / 325.0
    assert copy_rate(1.0, 0.0, 0.0, 400.0) == 1.0
    g = geom_small
    hw = HardwareConfig(bandwidth_gbps=1e-9, latency_us=0.0, small_copy_gbps=4e-9, small_copy_mb=100e-6)
    assert SimClock.from_hardware(g, hw).transfer_time(400) == pytest.approx(325.0, rel=1e-12)
    assert SimClock.from_hardware(g, HardwareConfig(bandwidth_gbps=1e-9, latency_us=0.0)).transfer_time(400) \
        == pytest.approx(400.0, rel=1e-12)
    gemv = SimClock.from_hardware(g, HardwareConfig(mem_bandwidth_gbps=1e-8, peak_tflops=1e3, gemv_bandwidth_gbps=4e-8))
    assert gemv.experts_time(2, 2) == pytest.approx(20.0, rel=1e-12)


def test_the_link_fit_finds_a_knee_where_small_copies_run_faster():
    """Copies at 12 GB/s up to 4 MiB and 7.5 beyond, 40 us each: the fit recovers all four figures; an affine
    link (one rate) gets no knee."""
    from specmd.commands.calibrate.measure import SIZES
    from specmd.commands.calibrate.fit import fit_link

    K = 4 << 20
    rep = {}
    bw, lat = fit_link([(n, 40e-6 + min(n, K) / 12e9 + max(0, n - K) / 7.5e9) for n in SIZES], rep)
    assert bw == pytest.approx(7.5e9, rel=1e-6) and lat == pytest.approx(40e-6, rel=1e-6)
    assert rep["small_bw"] == pytest.approx(12e9, rel=1e-6) and rep["small_bytes"] == K
    rep = {}
    fit_link([(n, 40e-6 + n / 7.5e9) for n in SIZES], rep)
    assert rep["small_bw"] is None and rep["small_bytes"] is None
    # small copies *slower* than large ones (a knee would fit, the wrong way round): one rate, the no-knee fit's
    rep = {}
    pts = [(n, 40e-6 + min(n, K) / 4e9 + max(0, n - K) / 7.5e9) for n in SIZES]
    bw, lat = fit_link(pts, rep)
    assert rep["small_bw"] is None
    line = np.polyfit([n for n, _ in pts], [t for _, t in pts], 1, w=[1 / t for _, t in pts])
    assert bw == pytest.approx(1 / line[0], rel=1e-3) and lat == pytest.approx(line[1], rel=1e-2)


def test_the_kernel_fit_finds_the_one_row_rate():
    """Points made by the clock's own roofline with a GEMV rate (0.15 TFLOP/s -- compute-bound at 128 rows, so
    the peak and the serial share are each identifiable --, 8 GB/s, one row at 16, serial 1, 10 us a call):
    the fit recovers each."""
    from specmd.commands.calibrate.measure import KERNEL_SHAPES, KERNEL_TOKENS
    from specmd.commands.calibrate.fit import fit_kernel

    pts = []
    for h, f in KERNEL_SHAPES:
        for t in KERNEL_TOKENS:
            F, B = 2.0 * t * h * f, 4.0 * h * f
            pts.append((F, B, t, 10e-6 + Roofline(1.5e11, 8e9, 1.0, 16e9).time(F, B, B if t == 1 else 0.0)))
    peak, bw, rep = fit_kernel(pts)
    assert peak == pytest.approx(1.5e11, rel=1e-4) and bw == pytest.approx(8e9, rel=1e-4)
    assert rep["gemv_bw"] == pytest.approx(16e9, rel=1e-4) and rep["serial"] == pytest.approx(1.0, rel=1e-4)
    assert rep["max_abs_err"] < 1e-6


@pytest.mark.parametrize("host_s,link_s,contention,stall", [
    (6.0, 10.0, 0.5, 13.0),   # the link ends last: stretched by half of the 6 s overlap
    (10.0, 6.0, 0.5, 13.0),   # the host ends last: stretched by half of the 6 s overlap
    (6.0, 10.0, 0.0, 10.0),   # no contention: the longer of the two
    (6.0, 10.0, 1.0, 16.0),   # full contention: they take turns
])
def test_host_and_link_at_once_cost_the_contention_of_their_overlap(geom_small, host_s, link_s, contention,
                                                                    stall):
    """A demand fetch of ``link_s`` seconds and host work of ``host_s`` issued together: the wait for both is
    max + contention * min. (Only the host's kernels contend: a per-call overhead does not, below.)"""
    g = geom_small
    clock = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 1e15), Roofline(1e15, g.expert_bytes / host_s),
                     contention=contention)  # (the host's kernel: one expert's bytes in host_s seconds)
    clock.demand(int(link_s))  # 1 byte/s: link_s seconds
    h = clock.host(1, 1)
    assert clock.wait([h]) == pytest.approx(stall)
    assert clock.busy()["host_busy_s"] == pytest.approx(host_s + (contention * min(host_s, link_s)
                                                                   if host_s >= link_s else 0.0))
    calls = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 1e15), Roofline(1e15, 1e15),
                     host_overheads=(host_s, 0.0, 0.0), contention=contention)
    calls.demand(int(link_s))
    assert calls.wait([calls.host(1, 1)]) == pytest.approx(max(host_s, link_s))


def test_a_cpu_devices_kernels_contend_with_the_copies_in_flight(geom_small):
    """Without overlap (a CPU), the experts' kernel beside a demand fetch in flight is host work too: 4 s of
    kernel (400 bytes at 100 B/s) and 1 s of per-expert overhead beside a 10 s copy, contention 0.5: the
    copy ends at 10 + 0.5 * 4; the compute at 5 s; the wait brings the clock to 12."""
    g = geom_small
    clock = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 100.0), overheads=(0, 0, 1.0), contention=0.5)
    clock.demand(10)
    clock.experts(1, 1)
    assert clock.now == pytest.approx(5.0)
    assert clock.wait([]) == pytest.approx(7.0) and clock.now == pytest.approx(12.0)
    free = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 100.0), overheads=(0, 0, 1.0))
    free.demand(10)
    free.experts(1, 1)
    assert free.wait([]) == pytest.approx(5.0)


@pytest.fixture
def geom_small():
    from specmd.engine.geometry import Geometry

    return Geometry(num_layers=2, num_experts=4, top_k=2, expert_bytes=400, total_bytes=5000, expert_params=100, hidden_size=8,
                    dtype_bytes=4, dense_params=[50.0, 50.0], attn_layers=[1.0, 1.0], tail_params=10.0,
                    tail_attn_layers=0.0)


# ---- the profile's provenance ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,match", [
    ("roofline_serial", 1.5, "roofline_serial=1.5 must be a fraction in \\[0, 1\\]"),
    ("host_roofline_serial", -0.1, "must be a fraction"),
    ("host_link_contention", math.nan, "host_link_contention"),
    ("host_link_contention", True, "must be a fraction"),
    ("calibrated_on", "vm", "calibrated_on='vm' must be a mapping"),
    ("gemv_bandwidth_gbps", 0.0, "gemv_bandwidth_gbps=0.0 must be a rate in"),
    ("host_gemv_bandwidth_gbps", True, "host_gemv_bandwidth_gbps=True must be a rate"),
    ("small_copy_mb", -1.0, "small_copy_mb=-1.0 must be a size"),
    ("small_copy_mb", 4.0, "give both"),  # (without small_copy_gbps)
    ("small_copy_gbps", math.inf, "small_copy_gbps=inf"),
    ("small_copy_gbps", -3.0, "small_copy_gbps=-3.0 must be a rate"),
])
def test_bad_fidelity_fields_rejected(key, value, match):
    with pytest.raises(ConfigError, match=match):
        HardwareConfig(**{key: value})


def test_a_run_elsewhere_than_the_profile_was_fitted_says_what_differs():
    on = {"host": "vm", "device": "cpu", "torch": "2.13.0", "dtype": "float32", "model": "deep_olmoe",
          "expert_bytes": 49152, "kernel_bytes": [131072.0, 46137344.0]}
    hw = HardwareConfig(name="rep1", calibrated_on=on)
    same = {"host": "vm", "device": "cpu", "torch": "2.13.0", "dtype": "float32", "model": "deep_olmoe",
            "expert_bytes": 49152 * 8}
    assert profile_mismatch(hw, same) == []
    assert profile_mismatch(hw, dict(same, threads=1)) == []  # (a profile from before threads were kept)
    threaded = HardwareConfig(name="rep1", calibrated_on=dict(on, threads=2))
    assert profile_mismatch(threaded, dict(same, threads=1)) == [
        "hardware=rep1 was calibrated with threads 2; this run's is 1"]  # (issue 56: threads are a setting)
    lines = profile_mismatch(hw, dict(same, device="cuda", model="mixtral", expert_bytes=4e9))
    assert lines == [
        "hardware=rep1 was calibrated with device cpu; this run's is cuda",
        "hardware=rep1's overheads were fitted on model=deep_olmoe; this run's is model=mixtral (`specmd calibrate "
        "--model mixtral` fits it)",
        "hardware=rep1's roofline was fitted on weights of 1.31e+05-4.61e+07 bytes; this model's expert "
        "projections are 1.33e+09"]
    assert profile_mismatch(HardwareConfig(), dict(same, device="cuda")) == []  # a hand-written profile


# ---- calibrate's saved measurements ---------------------------------------------------------------------
def test_calibrate_reuses_its_measurements_unless_asked(tmp_path, monkeypatch):
    """A second calibrate of the same host, device, torch and model measures nothing and writes the same
    profile; --remeasure measures again; another model is another key."""
    from types import SimpleNamespace

    import specmd.commands.calibrate.command as cal
    from specmd.executor import base

    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(base, "steady_host_allocator", lambda *a, **k: True)
    calls = []
    rep = {"points": [], "median_abs_err": 0.0, "max_abs_err": 0.0, "small_bw": 1.2e10, "small_bytes": 4e6}
    kern = {"serial": 0.75, "launch_us": 1.0, "gemv_bw": 3e10, "points": [{"bytes": 1e5}, {"bytes": 5e7}],
            "median_abs_err": 0.0, "max_abs_err": 0.0}
    monkeypatch.setattr(cal, "measure_ram_link", lambda dev, report=None, **k: (calls.append("link"), report.update(rep),
                                                                                (8e9, 5e-6))[2])
    monkeypatch.setattr(cal, "measure_disk_link", lambda dev, path, report=None, **k: (report.update(rep),
                                                                                        (2e9, 5e-5))[1])
    monkeypatch.setattr(cal, "measure_compute", lambda dev: (calls.append("compute"), (1e11, 2e10, kern))[1])
    monkeypatch.setattr(cal, "speed_probe", lambda dev: {"kernel_us": 100.0, "python_us": 50.0})
    monkeypatch.setattr(cal, "measure_contention", lambda dev, hw, **k: (0.5, {"host_ms": 1.0, "link_ms": 1.0,
                                                                                "together_ms": 1.5}))
    monkeypatch.setattr(cal, "load_configured", lambda model: (None, SimpleNamespace(family="olmoe")))
    monkeypatch.setattr(cal, "measure_host_experts", lambda *a, **k: (
        {"host_call_overhead_us": 1.0, "host_expert_overhead_us": 2.0, "host_token_overhead_us": 3.0}, {}))
    first = cal.calibrate(str(tmp_path / "a"), "box", "tiny", quick=True, log=lambda m: None)
    assert calls == ["link", "compute"] and first["reused"] == []
    second = cal.calibrate(str(tmp_path / "b"), "box", "tiny", quick=True, log=lambda m: None)
    assert calls == ["link", "compute"] and second["reused"] == ["link", "disk", "compute", "contention",
                                                                 "host_experts"]
    assert (tmp_path / "a/hardware/box.yaml").read_text().split("\n", 1)[1] == \
        (tmp_path / "b/hardware/box.yaml").read_text().split("\n", 1)[1]  # (all but the time stamp)
    cal.calibrate(str(tmp_path / "c"), "box", "tiny", quick=True, log=lambda m: None, remeasure=True)
    cal.calibrate(str(tmp_path / "d"), "box", "deep_olmoe", quick=True, log=lambda m: None)
    assert calls == ["link", "compute"] * 3
    # another thread placement is another key (issue 56: what was measured at 2 threads is not 1 thread's)
    auto = first["hardware"]["calibrated_on"]["threads"]
    cal.calibrate(str(tmp_path / "e"), "box", "tiny", quick=True, log=lambda m: None, threads=auto + 1)
    assert calls == ["link", "compute"] * 4
    hw = HardwareConfig(**{k: v for k, v in first["hardware"].items()})
    assert hw.roofline_serial == 0.75 and hw.host_link_contention == 0.5
    assert hw.gemv_bandwidth_gbps == hw.host_gemv_bandwidth_gbps == 30.0  # (the kernel fit's one-row rate)
    assert hw.small_copy_gbps == 12.0 and hw.small_copy_mb == 4.0  # (the link fit's knee)
    assert hw.calibrated_on["model"] == "tiny" and hw.calibrated_on["dtype"] == "float32"
    assert hw.calibrated_on["speed"] == {"kernel_us": 100.0, "python_us": 50.0}  # (the machine's speed then)
    from specmd.machine import CorePlan

    plan = CorePlan.plan()  # (calibrate's default: an offloaded run's auto placement, not pinned)
    assert {k: hw.calibrated_on[k] for k in ("threads", "pin", "host_threads", "cores")} == \
        {"threads": plan.threads, "pin": False, "host_threads": plan.host_threads, "cores": plan.cores}


def test_drift_is_the_machines_speed_now_against_the_calibrations():
    """Time now / then per probe figure; nothing to compare with for a profile without a probe. The probe
    itself measures positive microseconds of both kinds."""
    from specmd.commands.calibrate.measure import drift, speed_probe

    assert drift({"kernel_us": 100.0, "python_us": 50.0}, {"kernel_us": 125.0, "python_us": 45.0}) == \
        {"kernel_us": 1.25, "python_us": 0.9}
    assert drift(None, {"kernel_us": 1.0}) is None and drift({}, {"kernel_us": 1.0}) is None
    now = speed_probe(torch.device("cpu"), reps=1, rounds=1)
    assert set(now) == {"kernel_us", "python_us"} and all(v > 0 for v in now.values())


def test_the_written_profile_reads_back_with_its_provenance(tmp_path):
    import yaml

    from specmd.commands.calibrate.profile import profile_yaml

    on = {"host": "vm", "device": "cpu", "model": "tiny", "kernel_bytes": [1.0, 2.0], "expert_bytes": 3}
    text = profile_yaml("p", {"bandwidth_gbps": 3.5, "roofline_serial": 0.5, "calibrated_on": on}, ["test"])
    back = yaml.safe_load(text)
    assert back["calibrated_on"] == on and HardwareConfig(**{k: v for k, v in back.items()}).roofline_serial == 0.5


# ---- specmd fidelity --------------------------------------------------------------------------------------
def _run(wall, sim, waits_w=0.0, waits_s=0.0):
    return {"decode": {"wall_s": wall, "sim_s": sim, "wall_waits_s": waits_w, "sim_waits_s": waits_s,
                       "wall_host_s": 0.0, "sim_host_s": 0.0, "wall_link_s": 1.0, "sim_link_s": 2.0}}


def test_cell_error_noise_and_components_by_hand():
    """Repeats 1.1, 1.2, 1.5 s walls against 1.0 s simulated: the median 1.2 (+20%), the noise (1.5 - 1.1) /
    1.2 = 33% > 20%: noise-bound; the waits' share (0.3 - 0.1) / 1.0 and compute's the rest."""
    from specmd.commands.calibrate.fidelity import cell_report

    r = cell_report([_run(1.1, 1.0, 0.3, 0.1), _run(1.5, 1.0, 0.3, 0.1), _run(1.2, 1.0, 0.3, 0.1)])["tpot"]
    assert r["err"] == pytest.approx(0.2) and r["noise"] == pytest.approx(0.4 / 1.2) and r["noise_bound"]
    assert r["components"] == pytest.approx({"compute": 0.0, "waits": 0.2})
    assert r["resources"] == {"link": 0.5, "host": None}
    quiet = cell_report([_run(1.2, 1.0), _run(1.21, 1.0), _run(1.19, 1.0)])["tpot"]
    assert not quiet["noise_bound"] and quiet["components"]["compute"] == pytest.approx(0.2)


def test_ranking_counts_ties_inside_the_noise():
    """Group 1: fetch measured faster than hybrid by 50% but simulated slower: disagrees. Group 2: the same
    order flipped by only 5%, inside a 10% noise: a tie, agrees."""
    from specmd.commands.calibrate.fidelity import Cell, ranking

    def tp(wall, sim, noise):
        return {"tpot": {"wall_s": wall, "sim_s": sim, "noise": noise}}

    cells = {"a": tp(1.0, 2.0, 0.01), "b": tp(1.5, 1.0, 0.01), "c": tp(1.0, 2.0, 0.1), "d": tp(1.05, 1.0, 0.1)}
    meta = {"a": Cell("m", 0.05, "fetch", 1), "b": Cell("m", 0.05, "hybrid", 1),
            "c": Cell("m", 0.3, "fetch", 1), "d": Cell("m", 0.3, "hybrid", 1)}
    r = ranking(cells, meta)
    assert (r["groups"], r["agree"]) == (2, 1)
    assert r["per_group"]["m c=0.05 B=1"] == {"agree": False, "simulated": ["hybrid", "fetch"],
                                              "measured": ["fetch", "hybrid"]}


def test_the_table_says_how_far_the_machine_drifted_since_calibration():
    """The drift line: each figure's time now / then at the start and the end; a profile without a probe says
    so instead of a figure."""
    from specmd.commands.calibrate.fidelity import Cell, cell_report, summarize, table

    run = lambda w: {**_run(w, 1.0), "prefill": _run(w, 1.0)["decode"]}  # noqa: E731
    cells = {"a": cell_report([run(1.1), run(1.2), run(1.3)])}
    report = {"cells": cells, "summary": summarize(cells, {"a": Cell("m", 0.05, "fetch", 1)}),
              "drift": {"start": {"kernel_us": 1.25, "python_us": 0.9}, "end": {"kernel_us": 1.3, "python_us": 1.0}}}
    assert "(time now / then, > 1: slower now): start: kernel 1.25, python 0.90; end: kernel 1.30, python 1.00" \
        in table(report)
    assert "not recorded (a profile from before calibrate's speed probe" in table(dict(report, drift=None))


def test_fidelity_runs_a_grid_on_the_tiny_model():
    """Two cells of the real thing (tiny, 5%, fetch and hybrid, batch 2): each cell's both figures, a positive
    wall and simulated time, three repeats, components that add up to the error, the grid's summary."""
    from specmd.commands.calibrate.fidelity import measure, summarize

    hw = HardwareConfig(name="t").__dict__ | {"bandwidth_gbps": 5.0}
    hw.pop("name")
    grid = {"models": ("tiny",), "capacities": (0.05,), "misses": ("fetch", "hybrid"), "batches": (2,)}
    cells, meta = measure(hw, grid, 3, 8, 2, "cpu", log=lambda m: None)
    assert sorted(cells) == ["tiny c=0.05 fetch B=2", "tiny c=0.05 hybrid B=2"]
    for c in cells.values():
        for f in ("ttft", "tpot"):
            x = c[f]
            assert x["wall_s"] > 0 and x["sim_s"] > 0 and len(x["repeats_s"]) == 3
            assert sum(x["components"].values()) == pytest.approx(x["err"])
    assert cells["tiny c=0.05 hybrid B=2"]["tpot"]["busy_s"]["sim_host_s"] > 0  # the host computed experts
    s = summarize(cells, meta)
    assert s["ttft"]["cells"] == 2 and s["ranking"]["groups"] == 1


@pytest.mark.parametrize("argv,match", [
    (["--repeats", "2"], "--repeats 2: at least 3"),
    (["--profile", "nope"], "--profile 'nope': no such profile .* a100_pcie"),
    (["--profile", "/nonexistent/box.yaml"], "--profile /nonexistent/box.yaml: no such file .* --out DIR --name NAME"),
    (["--models", "nope"], "--models 'nope': no such model config; valid choices: .*deep_olmoe"),
    (["--device", "tpu"], "tpu"),
])
def test_bad_fidelity_arguments_refused_before_any_run(argv, match, monkeypatch):
    import specmd.commands.calibrate.fidelity as fid

    monkeypatch.setattr(fid, "measure", lambda *a, **k: pytest.fail("measured before refusing"))
    with pytest.raises(ConfigError, match=match):
        fid.main(argv + (["--profile", "a100_pcie"] if "--profile" not in argv else []))


def test_a_run_on_a_profile_fitted_elsewhere_warns(tmp_path, caplog):
    """The run itself compares the profile's calibrated_on with what it runs: one warning line per difference."""
    import logging

    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute

    overrides = ["model=tiny", "eval.tasks=[]", "logger=none", "hardware.calibrated_on={device: cuda, model: tiny}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="specmd"):
        execute(cfg, run_dir=str(tmp_path / "run"), overrides=overrides)
    said = [r.getMessage() for r in caplog.records if "calibrated" in r.getMessage() or "fitted" in r.getMessage()]
    assert said == ["hardware=a100_pcie was calibrated with device cuda; this run's is cpu"]


def test_the_token_cost_scales_with_the_decoder_layers(geom_small):
    """``layer_token_overhead_us`` is per token per decoder layer (the 7th overhead): a 3-token pass through MoE
    layer 0's segment (1 decoder layer) and 1 s per token-layer adds 3 s; a segment of 2 decoder layers 6 s."""
    g = geom_small
    base = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 1e15)).dense_time(0, 3, 3)
    clock = SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 1e15), overheads=(0, 0, 0, 0, 0, 0, 1.0))
    assert clock.dense_time(0, 3, 3) == pytest.approx(base + 3.0)
    g.attn_layers = [2.0, 1.0]
    assert SimClock(g, TransferChannel(1.0, 0.0), Roofline(1e15, 1e15),
                    overheads=(0, 0, 0, 0, 0, 0, 1.0)).dense_time(0, 3, 3) == pytest.approx(6.0, abs=1e-9)
    hw = HardwareConfig(layer_token_overhead_us=2.0)
    assert SimClock.from_hardware(g, hw).layer_token_overhead == 2e-6


def test_fidelity_times_its_cells_at_the_profiles_thread_settings(tmp_path, monkeypatch):
    """A profile keeps the placement it was fitted at (calibrated_on.threads, pin); fidelity's cells run there
    -- the execution section every cell installs, the header, the report's placement -- and a profile without
    them runs at auto, unpinned (issue 56)."""
    import os

    import specmd.commands.calibrate.measure as meas
    import specmd.commands.calibrate.fidelity as fid
    from specmd.commands.calibrate.profile import profile_yaml
    from specmd.machine import CorePlan, can_pin, core_budget

    cores = core_budget()[0]
    pin = can_pin() and len(os.sched_getaffinity(0)) >= 2
    seen = {}
    monkeypatch.setattr(meas, "speed_probe", lambda dev: {"kernel_us": 1.0, "python_us": 1.0})

    def measure(hw, grid, repeats, prompt, decodes, device, log, execution):
        seen["execution"] = execution
        seen["affinity"] = os.sched_getaffinity(0)  # (the compute thread, while the grid runs)
        return {}, {}

    monkeypatch.setattr(fid, "measure", measure)
    monkeypatch.setattr(fid, "summarize", lambda cells, meta: {})
    said = []
    for on, want in (({}, (CorePlan.plan().threads, False)), ({"threads": 1, "pin": pin}, (1, pin)),
                     ({"threads": 1000}, (cores, False))):
        path = tmp_path / "p.yaml"
        path.write_text(profile_yaml("p", {"bandwidth_gbps": 5.0, "calibrated_on": on}, ["test"]))
        report = fid.fidelity(str(path), quick=True, log=said.append)
        assert (seen["execution"]["threads"], seen["execution"]["pin"]) == want, on
        assert (report["placement"]["threads"], report["placement"]["pin"]) == want
        assert f"at the profile's {want[0]} compute thread" in said[-1] and ("pinned: compute cores" in said[-1]) == want[1]
        if want[1]:
            assert seen["affinity"] == set(report["placement"]["compute_cores"])
    assert report["machine"]["usable_cores"] == cores
    path.write_text(profile_yaml("p", {"bandwidth_gbps": 5.0, "calibrated_on": {"threads": "many"}}, ["test"]))
    with pytest.raises(ConfigError, match=r'calibrated_on.threads is "many", not a whole number in 1\.\.1024'):
        fid.fidelity(str(path), quick=True, log=said.append)  # (a damaged profile: one line naming the key)


def test_a_timed_run_at_other_thread_settings_than_its_profile_warns_and_records_its_placement(tmp_path, caplog):
    """An offloaded run whose profile was fitted at other threads or pinning says so, one line each, and its
    results record where its threads ran and the machine's speed as it started (issue 56); a simulated run's own
    threads change no simulated number: no thread warning there."""
    import json
    import logging

    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute
    from specmd.machine import CorePlan

    auto = CorePlan.plan().threads
    said = {}
    for execution in ("offload", "simulated"):
        overrides = ["model=tiny", "eval.tasks=[]", "logger=none", f"execution={execution}",
                     f"hardware.calibrated_on={{threads: {auto + 6}, pin: true}}"]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specmd"):
            res = execute(cfg, run_dir=str(tmp_path / execution), overrides=overrides)
        said[execution] = [r.getMessage() for r in caplog.records if "calibrated" in r.getMessage()]
        m = json.loads((tmp_path / execution / "results.json").read_text())["provenance"]["machine"]
        assert res["provenance"]["machine"] == m
    assert said["offload"] == [f"hardware=a100_pcie was calibrated with threads {auto + 6}; this run's is {auto}",
                               "hardware=a100_pcie was calibrated with pin True; this run's is False"]
    assert said["simulated"] == []
    off = json.loads((tmp_path / "offload" / "results.json").read_text())["provenance"]["machine"]
    assert off["placement"] == CorePlan.plan().record() and set(off["speed_probe"]) == {"kernel_us", "python_us"}
    assert "placement" not in json.loads((tmp_path / "simulated" / "results.json").read_text())["provenance"]["machine"]
