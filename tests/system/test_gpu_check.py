"""The GPU check (benchmarks/gpu_check.py) runs: its sections at toy sizes on the CPU, so the script a GPU
user is asked to run does not rot between GPU sessions (issue 35: policy_check crashed on the oracles)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("mode", [["--device", "cpu"], ["--stand-in"]], ids=["cpu", "stand-in"])
def test_gpu_check_runs_every_section_on_the_cpu(tmp_path, mode):
    """On the CPU's branches, and on the CUDA branches through the stand-in (specmd.accel: every copy deferred
    until waited for), where the read-back waits once per MoE layer call, as torch.profiler counted on an H200."""
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", *mode, "--quick", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    if mode == ["--stand-in"]:
        assert r["device"] == "cpu (cuda stand-in)"
        per = r["profile"]["standin_per_call"]
        assert per["sync event"] == 1.0 and per["copy"] > 0 and per["wait"] > 0, per
    failed = [row for row in r["rows"] if row[1] == "FAILED" or "FAILED" in str(row[2]) or "DIFFERS" in str(row[2])]
    assert not failed, failed
    assert r["lossless"] == "8/8"
    assert r["policies"]["failed"] == [] and "eviction=belady" in r["policies"]["skipped"]
    assert all(v["tokens"] and v["hit_rate"] and v["logits_bit_equal"] for v in r["parity"].values()), r["parity"]
    assert set(r["decode"]) == {"deep_olmoe 0.05", "deep_olmoe 0.25", "qwen 0.05", "qwen 0.25"}
    for v in r["decode"].values():
        assert v["tok_s"] > 0 and v["decode_bytes_per_token"] >= 0 and 0 <= v["hit_rate"] <= 1
    assert set(r["ratios"]) == {"deep_olmoe", "qwen"}
    assert r["calibrate"]["seconds"] > 0 and r["calibrate"]["hardware"]["bandwidth_gbps"] > 0
    assert set(r["hybrid"]) == {f"{m} {miss}" for m in ("deep_olmoe", "qwen") for miss in ("fetch", "cpu_compute",
                                                                                            "hybrid")}
    assert all(v["tok_s"] > 0 and v["ttft_ratio"] > 0 for v in r["hybrid"].values())
