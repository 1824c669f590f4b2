"""specmd calibrate, the hardware profile it writes, the user config directory on Hydra's search path, and
the fixed costs of the simulated clock it fits."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specmd.ending import guarded
import torch

from tests.conftest import ROOT


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
    from specmd.commands.calibrate.profile import profile_yaml

    hw = tmp_path / "prof" / "hardware"
    hw.mkdir(parents=True)
    (hw / "lab.yaml").write_text(profile_yaml("lab", {"bandwidth_gbps": 3.5, "latency_us": 2.0}, ["test"]))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hardware=lab", f"hydra.searchpath=[file://{tmp_path / 'prof'}]"])
    assert cfg.hardware.bandwidth_gbps == 3.5 and cfg.hardware.name == "lab"


def test_link_fit_recovers_latency_and_bandwidth():
    from specmd.commands.calibrate.fit import fit_link, nnls

    pts = [(n, 20e-6 + n / 8e9) for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24)]
    bw, lat = fit_link(pts)
    assert abs(bw - 8e9) / 8e9 < 1e-6 and abs(lat - 20e-6) < 1e-9
    X = np.array([[1, 1, 8, 0], [1, 40, 64, 30], [1, 1, 8, 5], [1, 90, 64, 60], [1, 1, 9, 2]], dtype=float)
    coef = np.array([5e-3, 1e-4, 2e-5, 3e-5])  # the fit works on any number of columns
    got = nnls(X, X @ coef)
    assert np.allclose(got, coef, rtol=1e-6)
    assert (nnls(X, -(X @ coef)) >= 0).all()  # never a negative cost


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
    assert run(place_overhead_us=13)[0] == pytest.approx(base + 6 * 13e-6, abs=1e-12)  # each miss placed once
    from specmd.quant.base import ExpertStore

    low = dict(miss={"name": "fetch", "precision": "int4"}, store=ExpertStore(16, 1000, {"int4": 300}))
    lbase = run(**low)[0]  # every expert fetched at int4: 3 experts x 2 layers run unpacked
    assert run(unpack_overhead_us=11, **low)[0] == pytest.approx(lbase + 6 * 11e-6, abs=1e-12)
    fast = dict(bandwidth_gbps=1e9, latency_us=0.0)  # instant transfers: no stall moves with the extra compute
    pbase, _, predictions = run("topk", **fast)
    assert predictions == 1  # layer 0 predicts layer 1
    assert run("topk", predict_overhead_us=9, **fast)[0] == pytest.approx(pbase + predictions * 9e-6, abs=1e-12)
    # an expert placed by a prefetch is placed once: its demand, if it is late, places nothing more
    pc = run("topk", **fast)[1]
    placed = pc["misses"] + pc["prefetch_issued"] - pc["prefetch_late"]
    assert run("topk", place_overhead_us=13, **fast)[0] == pytest.approx(pbase + placed * 13e-6, abs=1e-12)
    # streamed calls (3 of 8 experts >= 0.3): layer 0's 3 misses moved at once, layer 1's 8 staged ahead -- each
    # expert through the staging area placed once (11)
    sbase, sc, _ = run(stream_layers=0.3, **fast)
    assert sc["layer_streams"] == 2 and sc["bytes_stream"] == 11 * 1000
    assert run(stream_layers=0.3, place_overhead_us=13, **fast)[0] == pytest.approx(sbase + 11 * 13e-6, abs=1e-12)
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
    from specmd.checks import check_policy_overheads
    from specmd.errors import ConfigError

    check_policy_overheads({"prefetch/score": 1.0, "eviction/least_stale": 2.0})
    with pytest.raises(ConfigError, match=r"'prefetch/scor' names no prefetch policy; valid: .*score"):
        check_policy_overheads({"prefetch/scor": 1.0})


def test_policy_decisions_measured_per_layer_call():
    """calibrate times every built-in eviction, prefetch and miss policy on the engine: a finite cost >= 0 for
    each one a live generation can run, the oracles named with the reason. How large a cost is (score
    prefetch dearer than lru+topk) is a timing, which `specmd calibrate` prints as a figure: asserting it
    here failed on a saturated machine."""
    from specmd.commands.calibrate.measure import measure_policies
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
    from specmd.commands.calibrate.fit import PROMPTS, fit_overheads
    from specmd.commands.calibrate.measure import measure_compute

    flops, mem, _ = measure_compute(torch.device("cpu"))
    hw = {"capacity": 0.05, "bandwidth_gbps": 10.0, "latency_us": 5.0, "peak_tflops": flops / 1e12,
          "mem_bandwidth_gbps": mem / 1e9, "host_tflops": flops / 1e12, "host_mem_bandwidth_gbps": mem / 1e9}
    over, fit = fit_overheads("tiny", hw, torch.device("cpu"), new_tokens=4, reps=2)
    assert fit["passes"] == 6 * (len(PROMPTS) * 2 + 2)  # six stacks x (prefill + 1 decode per prompt, +2)
    assert all(v >= 0 and np.isfinite(v) for v in over.values())
    assert over["layer_overhead_us"] > 0 and fit["relative_rms"] < 0.2, (over, fit)


def test_ram_link_is_measured_through_the_offload_tiers_copies():
    """The link measurement copies rows of a RamTier into a slot as a fetch does (it broke silently when the
    tier's layout changed: the quick calibration that would have noticed is a slow test)."""
    from specmd.commands.calibrate.measure import measure_ram_link

    bw, lat = measure_ram_link(torch.device("cpu"), reps=2, sizes=(64 << 10, 256 << 10, 1 << 20), source_bytes=4 << 20)
    assert np.isfinite(bw) and bw > 1e8 and 0.0 <= lat < 0.1


def test_host_costs_fitted_from_the_host_banks_of_a_run():
    from types import SimpleNamespace

    from specmd.commands.calibrate.fit import fit_host

    geom = SimpleNamespace(expert_params=1000, expert_bytes=4000)
    hw = {"host_tflops": 1e-6, "host_mem_bandwidth_gbps": 1.0}  # 2 pairs of 1000 params: 4 ms; 4 kB: 4 us
    calls = []
    for n, rows in ((1, 1), (2, 2), (4, 9), (3, 30), (8, 8), (1, 64)):
        roof = max(2.0 * rows * 1000 / 1e6, n * 4000 / 1e9)
        calls.append((n, rows, roof + 30e-6 + n * 5e-6 + rows * 1e-6))
    got = fit_host(calls, geom, hw)
    assert got["host_call_overhead_us"] == pytest.approx(30.0, rel=1e-6)
    assert got["host_expert_overhead_us"] == pytest.approx(5.0, rel=1e-6)
    assert got["host_token_overhead_us"] == pytest.approx(1.0, rel=1e-6)
    assert fit_host([], geom, hw) == {}


def test_host_experts_timed_on_the_models_own_experts():
    from specmd.models.loader import load_configured
    from specmd.commands.calibrate.measure import measure_host_experts

    model, cfg = load_configured("tiny")
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


# ---- what calibrate checks before it measures, and how it writes (issue 38) -------------------------------
@pytest.fixture
def no_measuring(monkeypatch):
    """Every measurement of calibrate fails the test: what these tests check must be rejected before."""
    import specmd.commands.calibrate.command as cal

    def measured(*a, **k):
        raise AssertionError("calibrate measured before rejecting its arguments")

    for f in ("measure_ram_link", "measure_disk_link", "measure_compute", "measure_contention", "measure_host_experts",
              "speed_probe",
              "measure_policies", "fit_overheads", "check_profile", "load_configured"):
        monkeypatch.setattr(cal, f, measured)


@pytest.fixture
def stub_measuring(monkeypatch, tmp_path):
    """calibrate --quick in milliseconds: fixed figures instead of measurements (what is under test is what
    it checks and writes, not what it measures)."""
    from types import SimpleNamespace

    import specmd.commands.calibrate.command as cal
    from specmd.executor import base

    # (saved measurements: this test's own, beside its directory, whose every file the tests list)
    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))
    monkeypatch.setattr(base, "steady_host_allocator", lambda *a, **k: True)
    link_report = {"points": [], "median_abs_err": 0.0, "max_abs_err": 0.0}
    monkeypatch.setattr(cal, "measure_ram_link", lambda dev, report=None, **k: (report.update(link_report), (8e9, 5e-6))[1])
    monkeypatch.setattr(cal, "measure_disk_link", lambda dev, path, report=None, **k: (report.update(link_report),
                                                                                   (2e9, 50e-6))[1])
    kernel = {"serial": 0.5, "launch_us": 1.0, "gemv_bw": 2e10, "points": [{"bytes": 1e5}, {"bytes": 5e7}], "median_abs_err": 0.0,
              "max_abs_err": 0.0}
    monkeypatch.setattr(cal, "measure_compute", lambda dev: (1e11, 2e10, kernel))
    monkeypatch.setattr(cal, "speed_probe", lambda dev: {"kernel_us": 100.0, "python_us": 50.0})
    monkeypatch.setattr(cal, "measure_contention", lambda dev, hw, **k: (0.25, {"host_ms": 1.0, "link_ms": 1.0,
                                                                            "together_ms": 1.25}))
    monkeypatch.setattr(cal, "load_configured", lambda model: (None, SimpleNamespace(family="olmoe")))
    monkeypatch.setattr(cal, "measure_host_experts", lambda *a, **k: (
        {"host_call_overhead_us": 1.0, "host_expert_overhead_us": 2.0, "host_token_overhead_us": 3.0}, {}))


