"""The executor interface: what the live driver (:mod:`specmd.hook.stack`) calls to run a layer's experts, and
what the composition root (:mod:`specmd.app`) asks an executor before any model work (its config checks
and what loading the model must leave where), so that nothing executor-specific lives in ``app.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ..accel import accel_for
from ..registry import Plugin, Registry
from ..signals import check_interrupt


@dataclass(frozen=True)
class RunFacts:
    """The rest of a run's configuration, as an executor may check itself against it (:meth:`Executor.
    config_errors`), before the model loads."""

    replay: bool  # replay.trace is set: a trace replays without a model
    stack_enabled: bool  # stack.enabled: the policy stack is installed (false: the unhooked model runs)
    timing_as: Optional[str]  # hardware.timing_as: another model's sizes and compute time this routing
    miss: tuple  # (miss policy class, params)
    model_name: str
    pretrained: Optional[str]  # model.pretrained as configured
    checkpoint: Optional[str]  # the local checkpoint directory it resolves to, or None (hub name, tiny model)
    device: str
    explicit: frozenset = frozenset()  # the execution keys the user set (an option that does not apply is named)
    layer_budget: str = "uniform"  # hardware.layer_budget: per-layer pools resized after the warm-up
    capacity: Any = None  # hardware.capacity: a fraction, or "auto" (the device's free memory)
    memory_gb: Optional[float] = None  # hardware.memory_gb


class Executor(Plugin):
    """One per installed stack. ``attach`` once (the stack's model, adapter, geometry, store, engine), then
    per forward pass ``begin_pass``/``end_pass`` and per MoE layer call ``run``; ``results`` gives the
    ``wall`` and ``memory`` sections of results.json; ``close`` releases threads and files."""

    #: False: the experts modules' weights are not needed on the device: the stack is installed before the
    #: model moves there, and the experts stay in the executor's host tier (:meth:`experts_on_meta` says
    #: whether the loader need materialise them at all)
    device_experts: ClassVar[bool] = True
    #: True: its ``wall`` section is a measurement (a run records the machine's speed as it starts,
    #: :func:`specmd.machine.speed_probe`, beside it)
    timed: ClassVar[bool] = False
    #: where its threads run (:class:`specmd.machine.CorePlan`), recorded in ``provenance.machine.placement``;
    #: None: torch's settings as the run found them
    thread_plan = None

    @classmethod
    def config_errors(cls, params: Any, run: RunFacts) -> list[str]:
        """What this executor cannot carry out in ``run`` (each message naming the setting and the way out);
        the composition root reports them with the other config errors, before the model loads."""
        if run.capacity == "auto":
            return [f"hardware.capacity=auto sizes an arena from the device's free memory, and execution={cls.name} "
                    f"allocates none: use execution=offload, or hardware.memory_gb (any execution)"]
        return []

    @classmethod
    def experts_on_meta(cls, params: Any) -> bool:
        """True: load the model with its experts on the meta device (never materialised: the executor reads
        them from the checkpoint itself)."""
        return False

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.pass_kinds: list[str] = []
        self.pass_wall: list[float] = []
        self.pass_stall: list[float] = []
        self.pass_tokens: list[int] = []
        self.pass_bytes: list[int] = []  # bytes the pass moved to the device (offload)
        self._t0 = 0.0
        self._accel = False  # the device's :class:`~specmd.accel.Accel` (None: a CPU), looked up at the first pass

    def _synchronize(self) -> None:
        """Wait for the device's queued work (a GPU's kernels: not the next pass's time); nothing on a CPU."""
        accel = self._accel
        if accel is False:
            accel = self._accel = accel_for(self.device)
        if accel is not None:
            accel.synchronize()

    def attach(self, stack) -> None:
        self.stack = stack

    def stalled(self) -> float:
        """Wall seconds compute has waited for transfers so far."""
        return 0.0

    def moved(self) -> int:
        """Bytes of experts sent to the device so far."""
        return 0

    def run(self, mod, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, plan, rec=None) -> torch.Tensor:
        """One MoE layer call's experts. ``hidden`` [T, H], ``index``/``weights`` [T, k]: what the block passes
        (on the device); ``plan``: the engine's :class:`~specmd.engine.outcomes.Execution` (its tensors on the
        host), or None: every selected expert runs, native, on the device; ``rec``: the call's gate record
        (its selection on the host: ``rec.index``, ``rec.requested(E)``; ``rec.block_index``: the one the block
        passed instead, where it changed the router's)."""
        raise NotImplementedError

    def run_idle(self, mod, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A layer call of a pass with no live position (every sequence of the batch has finished, and the
        model's ``generate`` runs on until all its stop criteria agree): no request, no engine. Its outputs
        are discarded by whoever stopped those sequences; by default the experts contribute zero."""
        return torch.zeros_like(hidden)

    # -- forward passes: the wall clock beside the simulated one ---------------------------------------
    def begin_pass(self, kind: str, tokens: int) -> None:
        check_interrupt()  # (a safe point: a signal recorded inside an import or a finaliser is raised here)
        self.pass_kinds.append(kind)
        self.pass_tokens.append(tokens)
        self._stall0 = self.stalled()
        self._bytes0 = self.moved()
        self._synchronize()  # the previous pass's kernels are not this pass's time
        self._t0 = time.perf_counter()

    def end_pass(self) -> None:
        self._synchronize()
        self.pass_wall.append(time.perf_counter() - self._t0)
        self.pass_stall.append(self.stalled() - self._stall0)
        self.pass_bytes.append(self.moved() - self._bytes0)

    def wall(self) -> dict:
        """The ``wall`` section: the passes as measured on this machine (same definitions as ``timing``)."""
        pre = [t for k, t in zip(self.pass_kinds, self.pass_wall) if k == "prefill"]
        dec = [t for k, t in zip(self.pass_kinds, self.pass_wall) if k == "decode"]
        total = sum(self.pass_wall)
        dec_tok = sum(n for k, n in zip(self.pass_kinds, self.pass_tokens) if k == "decode")
        return {
            "clock": "wall",
            "executor": self.name,
            "ttft_s": sum(pre) / len(pre) if pre else None,
            "tpot_s": sum(dec) / len(dec) if dec else None,
            "tokens_per_s": sum(self.pass_tokens) / total if total > 0 else None,
            "decode_tokens_per_s": dec_tok / sum(dec) if dec and sum(dec) > 0 else None,
            "total_s": total,
            "stall_s": self.stalled(),
            # bytes moved to the device: per prefill pass, and per decode token (the link's share of TTFT, TPOT)
            "prefill_bytes_moved": _mean([b for k, b in zip(self.pass_kinds, self.pass_bytes) if k == "prefill"]),
            "decode_bytes_moved_per_token": sum(b for k, b in zip(self.pass_kinds, self.pass_bytes) if k == "decode")
            / dec_tok if dec_tok else None,
        }

    def memory(self) -> dict:
        return {"host_peak_rss_bytes": peak_rss_bytes(), "device_peak_bytes": device_peak_bytes(self.device)}

    def results(self) -> dict:
        return {"wall": self.wall(), "memory": self.memory()}

    def close(self) -> None:
        pass

    @property
    def device(self) -> torch.device:
        return getattr(self, "_device", torch.device("cpu"))


def _mean(xs: list):
    return sum(xs) / len(xs) if xs else None


def full_selection(rec, index: torch.Tensor, weights: torch.Tensor) -> tuple:
    """The block's whole ``[T, k]`` selection and weights on the host for a plan's live-row ``index``/``weights``
    (``[n, k]``: the engine decides for live rows only). Pad and finished rows (``rec.live`` leaves them out)
    keep the router's own selection: an executor computes them where that costs nothing the engine did not
    decide -- ``simulated`` has every expert on the device and computes them as the unhooked model does;
    ``offload`` computes a pad row's expert only if the call runs it anyway for a live row, and zero
    elsewhere. Either way no live row's output changes: a live row shares a grouped GEMM only with the rows
    that select the same running expert, and those are the same in both (row results of a GEMM depend on
    its other rows' count in the last bits, measured on every tiny family, so this matters). Outputs at
    pad positions are never read: a left pad is masked out of attention, a right pad comes after the
    scored tokens of a causal model, and a finished sequence's tokens are cut by its stop rule.
    With every row live (``rec.live`` None) the inputs come back unchanged."""
    rows = None if rec is None else getattr(rec, "live", None)
    if rows is None:
        return index, weights
    full_i, full_w = rec.full_index.clone(), rec.full_weights.clone()
    full_i[rows] = index
    full_w[rows] = weights.to(full_w.dtype)
    return full_i, full_w


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of the engine's plan on the device, without waiting (a copy even where the device is the
    host: the kernel never computes on the engine's own tensors)."""
    return t.to(device, non_blocking=True, copy=True)


def peak_rss_bytes() -> int:
    """This process's peak resident set size: Linux's ``VmHWM`` of its own memory map. Not ``ru_maxrss``: across
    fork + exec Linux carries the pre-exec image's high-water mark into it, so a run started by a large parent
    (a benchmark holding a model, a sweep's launcher) reported the parent's RSS (9.1 GB for a 5.7 GB run)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux (bytes on macOS)


def device_peak_bytes(device: torch.device) -> Optional[int]:
    """Peak memory torch allocated on a CUDA device, None on the CPU (there the host RSS is the figure)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


EXECUTION: Registry[Executor] = Registry("execution", "specmd.executor")
_DEFAULT: list = []  # (the default's name, read once)


def default_execution(config: Optional[dict] = None) -> tuple:
    """``(executor class, params)`` of ``config`` (an ``execution`` section), or when it is empty of the
    executor ``conf/config.yaml`` composes when the user names none: the default has that one home."""
    if not config:
        if not _DEFAULT:
            from .. import shipped

            _DEFAULT.append(shipped.defaults()["execution"])
        config = {"name": _DEFAULT[0]}
    return EXECUTION.params(config)


STEADY_HEAP_BYTES = 256 << 20
_steady = False


def steady_host_allocator(prefault: int = STEADY_HEAP_BYTES) -> bool:
    """Make host memory allocation behave as in a long-running process, so what an executor measures is the
    steady state and not page faults (glibc only; once per process; True if applied).

    Eager PyTorch on a CPU allocates a prefill's activations with ``malloc``. glibc serves blocks above its
    mmap threshold (128 KiB at start, raised only as such blocks are freed) with fresh ``mmap`` s and trims
    freed heap back to the kernel, so in a fresh process every large activation is first-touch page faults.
    Measured on this project's 2-core CPU (deep_olmoe, 480-token prefills under ``execution=offload``): a
    fresh process took 1.4-1.7x the TTFT that the same passes took in the long-running ``specmd calibrate``
    that fitted the clock; with the settings below, 0.93-1.03x, the first pass included. Set: blocks up to 32
    MiB from the heap (glibc's maximum; fixed, not adaptive), the heap grown 64 MiB at a time and freed heap
    kept up to 1 GiB, and ``prefault``
    bytes of heap touched once now (the first pass's faults; they stay with the heap). The settings are the
    process's from then on (a process that measures keeps them; freed heap up to 1 GiB is not returned)."""
    global _steady
    if _steady:
        return True
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    if not (mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30)
            and mallopt(M_TOP_PAD, 64 << 20)):
        return False
    if prefault:
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        blocks = []
        for _ in range(max(1, prefault // (16 << 20))):  # below the threshold: from the heap, kept after free
            p = libc.malloc(16 << 20)
            if not p:
                break
            ctypes.memset(p, 0, 16 << 20)
            blocks.append(p)
        for p in blocks:
            libc.free(p)
    _steady = True
    return True
