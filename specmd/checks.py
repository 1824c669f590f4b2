"""The checks a run's config and results go through: :class:`Checks` (the one validation style, every error of
a step collected and reported together: :class:`~specmd.runspec.Run`'s), the policy overheads' names
(:func:`check_policy_overheads`), the device (:func:`check_device`; the commands that compute on one call it too),
``hardware.capacity=auto`` made concrete from the device's free memory (:func:`resolve_auto_capacity`), and,
before results.json is written, every figure specmd computed finite (:func:`check_numbers`)."""

from __future__ import annotations

import logging

from .errors import ConfigError

log = logging.getLogger("specmd")


def check_policy_overheads(table: dict) -> None:
    """Every ``hardware.policy_overhead_us`` key names a registered policy (a typo would charge nothing)."""
    from .policies import REGISTRIES

    for key in table:
        group, name = key.split("/")
        if name not in REGISTRIES[group].names():
            raise ConfigError(f"hardware.policy_overhead_us: {key!r} names no {group} policy; valid: "
                              f"{', '.join(REGISTRIES[group].names())}")


class Checks:
    """One validation style for a run's config: each check is a function that raises :class:`ConfigError`
    (or a message added with :meth:`fail`); every error of a step is collected and reported together."""

    def __init__(self):
        self.errors: list[str] = []

    def run(self, fn, *args):
        """``fn(*args)``, or None with its error collected."""
        try:
            return fn(*args)
        except ConfigError as exc:
            self.errors.append(str(exc))
            return None

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def raise_any(self) -> None:
        if self.errors:
            e = self.errors
            raise ConfigError(e[0] if len(e) == 1 else f"{len(e)} config errors:\n  - " + "\n  - ".join(e))


def resolve_auto_capacity(spec, device):
    """``spec`` with ``hardware.capacity=auto`` made concrete: the device's free memory now (before the model's
    dense weights move there: the engine counts them) as ``memory_gb``, said on the log. Unchanged otherwise (the
    executor that allows ``auto`` checked the device can be read: ``Executor.config_errors``)."""
    import dataclasses

    import torch

    from .accel import accel_for
    from .engine.memory import GIB
    from .hardware import AUTO

    hw = spec.hardware
    if hw.capacity != AUTO or hw.memory_gb is not None:
        return spec
    accel = accel_for(torch.device(str(device)))
    free, total = accel.mem_get_info()
    log.info("hardware.capacity=auto: %.4g GiB free of %.4g GiB on %s (%s): the experts get what the dense weights, "
             "hardware.reserve_gb=%g and the KV cache leave of it, per pass", free / GIB, total / GIB, device,
             accel.name, hw.reserve_gb)
    return dataclasses.replace(spec, hardware=dataclasses.replace(hw, memory_gb=free / GIB))


DEVICE_TYPES = ("cpu", "cuda", "mps")  # what a run computes on; torch knows more (meta, xla, hpu...), specmd not


def check_device(device) -> None:
    """``device`` names a torch device of a type specmd runs on (:data:`DEVICE_TYPES`) that this machine has,
    checked before any model work. ``meta`` (tensors without data: no forward pass computes anything) and
    torch's other back-ends (``xla``, ``hpu``, ``xpu``...: none has been run) are rejected by name here, not
    by a traceback from the first tensor op."""
    import torch

    choices = "cpu, cuda, cuda:N, mps"
    if not isinstance(device, str):
        raise ConfigError(f"device={device!r} must be a string; valid choices: {choices}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({exc}); valid choices: {choices}") from None
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"device={device}: specmd runs on {', '.join(DEVICE_TYPES)}, not {dev.type}"
                          + (" (a meta tensor has no data: nothing would be computed)" if dev.type == "meta" else "")
                          + f"; valid choices: {choices}")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ConfigError(f"device={device}: torch has one CPU device (cpu or cpu:0); valid choices: {choices}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device}: this torch ({torch.__version__}) sees no CUDA device; use device=cpu "
                              f"or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device}: MPS is not available here; use device=cpu")


class NumericError(ArithmeticError):
    """A figure specmd computed (cache, timing, routing) is not a finite number."""


COMPUTED = ("cache", "timing", "routing", "wall", "memory")  # results.json sections specmd computes itself


def check_numbers(results: dict) -> None:
    """Every number specmd computed is finite, or the run fails (``failed.json``, stage ``write``) naming the
    first one: ``results.json`` writes a non-finite float as null, which would read as "not measured". The
    hardware ranges (:mod:`specmd.hardware`) keep the clock's inputs finite, so what reaches here is a numeric
    bug; task scores are lm-eval's, whose NaN (a metric without a value) stays theirs."""
    from .results import non_finite

    for key in COMPUTED:
        if results.get(key) is not None:
            bad = non_finite(results[key], key)
            if bad:
                where, v = next(iter(bad.items()))  # the first
                raise NumericError(f"{where}={v}: a figure specmd computed is not a finite number (a bug: please "
                                   f"report it with this run's failed.json)")