def _leftovers(d):
    """Every file under ``d`` (the profiles and any temporary file beside them)."""
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) if d.exists() else []


@pytest.mark.parametrize("name,match", [
    ("../../x", "not a path"), ("a/b", "not a path"), ("a\\b", "not a path"), ("..", "not a path"),
    (".", "not a path"), ("a100_pcie", "selects the shipped profile specmd/conf/hardware/a100_pcie.yaml"),
    ("A100_PCIE", "shipped profile"), ("nvme_ssd", "shipped profile"), ("a=b", "'=' would break the override"),
    ("x,y", "',' would break the override"), ("my box", "' ' would break"), ("a[1]", "'\\[' '\\]' would break"),
    ("$HOME", "'\\$' would break"), ("", "a profile needs a name"), (".hidden", "not first: . or -"),
    ("-x", "not first: . or -"), ("é", "use letters, digits"), ("x" * 101, "101 characters; at most 100"),
    ("null", "Hydra reads hardware=null as null"), ("1.5", "as the float 1.5"), ("yes", "YAML reads name: yes"),
])
def test_bad_profile_names_rejected_before_measuring(tmp_path, capsys, no_measuring, name, match):
    """--name is a file name in DIR/hardware that hardware=<name> selects: no path, no override syntax, not a
    shipped profile (specmd's configs come first on the search path); one line, exit 2, nothing written, and
    the name it suggests is itself valid."""
    from specmd.commands.calibrate.profile import check_name
    from specmd.commands.calibrate import main

    assert guarded("specmd calibrate", main, ["--out", str(tmp_path / "out"), f"--name={name}", "--quick"]) == 2  # (= : "-x" is no option)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specmd calibrate: error: --name {name!r}: "), err
    assert __import__("re").search(match, err), err
    suggested = err.rsplit("e.g. --name ", 1)[1].strip()
    assert check_name(suggested) == suggested
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()  # (../../x: not beside it either)


