"""Replays a batch of (trace, stack) jobs and writes their results: run in this process (the compiled engine)
and in a subprocess with ``SPECMD_PURE_PYTHON=1`` (the sources), so ``tests/test_native.py`` compares the
two copies of the engine on identical inputs.

    python tests/native_worker.py JOBS.pkl OUT.pkl     # JOBS: a list of (Trace, case dict)
"""

import json
import pickle
import sys

from specmd import native
from specmd.compose import spec_of
from specmd.hardware import HardwareConfig
from specmd.replay.driver import run_replay

SECTIONS = ("cache", "timing", "routing")


def case_spec(case: dict):
    """A StackSpec from a flat case: hardware fields, the four families, and ``quant``."""
    case = dict(case)
    hw = {k: case.pop(k) for k in list(case) if k in HardwareConfig.__dataclass_fields__}
    quant = case.pop("quant", None)
    return spec_of(hardware=HardwareConfig(**hw), quant=quant, **case)


def results(trace, case: dict) -> str:
    """results.json's cache, timing and routing sections of one replay, as the JSON text a run writes (so
    an int where the other copy has a float is a difference too)."""
    res = run_replay(trace, case_spec(case)).results()
    return json.dumps({k: res[k] for k in SECTIONS}, sort_keys=True)


def run(jobs) -> list[str]:
    return [results(trace, case) for trace, case in jobs]


if __name__ == "__main__":
    src, dst = sys.argv[1:3]
    with open(src, "rb") as f:
        jobs = pickle.load(f)
    out = {"engine": native.summary()["engine"], "results": run(jobs)}
    with open(dst, "wb") as f:
        pickle.dump(out, f)
