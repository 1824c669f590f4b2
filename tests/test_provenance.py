"""results.json's provenance: versions, git state and file fingerprints that change when the files do."""

import os

import torch

from specmd.provenance import CHUNK, files_fingerprint, git_state, versions


def test_versions_are_the_installed_ones():
    v = versions()
    assert v["torch"] == torch.__version__.split("+")[0] or v["torch"] == torch.__version__
    assert v["specmd"] and v["transformers"] and v["lm_eval"]


def test_git_state_of_this_checkout():
    g = git_state()
    assert g is None or (len(g["commit"]) == 40 and isinstance(g["dirty"], bool))
    assert git_state(source=__import__("pathlib").Path("/")) is None  # not a checkout


def test_fingerprint_changes_with_name_size_head_and_tail(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    big = d / "model.safetensors"
    data = bytearray(os.urandom(3 * CHUNK))
    big.write_bytes(data)
    (d / "config.json").write_text("{}")
    fp = files_fingerprint(d)
    assert fp == files_fingerprint(d) and len(fp) == 16
    seen = {fp}
    for change in ("head", "tail", "size", "name"):
        if change == "head":
            data[10] ^= 1
        elif change == "tail":
            data[-10] ^= 1
        elif change == "size":
            data = data[:-1]
        big.write_bytes(data)
        if change == "name":
            big.rename(d / "other.safetensors")
        now = files_fingerprint(d)
        assert now not in seen, change
        seen.add(now)
    assert files_fingerprint(tmp_path / "absent") is None and files_fingerprint("org/hub-id") is None
    assert files_fingerprint(d / "config.json") == files_fingerprint(d / "config.json")


def test_the_usable_cores_are_the_affinity_mask_within_the_cgroup_quota(tmp_path, monkeypatch):
    """cgroup v2: the smallest ``cpu.max`` of the process's group and its ancestors (``max``: none); v1:
    ``cfs_quota_us / cfs_period_us`` (-1: none); an unreadable file is no quota. The usable cores are the
    affinity mask's, at most the quota rounded down, at least 1 (issue 56: never os.cpu_count() alone)."""
    import os

    from specmd import provenance as jobs

    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "a" / "cpu.max").write_text("150000 100000\n")
    (v2 / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert jobs.cgroup_cores(v2, "/a/b") == 1.5 and jobs.cgroup_cores(v2, "/") is None
    (v2 / "a" / "b" / "cpu.max").write_text("50000 100000\n")
    assert jobs.cgroup_cores(v2, "/a/b") == 0.5  # (the smallest along the path)
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert jobs.cgroup_cores(v1, "/") == 2.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert jobs.cgroup_cores(v1, "/") is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert jobs.cgroup_cores(v1, "/") is None
    mask = len(os.sched_getaffinity(0))
    for quota, want in ((None, mask), (0.5, 1), (1.5, min(mask, 1)), (64.0, mask)):
        monkeypatch.setattr(jobs, "cgroup_cores", lambda q=quota: q)
        assert jobs.usable_cores() == want, quota


def test_a_run_records_the_machine_it_was_timed_on():
    """provenance.machine: the threads torch computes with, the cores (mask, quota, SMT) and the load average at
    the job's start and end -- settings and conditions a timing needs beside it (issue 56)."""
    import os

    import torch

    from specmd.provenance import machine, note_start, provenance

    note_start()
    m = provenance()["machine"]
    assert m == machine() | {"load_average": m["load_average"]}
    assert m["threads"] == torch.get_num_threads() and m["affinity"] == sorted(os.sched_getaffinity(0))
    assert 1 <= m["usable_cores"] <= len(m["affinity"]) and len(m["load_average_at_start"]) == 3
    assert m["smt"] is None or m["smt"] >= 1