def test_a_shipped_profile_name_would_select_the_shipped_profile(tmp_path):
    """Why calibrate refuses a shipped name: a profile DIR/hardware/a100_pcie.yaml loses to specmd's own
    (hydra.searchpath and the user directory are searched after specmd/conf)."""
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.commands.calibrate.profile import profile_yaml

    hw = tmp_path / "hardware"
    hw.mkdir()
    (hw / "a100_pcie.yaml").write_text(profile_yaml("a100_pcie", {"bandwidth_gbps": 1234.5}, ["test"]))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hardware=a100_pcie", f"hydra.searchpath=[file://{tmp_path}]"])
    assert cfg.hardware.bandwidth_gbps != 1234.5


def test_default_name_is_a_valid_name(monkeypatch):
    import specmd.commands.calibrate.profile as cal

    for host in ("my-box.lab.example.org", "über box", "", "1", "x" * 300):
        monkeypatch.setattr(cal.platform, "node", lambda host=host: host)
        assert cal.check_name(cal.default_name()) == cal.default_name()


def test_out_that_is_no_writable_directory_rejected_before_measuring(tmp_path, capsys, no_measuring,
                                                                     monkeypatch):
    """--out an existing file, a path under a file, DIR/hardware a file, a profile path that is a directory,
    a directory that cannot be written (simulated: root writes a chmod'ed one): one line naming the path and
    what is wrong, exit 2, before any measurement."""
    from specmd.commands.calibrate import main

    f = tmp_path / "afile"
    f.write_text("x")

    def rejected(out, *match):
        assert guarded("specmd calibrate", main, ["--out", str(out), "--name", "box", "--quick"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"specmd calibrate: error: --out {out}: "), err
        for m in match:
            assert m in err, err

    rejected(f, f"{f} is a file, not a directory")
    rejected(f / "sub" / "dir", f"{f} is a file, not a directory ({f}/sub/dir/hardware cannot be created under it)")
    (tmp_path / "d" / "hardware").mkdir(parents=True)
    (tmp_path / "d" / "hardware" / "box_disk.yaml").mkdir()
    rejected(tmp_path / "d", f"{tmp_path}/d/hardware/box_disk.yaml exists and is not a file")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "hardware").write_text("x")
    rejected(tmp_path / "e", f"{tmp_path}/e/hardware is a file, not a directory")
    import tempfile

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    rejected(tmp_path / "ro", f"{tmp_path} is not writable (Permission denied)")
    assert not (tmp_path / "ro").exists()  # (the check creates nothing)


def test_a_hub_model_offline_is_a_data_error_before_measuring(tmp_path, monkeypatch, no_measuring):
    """--model olmoe (a hub checkpoint) with the hub unreachable: a DataError (the dispatcher's one line)
    before the minutes of measuring, not a traceback after them; a shipped checkpoint needs no hub."""
    import huggingface_hub

    from specmd.commands.calibrate.profile import check_model

    from specmd.commands.calibrate import main
    from specmd.errors import DataError
    from specmd.eval import mirror

    monkeypatch.setattr(mirror, "hub_reachable", lambda *a: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    with pytest.raises(DataError, match=r"--model olmoe \(model.pretrained=allenai/OLMoE-1B-7B-0924\) needs "
                                        r"the Hugging Face hub"):
        main(["--out", str(tmp_path), "--model", "olmoe", "--quick"])
    check_model("deep_olmoe")
    check_model("tiny_mixtral")  # (no checkpoint: built in code)
    assert _leftovers(tmp_path) == []


def _interrupt_mid_write(monkeypatch, after: int = 0):
    """The writer writes half of the (after+1)-th file it is given, then the job is interrupted."""
    import signal

    from specmd import results
    from specmd.signals import Interrupted

    real, calls = results._write_fd, []

    def half(fd, data):
        calls.append(fd)
        if len(calls) <= after:
            return real(fd, data)
        os.write(fd, data[: len(data) // 2])
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(results, "_write_fd", half)
    return calls


@pytest.mark.parametrize("after", [0, 1])
def test_an_interrupted_calibrate_leaves_no_half_profile(tmp_path, monkeypatch, stub_measuring, after):
    """Interrupted while writing the profile (or its _disk twin): no profile under either name, no
    temporary file, and a profile calibrated before is left as it was; uninterrupted, both are written."""
    from specmd.commands.calibrate import calibrate
    from specmd.signals import Interrupted

    calls = _interrupt_mid_write(monkeypatch, after)
    with pytest.raises(Interrupted):
        calibrate(str(tmp_path), "box", "tiny", quick=True, log=lambda m: None)
    assert len(calls) == after + 1 and _leftovers(tmp_path) == []
    (tmp_path / "hardware" / "box.yaml").write_text("name: box\n# the old one\n")
    with pytest.raises(Interrupted):
        calibrate(str(tmp_path), "box", "tiny", quick=True, log=lambda m: None)
    assert _leftovers(tmp_path) == ["hardware/box.yaml"]
    assert (tmp_path / "hardware" / "box.yaml").read_text() == "name: box\n# the old one\n"


def test_calibrate_writes_both_profiles_whole(tmp_path, stub_measuring):
    """Uninterrupted: both profiles, complete, and nothing else; the printed command selects them."""
    import shlex

    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.commands.calibrate import calibrate

    out = tmp_path / "my profiles, v2"  # (a space and a comma: quoted for the shell and for Hydra)
    said = []
    r = calibrate(str(out), "box", "tiny", quick=True, log=said.append)
    assert _leftovers(out) == ["hardware/box.yaml", "hardware/box_disk.yaml"]
    assert r["path"] == str(out / "hardware" / "box.yaml")
    use = said[-1].split("use: python -m specmd execution=offload ", 1)[1].rsplit("  [", 1)[0]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=shlex.split(use))
        assert cfg.hardware.name == "box" and cfg.hardware.bandwidth_gbps == pytest.approx(8.0)
        cfg = compose("config", overrides=shlex.split(use.replace("hardware=box", "hardware=box_disk")))
        assert cfg.hardware.bandwidth_gbps == pytest.approx(2.0)


def test_a_real_signal_while_writing_leaves_no_half_profile(tmp_path, monkeypatch, stub_measuring):
    """SIGTERM arriving mid-write under the dispatcher's handler (signals_raise): Interrupted, nothing left."""
    import signal

    import specmd.commands.calibrate as cal
    from specmd import results
    from specmd.signals import SIGNALS, Interrupted, signals_raise

    real = results._write_fd

    def killed(fd, data):
        os.write(fd, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # (the handler runs between bytecodes, here)
            pass
        real(fd, data)

    monkeypatch.setattr(results, "_write_fd", killed)
    try:
        with pytest.raises(Interrupted), signals_raise():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                pytest.skip("signals_raise armed no handler here")
            cal.calibrate(str(tmp_path), "box", "tiny", quick=True, log=lambda m: None)
    finally:
        SIGNALS.pending = 0  # (the process would have exited: the next test starts with no signal recorded)
    assert _leftovers(tmp_path) == []


def test_write_atomic_failure_leaves_no_temporary(tmp_path, monkeypatch):
    """An error in the write or in a rename (disk full, a race): the temporaries go; the disk probe of the
    link measurement is written the same way (an interrupted probe is never a short file)."""
    from specmd import results
    from specmd.commands.calibrate.measure import measure_disk_link

    real = os.replace
    n = []

    def second_fails(a, b):
        n.append(b)
        if len(n) == 2:
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="No space"):
        results.write_files([(tmp_path / "a.yaml", results.content_fill("a: 1\n")),
                             (tmp_path / "b.yaml", results.content_fill("b: 2\n"))])
    monkeypatch.setattr(os, "replace", real)
    assert _leftovers(tmp_path) == ["a.yaml"] and (tmp_path / "a.yaml").read_text() == "a: 1\n"
    _interrupt_mid_write(monkeypatch)
    from specmd.signals import Interrupted

    with pytest.raises(Interrupted):
        measure_disk_link(torch.device("cpu"), tmp_path / "probe" / "disk-probe.bin")
    assert _leftovers(tmp_path / "probe") == []


@pytest.mark.parametrize("out", ["/tmp/plain", "/tmp/o 2", "/tmp/a,b]c", "/tmp/it's", '/tmp/a"b', "/tmp/x\\y",
                                 "/tmp/e\\", '/tmp/x\\"y', "/tmp/$HOME*"])
def test_printed_command_reads_back_the_directory(out):
    """The `use:` line calibrate prints: a shell reads it as two words, and Hydra reads the search path as
    exactly the directory the profile was written to, whatever characters the path holds."""
    import shlex
    from pathlib import Path

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specmd.commands.calibrate.profile import use_command

    assert use_command("box", None) == "hardware=box"
    words = shlex.split(use_command("box", Path(out)))
    assert words[0] == "hardware=box" and len(words) == 2
    assert OverridesParser.create().parse_override(words[1]).value() == [f"file://{out}"]
