"""The machine a run is timed on: the cores it may use (:func:`usable_cores`), what it records about them
(:func:`machine`: threads, affinity, cgroup quota, SMT, load), its speed now (:func:`speed_probe`, :func:`drift`),
and how a timed run places its threads on them (:class:`CorePlan`: ``execution.threads``, ``host_threads``,
``pin``; issue 56).

Why a plan rather than torch's defaults. On the project's shared 2-core VM an unpinned two-thread process ran
its kernels in one of two speed modes (a 1024 x 2816 projection at 8 rows in 1.3 or 5.1 ms, from one launch to
the next and inside one process), and its copy thread competed with both compute threads: the repeats of a
timed cell spread by 16-22%. Every CPU-side engine that times or serves on a CPU sets its threads (llama.cpp's
``-t``/``--cpu-mask``/``--cpu-strict``, KTransformers' ``--kt-cpuinfer``: the cores minus what the GPU side
needs, vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` with reserved cores; PyTorch's ``benchmark.Timer`` times on one
thread). Pinning is not free everywhere (NUMA pinning measured +30% in a micro-benchmark, -7% end to end in one
public A/B), so it is a setting, recorded beside the figures, never a hidden default.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch


def usable_cores() -> int:
    """The CPU cores this process may keep busy: its affinity mask (which SLURM, ``taskset`` or a container
    narrows), else every core; at most its cgroup's CPU quota (:func:`cgroup_cores`, rounded down: a thread
    beyond the quota is throttled, not run -- uber-go/automaxprocs rounds so too), and at least 1. Never
    ``os.cpu_count()`` alone: a container sees the host's cores. The mask is the process's own
    (:func:`process_mask`), not the one a timed run's pinning narrowed its threads to."""
    mask = process_mask()
    cores = len(mask) if mask is not None else (os.cpu_count() or 1)
    quota = cgroup_cores()
    return max(1, min(cores, int(quota))) if quota is not None else cores


_PINNED = {"mask": None, "depth": 0}  # the process's mask before specmd pinned it, while a CorePlan.enter holds


def process_mask() -> Optional[set]:
    """The process's affinity mask as it was given (SLURM, ``taskset``, a container), also while a timed run's
    pinning (:meth:`CorePlan.enter`) holds its threads on fewer cores: a plan made inside another -- fidelity's
    cells inside its own, calibrate's installs inside its -- divides the same cores, not the ones the outer one
    pinned to (that put the copy thread on the compute core). None where the platform has no affinity."""
    if _PINNED["depth"]:
        return set(_PINNED["mask"])
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


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

    mask = process_mask()
    affinity = sorted(mask) if mask is not None else None
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



def in_passes(cases: list, time_one, reps: int, rounds: int) -> dict:
    """Each case's seconds: ``rounds`` passes over all ``cases``, in each the median of ``reps`` calls of
    ``time_one(case, i)`` (seconds; ``i`` counts every call, to cycle sources), and the median over the passes
    kept. A slow second of a shared machine lands in one pass, not on a run of neighbouring cases: measured
    case after case, one such second put three of the 46 MB kernel cases at 3-4x their time and the fit's
    bandwidth 30% low, and the link's bulk rate moved by 15% between calibrations."""
    per = {c: [] for c in cases}
    i = 0
    for _ in range(rounds):
        for c in cases:
            times = []
            for _ in range(reps):
                i += 1
                times.append(time_one(c, i))
            per[c].append(statistics.median(times))
    return {c: statistics.median(v) for c, v in per.items()}


