"""Where a result came from: the ``provenance`` section of ``results.json``.

A number is only comparable with another when both came from the same code, libraries, weights and (for
a replay) trace. Recorded per run: the versions of specmd and the libraries that shape the numbers, the
git commit of the specmd checkout (with a ``dirty`` flag) when it is one, fingerprints of the model's
files and of a replayed trace, and the machine it was timed on (:func:`machine`: threads, cores, load). A fingerprint hashes each file's name, size and its first and last MiB:
cheap for multi-GB checkpoints, and it changes whenever a file is replaced, truncated or re-saved.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

LIBRARIES = ("specmd", "torch", "transformers", "lm_eval", "hydra-core", "numpy")
CHUNK = 1 << 20


@functools.lru_cache(maxsize=None)  # fixed for the process: a batched replay sweep asks once, not per run
def _versions() -> tuple:
    out = [("python", sys.version.split()[0])]
    for name in LIBRARIES:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, None))
    return tuple(out)


def versions() -> dict:
    return dict(_versions())


@functools.lru_cache(maxsize=None)  # the code a process runs is the code it imported at its start
def git_state(source: Path = Path(__file__).resolve().parent) -> Optional[dict]:
    """The commit of the checkout holding specmd's source, or None (an installed wheel, no git)."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=source, capture_output=True, text=True,  # noqa: E731
                                         timeout=5, check=True).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def files_fingerprint(path) -> Optional[str]:
    """sha256 (16 hex digits) over a file, or a directory's files in name order: name, size, first and last
    MiB of each. None when ``path`` is not on disk (a hub id not downloaded here)."""
    path = Path(path).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(CHUNK))
            if size > 2 * CHUNK:
                fh.seek(-CHUNK, 2)
                h.update(fh.read(CHUNK))
            elif size > CHUNK:
                h.update(fh.read())
    return h.hexdigest()[:16]


def model_identity(model_cfg) -> dict:
    """What the weights were: a seeded random model, or the files ``model.pretrained`` resolved to."""
    from .models.loader import resolve_pretrained

    if model_cfg.pretrained is None:
        return {"weights": f"seeded random ({model_cfg.family}, seed {model_cfg.seed})"}
    local = resolve_pretrained(model_cfg.pretrained)
    # the family its config.json names (model.family=auto resolves to it before loading)
    return {"pretrained": model_cfg.pretrained, "family": model_cfg.family,
            "revision": getattr(model_cfg, "revision", None), "fingerprint": files_fingerprint(local)}


def usable_cores() -> int:
    """The CPU cores this process may keep busy: its affinity mask (which SLURM, ``taskset`` or a container
    narrows), else every core; at most its cgroup's CPU quota (:func:`cgroup_cores`, rounded down: a thread
    beyond the quota is throttled, not run -- uber-go/automaxprocs rounds so too), and at least 1. Never
    ``os.cpu_count()`` alone: a container sees the host's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cores()
    return max(1, min(cores, int(quota))) if quota is not None else cores


CGROUP_ROOT = Path("/sys/fs/cgroup")  # (where cgroup v2 mounts; v1's cpu controller under cpu/)


def cgroup_cores(root: Path = CGROUP_ROOT, own: Optional[str] = None) -> Optional[float]:
    """The CPU quota of this process's cgroup in cores, or None where none is set: cgroup v2's ``cpu.max``
    (``<quota> <period>`` or ``max``) of its own group and every ancestor (the smallest; ``own``: its path,
    read from ``/proc/self/cgroup``'s ``0::`` line), else cgroup v1's ``cpu.cfs_quota_us / cpu.cfs_period_us``
    (-1: none). An unreadable file is no quota."""
    try:
        if own is None:
            lines = Path("/proc/self/cgroup").read_text().splitlines() if Path("/proc/self/cgroup").is_file() else []
            own = next((line[3:] for line in lines if line.startswith("0::")), "/")
        quotas, group = [], root / own.strip("/")
        for path in (group, *group.parents):
            f = path / "cpu.max"
            if f.is_file():
                quota, period = f.read_text().split()[:2]
                if quota != "max":
                    quotas.append(int(quota) / int(period))
            if path == root:
                break
        if quotas:
            return min(quotas)
        q, p = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if q.is_file() and p.is_file() and int(q.read_text()) > 0:
            return int(q.read_text()) / int(p.read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None


_START: dict = {}  # what :func:`note_start` saw as the job began


def note_start() -> None:
    """The machine's load as a job starts (``machine.load_average_at_start``): what else was running while it was
    timed (issue 56: on a shared 2-core VM the repeats of a cell spread by 16-22%)."""
    _START["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine() -> dict:
    """What was timed on (issue 56: threads are settings users need to reproduce a timing): torch's intra- and
    inter-op threads, the cores this process may use (:func:`usable_cores`: its affinity mask and its
    cgroup's CPU quota), the affinity mask itself, the quota in cores (None: none), the logical CPUs per physical
    core (SMT; None where the kernel does not say), every core the machine has, and the load average (1, 5, 15
    min) at the job's start and at its end."""
    import torch

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "usable_cores": usable_cores(), "affinity": affinity, "cgroup_cores": cgroup_cores(), "smt": _smt(),
            "cpu_count": os.cpu_count(), "load_average_at_start": _START.get("load_average"),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _smt() -> Optional[int]:
    """Logical CPUs per physical core of CPU 0 (``thread_siblings_list``: "0" -> 1, "0,4" or "0-1" -> 2)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def provenance(model_cfg=None, trace_path=None) -> dict:
    from . import native

    git = git_state()
    # which copy of the engine ran (compiled | pure | mixed, and why): results are equal, speeds are not
    out = {"versions": versions(), "git": dict(git) if git else None, "engine": native.summary(),
           "machine": machine()}
    if model_cfg is not None:
        out["model"] = model_identity(model_cfg)
    if trace_path is not None:
        out["trace"] = {"path": str(trace_path), "fingerprint": files_fingerprint(trace_path)}
    return out
