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
