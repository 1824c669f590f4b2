"""Hydra launchers on real engines: a sweep under joblib, submitit (local executor, several jobs per task) and
a local Ray cluster writes the same cache and timing sections as the serial run."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SWEEP = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=128", "logger=none"]


def _sweep(tmp_path, name, mirror, *args, axes=("eviction=lru,fifo", "hardware.capacity=0.05,0.25")):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SPECMD_DATA_MIRROR=str(mirror))
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "specmd", "-m", *SWEEP, *axes, *args, f"hydra.sweep.dir={out}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/results.json")}
    return {k: (r["cache"], r["timing"], r["tasks"]) for k, r in res.items()}


def same(par: dict, serial: dict) -> bool:
    """Cache and timing sections identical; task scores equal up to float rounding (a job's torch thread count
    differs between launchers, and so may the order of a reduction)."""
    assert par.keys() == serial.keys()
    for k in serial:
        assert par[k][:2] == serial[k][:2], k
        flat = lambda t: {f"{a}/{m}": v for a, ms in t.items() for m, v in ms.items()  # noqa: E731
                          if isinstance(v, (int, float))}
        assert flat(par[k][2]) == pytest.approx(flat(serial[k][2]), rel=1e-5), k
    return True


@pytest.fixture(scope="module")
def serial(tmp_path_factory, mirror):
    return _sweep(tmp_path_factory.mktemp("serial"), "serial", mirror)


@pytest.mark.slow  # (29 s with its serial fixture: the launchers now run with -m slow; thread sharing stays in the default run)
def test_joblib_equals_serial(serial, tmp_path, mirror):
    par = _sweep(tmp_path, "joblib", mirror, "hydra/launcher=specmd_joblib", "hydra.launcher.n_jobs=2")
    assert len(serial) == 4 and same(par, serial)


@pytest.mark.slow  # (15 s)
def test_submitit_local_batched_equals_serial(serial, tmp_path, mirror):
    par = _sweep(tmp_path, "submitit", mirror, "hydra/launcher=specmd_submitit_local",
                 "hydra.launcher.jobs_per_task=2")
    assert same(par, serial)
    # 4 jobs, 2 per task: two array tasks, each one process that ran two jobs
    tasks = [p for p in (tmp_path / "submitit" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(tasks) == 2, tasks


def test_torch_threads_share_the_cores():
    from specmd.cli.launch import torch_threads

    cores = len(os.sched_getaffinity(0))
    assert torch_threads(3, {"_target_": "x.JoblibLauncher", "n_jobs": 2}) == 3  # asked for: kept
    assert torch_threads(None, {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
                                "n_jobs": 2}) == max(1, cores // 2)
    assert torch_threads(None, {"_target_": "h.JoblibLauncher", "n_jobs": -1}) == 1
    assert torch_threads(None, {"_target_": "h.submitit_launcher.SlurmLauncher", "cpus_per_task": 8}) == 8
    assert torch_threads(None, {"_target_": "h.submitit_launcher.LocalLauncher", "cpus_per_task": None}) == 1
    assert torch_threads(None, {"_target_": "h.ray_launcher.RayLauncher", "ray": {"remote": {"num_cpus": 4}}}) == 4
    assert torch_threads(None, {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}) is None


@pytest.mark.slow
def test_local_ray_cluster_equals_serial(serial, tmp_path, mirror):
    """A Ray head started on the loopback address, the sweep sent to it as to a remote cluster, then stopped."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                   capture_output=True, timeout=120)
    try:
        par = _sweep(tmp_path, "ray", mirror, "hydra/launcher=specmd_ray",
                     f"hydra.launcher.ray.init.address=127.0.0.1:{port}")
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
    assert same(par, serial)
