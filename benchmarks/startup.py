"""Start-up of the default run: the process's wall time minus the time spent evaluating (forward passes and
lm-eval's own work), over a few repeats.

    python benchmarks/startup.py [--repeats 3] [overrides...]

Prints per repeat: total wall (process start to exit), load (model), stack (hook + quantized copies),
evaluate, and start-up = total - evaluate. Issue 10's target: <= 8 s of start-up on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from specmd.cli import script


def main(argv: list) -> int:
    ap = script.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            out = Path(tmp) / str(i)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "specmd", *args.overrides, f"hydra.run.dir={out}"], env=env,
                           check=True, capture_output=True, cwd=tmp)
            total = time.perf_counter() - t0
            st = json.loads((out / "results.json").read_text())["wall_stages_s"]
            rows.append((total, st["load"], st["stack"], st["evaluate"], total - st["evaluate"]))
            print("repeat %d: total %.2f s  load %.2f  stack %.2f  evaluate %.2f  start-up %.2f" % (i, *rows[-1]))
    med = [statistics.median(c) for c in zip(*rows)]
    print("median:   total %.2f s  load %.2f  stack %.2f  evaluate %.2f  start-up %.2f" % tuple(med))
    return 0


if __name__ == "__main__":
    script.run("benchmarks/startup.py", main)
