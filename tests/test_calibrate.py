"""specmd calibrate, the hardware profile it writes, the user config directory on Hydra's search path, and
the fixed costs of the simulated clock it fits."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT


def _env(tmp_path, **extra):
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SPECMD_CONFIG=str(tmp_path / "cfg"),
                **extra)


@pytest.mark.slow  # (21 s: a real calibration; the fits and overheads stay in the default run)
def test_quick_calibration_profile_is_used_by_name(tmp_path, mirror):
    """calibrate --quick writes <user dir>/hardware/<name>.yaml (+ _disk); hardware=<name> then composes and
    runs with no hydra.searchpath (the plugin puts the user dir on the search path); the profile's figures
    are what results.json's config holds."""
    env = _env(tmp_path, SPECMD_DATA_MIRROR=str(mirror))
    r = subprocess.run([sys.executable, "-m", "specmd", "calibrate", "--quick", "--name", "mybox"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = tmp_path / "cfg" / "hardware" / "mybox.yaml"
    assert prof.is_file() and (tmp_path / "cfg" / "hardware" / "mybox_disk.yaml").is_file()
    text = prof.read_text()
    bw = float(next(l for l in text.splitlines() if l.startswith("bandwidth_gbps:")).split(":")[1])
    assert bw > 0.1  # GB/s of a host memory copy
    r = subprocess.run([sys.executable, "-m", "specmd", "hardware=mybox", "model=tiny", "eval.tasks=[wikitext]",
                        "eval.limit=1", "eval.max_length=64", "execution=offload",
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["config"]["hardware"]["name"] == "mybox"
    assert abs(res["config"]["hardware"]["bandwidth_gbps"] - bw) < 1e-3 * bw
    assert res["wall"]["executor"] == "offload" and res["wall"]["transfers"] > 0
    assert "measured/simulated" in r.stdout


def test_out_dir_profile_needs_searchpath(tmp_path):
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.calibrate import _yaml

    hw = tmp_path / "prof" / "hardware"
    hw.mkdir(parents=True)
    (hw / "lab.yaml").write_text(_yaml("lab", {"bandwidth_gbps": 3.5, "latency_us": 2.0}, ["test"]))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hardware=lab", f"hydra.searchpath=[file://{tmp_path / 'prof'}]"])
    assert cfg.hardware.bandwidth_gbps == 3.5 and cfg.hardware.name == "lab"


def test_link_fit_recovers_latency_and_bandwidth():
    from specmd.calibrate import _fit_link, _nnls

    pts = [(n, 20e-6 + n / 8e9) for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24)]
    bw, lat = _fit_link(pts)
    assert abs(bw - 8e9) / 8e9 < 1e-6 and abs(lat - 20e-6) < 1e-9
    X = np.array([[1, 1, 8, 0], [1, 40, 64, 30], [1, 1, 8, 5], [1, 90, 64, 60], [1, 1, 9, 2]], dtype=float)
    coef = np.array([5e-3, 1e-4, 2e-5, 3e-5])  # the fit works on any number of columns
    got = _nnls(X, X @ coef)
    assert np.allclose(got, coef, rtol=1e-6)
    assert (_nnls(X, -(X @ coef)) >= 0).all()  # never a negative cost


def test_overheads_charged_exactly():
    """Each fixed cost adds exactly its figure per decoder layer / token / expert run / transfer issued."""
    from specmd.engine import Engine, LiveRecord
    from specmd.compose import spec_of
    from specmd.engine.geometry import Geometry
    from specmd.engine.record import Scoring
    from specmd.hardware import HardwareConfig

    g = Geometry(num_layers=2, num_experts=8, top_k=2, expert_bytes=1000, total_bytes=2 * 8 * 1000 * 2,
                 attn_layers=[1, 1])

    def run(prefetch="none", miss="fetch", store=None, **over):
        eng = Engine(g, spec_of(hardware=HardwareConfig(capacity=0.2, **over), prefetch=prefetch, miss=miss),
                     store)
        eng.begin_pass("prefill", 3, 3)
        for layer in range(2):
            idx = torch.tensor([[0, 1], [1, 2], [0, 2]])
            rec = LiveRecord(layer, torch.zeros(3, 8), torch.full((3, 2), 0.5), idx, Scoring(False, True, 1.0),
                             lambda target, idx=idx: (torch.full((3, 8), 1 / 8), idx))
            eng.route(rec)
            eng.layer(rec)
        eng.end_pass()
        return eng.results()["timing"]["total_s"], eng.results()["cache"], eng.predictions

    base, cache, _ = run()
    transfers = cache["misses"]  # every miss is one demand transfer here (no prefetch)
    assert transfers == 6
    assert run(layer_overhead_us=100)[0] == pytest.approx(base + 2 * 100e-6, abs=1e-12)  # 2 decoder layers
    assert run(token_overhead_us=10)[0] == pytest.approx(base + 3 * 10e-6, abs=1e-12)
    assert run(expert_overhead_us=7)[0] == pytest.approx(base + 6 * 7e-6, abs=1e-12)  # 3 experts x 2 layers
    # a layer call's demand fetches are one copy job (the offload executor batches them): 2 calls, 2 issues
    assert run(transfer_issue_us=5)[0] == pytest.approx(base + 2 * 5e-6, abs=1e-12)
    assert run(predict_overhead_us=9)[0] == base  # no prefetcher: no prediction charged
    assert run(unpack_overhead_us=11)[0] == base  # every expert runs native: nothing unpacked
    from specmd.quant.base import ExpertStore

    low = dict(miss={"name": "fetch", "precision": "int4"}, store=ExpertStore(16, 1000, {"int4": 300}))
    lbase = run(**low)[0]  # every expert fetched at int4: 3 experts x 2 layers run unpacked
    assert run(unpack_overhead_us=11, **low)[0] == pytest.approx(lbase + 6 * 11e-6, abs=1e-12)
    fast = dict(bandwidth_gbps=1e9, latency_us=0.0)  # instant transfers: no stall moves with the extra compute
    pbase, _, predictions = run("topk", **fast)
    assert predictions == 1  # layer 0 predicts layer 1
    assert run("topk", predict_overhead_us=9, **fast)[0] == pytest.approx(pbase + predictions * 9e-6, abs=1e-12)
    # a policy's decision cost: charged per layer call (2 here) for the stack's own policies only
    assert run(policy_overhead_us={"eviction/lru": 40.0})[0] == pytest.approx(base + 2 * 40e-6, abs=1e-12)
    assert run(policy_overhead_us={"eviction/lru": 40.0, "prefetch/none": 3.0, "prefetch/score": 500.0,
                                   "eviction/fifo": 70.0})[0] == pytest.approx(base + 2 * 43e-6, abs=1e-12)


@pytest.mark.parametrize("table,match", [({"score": 1.0}, "'<group>/<policy>'"), ({"cache/lru": 1.0}, "group one of"),
                                         ({"prefetch/score": float("nan")}, "finite number"),
                                         ({"prefetch/score": -2.0}, "finite number"), (7, "must be a mapping")])
def test_bad_policy_overheads_rejected(table, match):
    from specmd.errors import ConfigError
    from specmd.hardware import HardwareConfig

    with pytest.raises(ConfigError, match=match):
        HardwareConfig(policy_overhead_us=table)


def test_policy_overhead_names_a_registered_policy():
    from specmd.app import check_policy_overheads
    from specmd.errors import ConfigError

    check_policy_overheads({"prefetch/score": 1.0, "eviction/least_stale": 2.0})
    with pytest.raises(ConfigError, match=r"'prefetch/scor' names no prefetch policy; valid: .*score"):
        check_policy_overheads({"prefetch/scor": 1.0})


def test_policy_decisions_measured_per_layer_call():
    """calibrate times every built-in eviction, prefetch and miss policy on the engine: a finite cost >= 0 for
    each one a live generation can run, the oracles named with the reason. How large a cost is (score
    prefetch dearer than lru+topk) is a timing, which `specmd calibrate` prints as a figure: asserting it
    here failed on a saturated machine."""
    from specmd.calibrate import measure_policies
    from specmd.hardware import HardwareConfig
    from specmd.policies import REGISTRIES

    costs, skipped = measure_policies("tiny", dict(vars(HardwareConfig())), torch.device("cpu"), new_tokens=4,
                                      reps=1, log=lambda *_: None)
    expect = {f"{g}/{n}" for g in ("eviction", "prefetch", "miss") for n in REGISTRIES[g].names()} - {
        "eviction/lru", "prefetch/topk", "prefetch/none", "miss/fetch"}
    assert set(costs) | set(skipped) == expect and not set(costs) & set(skipped)
    assert {"eviction/belady", "prefetch/oracle"} <= set(skipped) and "future" in skipped["eviction/belady"]
    assert all(v >= 0 and np.isfinite(v) for v in costs.values())


@pytest.mark.parametrize("key,value", [("expert_overhead_us", -1.0), ("transfer_issue_us", float("inf")),
                                       ("layer_overhead_us", float("nan"))])
def test_bad_overheads_rejected(key, value):
    from specmd.errors import ConfigError
    from specmd.hardware import HardwareConfig

    with pytest.raises(ConfigError, match=key):
        HardwareConfig(**{key: value})


@pytest.mark.slow
def test_overhead_fit_predicts_its_passes():
    """The fitted overheads make the simulated clock predict the offloaded passes they were fitted on: every
    prefill size and the decodes, within a relative RMS error that a bad fit (one term forced to zero or a
    single noisy pass) does not reach on a quiet machine."""
    from specmd.calibrate import PROMPTS, fit_overheads, measure_compute

    flops, mem = measure_compute(torch.device("cpu"))
    hw = {"capacity": 0.05, "bandwidth_gbps": 10.0, "latency_us": 5.0, "peak_tflops": flops / 1e12,
          "mem_bandwidth_gbps": mem / 1e9, "host_tflops": flops / 1e12, "host_mem_bandwidth_gbps": mem / 1e9}
    over, fit = fit_overheads("tiny", hw, torch.device("cpu"), new_tokens=4, reps=2)
    assert fit["passes"] == 5 * (len(PROMPTS) * 2 + 2)  # five stacks x (prefill + 1 decode per prompt, +2)
    assert all(v >= 0 and np.isfinite(v) for v in over.values())
    assert over["layer_overhead_us"] > 0 and fit["relative_rms"] < 0.2, (over, fit)


def test_ram_link_is_measured_through_the_offload_tiers_copies():
    """The link measurement copies rows of a RamTier into a slot as a fetch does (it broke silently when the
    tier's layout changed: the quick calibration that would have noticed is a slow test)."""
    from specmd.calibrate import measure_ram_link

    bw, lat = measure_ram_link(torch.device("cpu"), reps=2, sizes=(64 << 10, 256 << 10, 1 << 20), source_bytes=4 << 20)
    assert np.isfinite(bw) and bw > 1e8 and 0.0 <= lat < 0.1


def test_host_costs_fitted_from_the_host_banks_of_a_run():
    from types import SimpleNamespace

    from specmd.calibrate import _fit_host

    geom = SimpleNamespace(expert_params=1000, expert_bytes=4000)
    hw = {"host_tflops": 1e-6, "host_mem_bandwidth_gbps": 1.0}  # 2 pairs of 1000 params: 4 ms; 4 kB: 4 us
    calls = []
    for n, rows in ((1, 1), (2, 2), (4, 9), (3, 30), (8, 8), (1, 64)):
        roof = max(2.0 * rows * 1000 / 1e6, n * 4000 / 1e9)
        calls.append((n, rows, roof + 30e-6 + n * 5e-6 + rows * 1e-6))
    got = _fit_host(calls, geom, hw)
    assert got["host_call_overhead_us"] == pytest.approx(30.0, rel=1e-6)
    assert got["host_expert_overhead_us"] == pytest.approx(5.0, rel=1e-6)
    assert got["host_token_overhead_us"] == pytest.approx(1.0, rel=1e-6)
    assert _fit_host([], geom, hw) == {}


def test_host_experts_timed_on_the_models_own_experts():
    from specmd.calibrate import _load, measure_host_experts

    model, cfg = _load("tiny")
    hw = {"host_tflops": 0.1, "host_mem_bandwidth_gbps": 20.0}
    costs, cases = measure_host_experts(model, cfg.family, hw, torch.device("cpu"), reps=2)
    assert set(costs) == {"host_call_overhead_us", "host_expert_overhead_us", "host_token_overhead_us"}
    assert all(np.isfinite(v) and v >= 0 for v in costs.values())
    assert len(cases) == 6 and all(v > 0 for v in cases.values())


def test_host_runners_account_each_bank():
    from specmd.executor.hostwork import HOST_COMPUTE

    for name, cls in HOST_COMPUTE.items():
        host = cls()
        host.calls = []
        x = torch.zeros(5, 3)
        try:
            assert host.submit(lambda *a: a[1].sum() + 1, None, x, None, None, ([2, 5], [0, 3])).result() == 1
            assert host.submit(lambda *a: 7, None, x[:2], None, None, torch.tensor([1, 1, 2, 4, 5])).result() == 7
        finally:
            host.close()
        # (experts, rows, seconds): the looped variant's groups, and the grouped one's end rows per slot (4 slots
        # with rows: the second is empty)
        assert [c[:2] for c in host.calls] == [(2, 5), (4, 2)], name
        assert host.runs == 2 and host.busy_s >= sum(c[2] for c in host.calls) * 0.999


def test_steady_host_allocator_applies_once():
    import ctypes.util

    from specmd.executor.base import steady_host_allocator

    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library to tune")
    assert steady_host_allocator(prefault=16 << 20) is True
    assert steady_host_allocator() is True  # (once per process)
