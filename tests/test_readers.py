"""Reading back what specmd wrote (specmd/readers.py, issue 57): a damaged copy of every file kind is one line
naming the file, the key and what was expected (exit 2), never an AttributeError or KeyError counted as a bug;
report and status skip such a run with the reason; a rescued record is named and read."""

import json
import re

import pytest

from specmd.errors import ConfigError, DamagedFile
from specmd.ending import classify, kept_note
from specmd.readers import FAILED, RESULTS, Opt, check, read_failed, read_json, read_results

WRONG = {dict: [1, 2], str: 3, float: "x", int: 2.5, bool: "yes"}


def _wrong(spec):
    spec = spec.spec if isinstance(spec, Opt) else spec
    return WRONG[dict] if isinstance(spec, dict) else WRONG.get(spec, [1])


@pytest.mark.parametrize("schema,reader,name,base", [(RESULTS, read_results, "results.json", {}),
                                                     (FAILED, read_failed, "failed.json", {"error": "RuntimeError: x"})])
def test_every_key_of_a_run_record_with_a_wrong_type_is_named(tmp_path, schema, reader, name, base):
    """Derived from the schemas: each key in turn holds a value of another type (the others valid)."""
    path = tmp_path / name
    path.write_text(json.dumps(base))
    assert reader(path) == base
    for key, spec in schema.items():
        path.write_text(json.dumps({**base, key: _wrong(spec)}))
        with pytest.raises(DamagedFile, match=rf"{name}: {key} is .*, not ") as err:
            reader(path)
        assert classify(err.value)[0] == 2 and not classify(err.value)[2]  # exit 2, not a bug


@pytest.mark.parametrize("text,words", [("{not json", "not readable as JSON"), ("[1, 2]", "not a JSON object (a list)"),
                                        ("null", "not a JSON object (a null)"), (b"\xff\xfe", "not readable as JSON"),
                                        ("[" * 100_000 + "]" * 100_000, "RecursionError")])  # (nested too deep)
def test_a_file_that_is_no_json_object_is_named(tmp_path, text, words):
    path = tmp_path / "results.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DamagedFile, match=re.escape(words)):
        read_json(path)
    with pytest.raises(FileNotFoundError):  # (a missing file is the caller's to judge)
        read_json(tmp_path / "absent.json")


def test_nested_sections_are_checked_and_numbers_left_to_report(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {}, "tasks": {}, "cache": {"oracle": 3}}))
    with pytest.raises(DamagedFile, match="cache.oracle is 3, not a mapping"):
        read_results(path)
    path.write_text(json.dumps({"config": {}, "cache": {"union": {"decode": "x"}}}))
    with pytest.raises(DamagedFile, match='cache.union.decode is "x", not a mapping'):
        read_results(path)
    path.write_text('{"config": {}, "cache": {"hit_rate": NaN, "collision_rate": "0.1"}}')
    assert read_results(path)["cache"]["collision_rate"] == "0.1"  # report names such values, with the key
    assert check({"a": None}, {"a": Opt(int)}, path) == {"a": None}


def test_resume_keeps_a_damaged_results_json_aside_and_runs_again(tmp_path):
    from specmd.jobs import finished

    (tmp_path / "results.json").write_text(json.dumps({"config_hash": ["h"], "cache": None}))
    assert finished(tmp_path, "h") is None
    assert (tmp_path / "results.unreadable.json").exists() and not (tmp_path / "results.json").exists()


