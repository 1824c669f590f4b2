"""Per-configuration cost of each Hydra launcher on one 12-job sweep, and whether every launcher's cache and
timing sections equal the serial run's.

    python benchmarks/launchers.py [--replay] [--skip-ray] [--out DIR]

Sweep: model=tiny, one WikiText document, eviction in {lru, fifo, lfu} x capacity in {0.05, 0.1, 0.25, 0.5}
(``--replay``: the same sweep replaying one recording, replay.trace=record, where a job is milliseconds and
the launcher's overhead is everything). Printed per launcher: wall time of the whole command, the jobs' own
time (sum of ``wall_s`` in results.json: model load + evaluation or replay), wall time per configuration and
the speed-up over the serial run; and whether the cache and timing sections equal the serial run's. Ray runs
against a head started on 127.0.0.1 and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from specmd.cli import script

AXES = ["eviction=lru,fifo,lfu", "hardware.capacity=0.05,0.1,0.25,0.5"]
BASE = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=128", "logger=none"]


def sweep(out: Path, extra: list, env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "specmd", "-m", *BASE, *AXES, *extra, f"hydra.sweep.dir={out}"],
                       env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{extra}: exit {r.returncode}\n{r.stderr[-3000:]}")
    res = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/results.json")}
    return wall, res


def main(argv: list) -> int:
    ap = script.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", action="store_true", help="replay one recording in every job")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="specmd-launchers-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    common = ["replay.trace=record", f"replay.cache={root / 'traces'}"] if args.replay else []
    if args.replay:  # record once, outside the timings
        sweep(root / "warm", common, env)
    runs = [("serial (basic)", []),
            ("joblib n_jobs=2", ["hydra/launcher=specmd_joblib", "hydra.launcher.n_jobs=2"]),
            ("submitit_local 6 jobs/task", ["hydra/launcher=specmd_submitit_local", "hydra.launcher.jobs_per_task=6"]),
            ("submitit_local 1 job/task", ["hydra/launcher=specmd_submitit_local", "hydra.launcher.jobs_per_task=1"])]
    ray_stop = None
    if not args.skip_ray:
        ray = shutil.which("ray", path=str(Path(sys.executable).parent))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                       capture_output=True)
        ray_stop = [ray, "stop", "--force"]
        runs.append(("ray (local head, 2 CPUs)", ["hydra/launcher=specmd_ray",
                                                   f"hydra.launcher.ray.init.address=127.0.0.1:{port}"]))
    base = None
    print(f"{'launcher':30s} {'wall s':>8s} {'jobs s':>8s} {'s/config':>9s} {'speed-up':>9s}  same numbers as serial")
    serial_wall = None
    try:
        for name, extra in runs:
            wall, res = sweep(root / re.sub(r"[^A-Za-z0-9]+", "_", name), [*common, *extra], env)
            numbers = {k: (r["cache"], r["timing"]) for k, r in res.items()}
            base = base or numbers
            jobs_s = sum(r["wall_s"] for r in res.values())
            serial_wall = serial_wall or wall
            print(f"{name:30s} {wall:8.1f} {jobs_s:8.1f} {wall / len(res):9.2f} {serial_wall / wall:8.2f}x  "
                  f"{numbers == base} ({len(res)} jobs)")
    finally:
        if ray_stop:
            subprocess.run(ray_stop, env=env, capture_output=True)
    print(f"outputs: {root}")
    return 0


if __name__ == "__main__":
    script.run("benchmarks/launchers.py", main)