def speed_probe(device: torch.device, reps: int = 5, rounds: int = 3) -> dict:
    """The machine's speed now, for a later run to compare with (``specmd fidelity``: a shared VM runs 10-25%
    slower or faster from one quarter of an hour to the next, and a profile fitted in a fast one predicts a
    slow one short in every cell): timed in passes (:func:`in_passes`), in microseconds, one expert
    projection's kernel (1024 x 2816 at 8 rows, weights cycling beyond the
    last-level cache) and of a fixed stretch of Python (the interpreter work a small model's framework costs
    are made of)."""
    import torch

    h, f = 1024, 2816  # (calibrate's third kernel shape: an expert projection of a mid-sized model)
    ws = torch.rand(max(2, (96 << 20) // (4 * h * f)), f, h, device=device)
    x, out = torch.randn(8, h, device=device), torch.empty(8, f, device=device)
    table = {i: i for i in range(64)}

    from .accel import accel_for

    accel = accel_for(device)

    def kernel(k):
        torch.mm(x, ws[k % ws.shape[0]].t(), out=out)
        if accel is not None:
            accel.synchronize()

    def python(k):
        acc = 0
        for i in range(4000):
            acc += table.get((i + k) & 63, 0)
        return acc

    def timed(name: str, k: int) -> float:
        t0 = time.perf_counter()
        (kernel if name == "kernel_us" else python)(k)
        return time.perf_counter() - t0

    kernel(0)
    return {name: s * 1e6 for name, s in in_passes(["kernel_us", "python_us"], timed, reps, rounds).items()}


def drift(then: dict | None, now: dict) -> dict | None:
    """``now`` / ``then`` per :func:`speed_probe` figure (> 1: the machine is slower now than when the profile
    was fitted); None without ``then`` (a profile from before the probe, or hand-written)."""
    if not then:
        return None
    return {k: now[k] / then[k] for k in now if then.get(k)}




# ---- where a timed run's threads go ------------------------------------------------------------------------
# the most threads a setting may ask for: explicit threads beyond the cores are kept (oversubscribed, recorded
# as such: an experiment of its own), but torch crashes -- SIGSEGV -- creating 100,000, before any failed.json
MAX_THREADS = 1024


def threads_error(value, what: str):
    """The message refusing ``what``'s thread count ``value`` (``auto`` or 1..:data:`MAX_THREADS`), or None."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        return f"{what}={value!r}: valid choices are auto or whole numbers in 1..{MAX_THREADS} (this job may use " \
               f"{core_budget()[0]} cores; more threads than cores are kept, oversubscribed)"
    return None



_BUDGET = {"cores": None, "shared": False}


def set_core_budget(cores: Optional[int], shared: bool = False) -> None:
    """The job's share of the cores (the config's ``threads``, or its launcher's share:
    :func:`specmd.cli.launch.torch_threads`); None: every usable core. ``shared``: the launcher runs other
    jobs beside this one in the same affinity mask (pinning would put them on the same cores)."""
    _BUDGET["cores"], _BUDGET["shared"] = cores, shared


def core_budget() -> tuple[int, bool]:
    """(cores this job may keep busy: its share within :func:`usable_cores`, whether other jobs share its mask)."""
    usable = usable_cores()
    cores = _BUDGET["cores"]
    return (usable if cores is None else max(1, min(int(cores), usable))), bool(_BUDGET["shared"])


def can_pin() -> bool:
    """Whether this platform lets a thread choose its cores (Linux's ``sched_setaffinity``)."""
    return hasattr(os, "sched_setaffinity") and Path("/proc/self/task").is_dir()


@dataclass(frozen=True)
class CorePlan:
    """Where a timed run's threads run: ``threads`` intra-op threads of the compute thread (the model's forward:
    the device's kernels on a CPU device, the host side's ops on CUDA), one copy thread (the offload mover's
    memmoves or CUDA copy issues: no intra-op pool of its own) and ``host_threads`` intra-op threads of the host
    lane (the worker computing experts on the host for ``miss=cpu_compute``/``hybrid`` when it is a thread;
    inline, the host lane is the compute thread and ``host_threads == threads``). Pinned (``pin``), each role
    has its own cores of the affinity mask: ``compute``, ``copy``, ``host`` (cycled when the counts ask for more
    cores than the job has: recorded as they are). :meth:`plan` resolves the settings; :meth:`enter` applies
    them on the compute thread and returns the undo; each helper thread calls :meth:`enter_helper` as it starts."""

    threads: int
    host_threads: int
    pin: bool = False
    cores: int = 1  # the job's cores the plan was made for (core_budget)
    compute: tuple = ()  # pinned cores per role (empty: not pinned)
    copy: tuple = ()
    host: tuple = ()
    host_lane: bool = False  # a host worker thread of its own (else: inline, or none)

    @classmethod
    def plan(cls, threads="auto", host_threads="auto", pin: bool = False, *, copy_thread: bool = True,
             host_lane: bool = False, cores: Optional[int] = None) -> "CorePlan":
        """The settings resolved on this job's cores (``cores``; default :func:`core_budget`). ``auto`` threads:
        the cores minus one for the copy thread (when there are two or more) and minus the host lane's;
        ``auto`` host threads: half of what the copy thread leaves (at least 1). On the project's 2-core VM
        that is 1 compute thread beside 1 copy thread -- the setting whose kernels ran at one speed (issue 56),
        where 2 compute threads beside the copy thread ran in one of two speeds."""
        n = cores if cores is not None else core_budget()[0]
        copy = 1 if copy_thread and n >= 2 else 0
        h = int(host_threads) if host_threads != "auto" else max(1, (n - copy) // 2)
        reserved = h if host_lane and n - copy - h >= 1 else 0
        t = int(threads) if threads != "auto" else max(1, n - copy - reserved)
        if not host_lane:
            h = t
        compute = copy_cores = host = ()
        if pin:
            ring = sorted(process_mask())[:n]
            pick = lambda start, k: tuple(sorted({ring[(start + i) % len(ring)] for i in range(k)}))  # noqa: E731
            compute = pick(0, t)
            copy_cores = pick(t, 1) if copy_thread else ()
            host = pick(t + (1 if copy_thread else 0), h) if host_lane else compute
        return cls(t, h, bool(pin), n, compute, copy_cores, host, host_lane)

    def record(self) -> dict:
        """What ``provenance.machine.placement`` records (and a profile's ``calibrated_on``)."""
        return {"threads": self.threads, "host_threads": self.host_threads, "pin": self.pin, "cores": self.cores,
                "compute_cores": list(self.compute) or None, "copy_cores": list(self.copy) or None,
                "host_cores": (list(self.host) or None) if self.host_lane else None}

    def enter(self) -> Callable[[], None]:
        """On the compute thread: torch's intra-op threads set to ``threads`` and, pinned, every thread of the
        process moved to the compute cores (torch's pool threads are the compute thread's; a helper started
        later moves itself: :meth:`enter_helper`). Returns the undo: the threads and every thread's mask as they
        were (a test process, or fidelity's next cell, must not stay pinned)."""
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        mask = None
        if self.pin:
            mask = os.sched_getaffinity(0)  # (the outer plan's compute cores, when one holds)
            if not _PINNED["depth"]:
                _PINNED["mask"] = set(mask)
            _PINNED["depth"] += 1
            _pin_all(self.compute)

        def undo():
            torch.set_num_threads(before)
            if mask is not None:
                _pin_all(mask)
                _PINNED["depth"] -= 1

        return undo

    def enter_helper(self, role: str) -> None:
        """On a helper thread as it starts (``role``: ``copy`` or ``host``): pinned, onto its cores; a host
        worker computes with ``host_threads`` intra-op threads (:class:`~specmd.executor.hostwork.HostWorker`
        sets them per bank). The copy thread keeps torch's setting: its memmoves and copy issues use none."""
        if self.pin:
            cores = self.copy if role == "copy" else self.host
            if cores:
                os.sched_setaffinity(0, cores)


def _pin_all(cores) -> None:
    """Every thread of this process onto ``cores`` (a thread that ended meanwhile is skipped)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError, OSError):
            continue