def test_report_and_status_skip_a_run_whose_cache_is_no_mapping_and_go_on(tmp_path, capsys):
    from specmd.commands.report import main
    from specmd.commands.status import main as status_main
    from tests.commands.test_report_robust import job_dir, make_sweep

    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02}, raw={("lru", "2"): "[1]"})
    assert main([str(s), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert f"{job_dir(s, 'lru', '2')}/results.json: cache is [1], not a mapping or null" not in err  # (Opt: mapping)
    assert f"{job_dir(s, 'lru', '2')}/results.json: cache is [1], not a mapping: the job counts as not finished" in err
    assert "Traceback" not in err
    status_main([str(s)])
    assert "Traceback" not in capsys.readouterr().err


def test_status_reads_a_rescued_failed_json_and_calls_the_job_failed_with_where(tmp_path, monkeypatch):
    import tempfile

    from specmd.sweeps import _job
    from specmd.sweeps import job_state
    from specmd.jobs import rescue

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    run = tmp_path / "sweep" / "3"
    run.mkdir(parents=True)
    kept = rescue(run, "failed.json", {"stage": "write", "kind": "error", "error": "OSError: [Errno 28] full"})
    job = _job(["eviction=lru"], run, {}, [])
    assert job.status == "failed" and job_state(job, live=False) == "failed"
    assert job.error == f"OSError: [Errno 28] full (its record is kept in {kept}: the run directory could not take it)"
    other = tmp_path / "other" / "3"  # another directory of the same name: not its record
    other.mkdir(parents=True)
    assert _job(["eviction=lru"], other, {}, []).status == "missing"


def test_the_line_the_user_reads_names_a_rescued_record_whatever_failed_first():
    from specmd.signals import Interrupted
    import signal

    for exc in (ConfigError("bad"), Interrupted(signal.SIGTERM), RuntimeError("boom")):
        exc.specmd_failed = "/tmp/specmd-rescue/3-12-ab/failed.json"
        assert kept_note(exc) == " (its record is kept in /tmp/specmd-rescue/3-12-ab/failed.json: the run directory " \
                                 "could not take it)"
        exc.specmd_failed = "/runs/3/failed.json"
        assert kept_note(exc) == ""


# ---- kinds with their own home ---------------------------------------------------------------------------------
@pytest.mark.parametrize("on,key", [({"kernel_bytes": 5}, "kernel_bytes"), ({"kernel_bytes": [1]}, "kernel_bytes"),
                                    ({"speed": [1]}, "speed"), ({"speed": {"kernel_us": "a"}}, "speed"),
                                    ({"threads": 0}, "threads"), ({"pin": "yes"}, "pin"), ({"host": 3}, "host")])
def test_a_damaged_calibrated_on_is_a_config_error_naming_its_key(on, key):
    from specmd.hardware import HardwareConfig

    with pytest.raises(ConfigError, match=rf"hardware.calibrated_on.{key} is .*`specmd calibrate` writes it again"):
        HardwareConfig(calibrated_on=on)


def test_a_damaged_measurement_store_is_measured_again_and_says_why(tmp_path, monkeypatch):
    import specmd.commands.calibrate.measure as meas

    monkeypatch.setattr(meas, "disk_probe_path", lambda: tmp_path / "probe")
    key = {"model": "tiny"}
    ms = meas.Measurements(key, remeasure=False)
    ms.path.write_text("[1, 2]")
    ms = meas.Measurements(key, remeasure=False)
    assert ms.data == {} and "not a JSON object (a list)" in ms.dropped[0]
    good = {"bw": 1e9, "lat": 1e-5, "report": {}}
    ms.path.write_text(json.dumps({"key": key, "stages": {"link": good, "disk": 5, "contention": [0.5, {}],
                                                          "host_experts": ["x", {}],
                                                          "compute": {"flops": 1e9, "mem": -5, "kernel": {},
                                                                      "hflops": 1e9, "hmem": 1e9, "host_kernel": {}}}}))
    ms = meas.Measurements(key, remeasure=False)
    assert set(ms.data) == {"link", "contention"}
    assert any("stages.disk is 5, not a mapping" in d for d in ms.dropped)
    assert any("stages.host_experts" in d for d in ms.dropped)
    assert any("stages.compute.mem is -5, not a finite number > 0" in d for d in ms.dropped)  # (went into a profile)
    assert ms.stage("disk", lambda: good) == good and ms.stage("link", lambda: 1 / 0) == good  # measured; reused


@pytest.mark.parametrize("change,words", [({"source": [1]}, "source is [1], not a mapping"),
                                          ({"logits": "fp64"}, 'logits is "fp64", not one of fp32, fp16, none'),
                                          ({"index_dtype": "int128"}, 'index_dtype is "int128", not an integer dtype'),
                                          ({"store": {"native_bits": 32, "bytes_of": {"native": -1}}},
                                           "store.bytes_of.native is -1"),  # (replayed at a hit rate of 0.79)
                                          ({"geometry": {"num_layers": 4, "num_experts": 64, "top_k": 8,
                                                         "expert_bytes": 2**70, "total_bytes": 46416896}},
                                           "exceeds geometry.total_bytes=46416896"),
                                          ({"depth": -1}, "depth is -1, not a whole number >= 0"),
                                          ({"geometry": {"num_layers": "4", "num_experts": 64, "top_k": 8}},
                                           'geometry.num_layers is "4", not a whole number >= 1')])
def test_a_damaged_trace_meta_is_named(tmp_path, change, words):
    import shutil

    from specmd.replay.trace import read_trace

    src = __import__("pathlib").Path(__file__).parent / "data" / "embedded_trace"
    shutil.copytree(src, tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    (tmp_path / "t" / "meta.json").write_text(json.dumps({**meta, **change}))
    with pytest.raises(ConfigError, match=re.escape(words)):
        read_trace(tmp_path / "t")


def test_fidelity_on_a_profile_from_elsewhere_says_what_differs():
    from specmd.commands.calibrate.fidelity import elsewhere

    lines = elsewhere({"bandwidth_gbps": 5.0, "calibrated_on": {"host": "gpu-node-7", "device": "cuda",
                                                                "torch": "2.11.0+cu130"}}, "p", "cpu")
    assert [x.split(" was calibrated with ")[1].split(";")[0] for x in lines] == \
        ["host gpu-node-7", "device cuda", "torch 2.11.0+cu130"]
    assert elsewhere({"bandwidth_gbps": 5.0}, "p", "cpu") == []  # (a hand-written profile: nothing to compare)


def test_a_damaged_batch_size_in_a_traces_meta_is_named(tmp_path):
    import shutil

    from specmd.replay.config import ReplayConfig, open_trace

    src = __import__("pathlib").Path(__file__).parent / "data" / "embedded_trace"
    shutil.copytree(src, tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    (tmp_path / "t" / "meta.json").write_text(json.dumps({**meta, "source": {"batch_size": "two"}}))
    with pytest.raises(ConfigError, match=re.escape("meta.json: source.batch_size is 'two', not a whole number >= 1")):
        open_trace(ReplayConfig(trace=str(tmp_path / "t"), batch=2))


def test_a_failed_json_without_its_error_is_damaged(tmp_path):
    (tmp_path / "failed.json").write_text("{}")
    with pytest.raises(DamagedFile, match="error is missing"):
        read_failed(tmp_path / "failed.json")


def test_figures_no_device_has_are_calibrates_own_fault_and_not_reused(tmp_path, monkeypatch):
    """(An H200's link timed to issue: 9.4e4 GB/s, then a ConfigError blaming hardware.small_copy_gbps, and the
    saved stage would have been reused by every later calibrate.)"""
    import specmd.commands.calibrate.measure as meas
    from specmd.commands.calibrate.command import check_measured

    monkeypatch.setattr(meas, "disk_probe_path", lambda: tmp_path / "probe")
    ms = meas.Measurements({"k": 1}, remeasure=False)
    ms.stage("link", lambda: {"bw": 1e9, "lat": 1e-5, "report": {}})
    with pytest.raises(RuntimeError, match=r"a measurement fault, not a setting.*measures anew") as err:
        check_measured({"bandwidth_gbps": 9.4e4, "small_copy_gbps": 1.28e23, "small_copy_mb": 0.262}, ms)
    assert "small_copy_gbps" in str(err.value) and not ms.path.exists()
    assert classify(err.value)[2]  # a bug (a traceback file), not the user's input
    check_measured({"bandwidth_gbps": 20.0}, meas.Measurements({"k": 1}, remeasure=False))  # a real machine's
