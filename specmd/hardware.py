"""Emulated device: cache capacity, transfer link and compute roofline (schema of the `hardware` group)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Union

from . import shipped
from .errors import ConfigError
from .machine import MAX_THREADS
from .readers import Opt, check, finite, whole
from .registry import check_finite

SCOPES = ("global", "per_layer")
AUTO = "auto"  # hardware.capacity=auto: the device's free memory (execution=offload)
LAYER_BUDGETS = ("uniform", "proportional")
RATES = ("bandwidth_gbps", "peak_tflops", "mem_bandwidth_gbps", "host_tflops", "host_mem_bandwidth_gbps")
TIMES = ("latency_us", "layer_overhead_us", "token_overhead_us", "layer_token_overhead_us", "expert_overhead_us", "transfer_issue_us",
         "predict_overhead_us", "unpack_overhead_us", "host_call_overhead_us", "host_expert_overhead_us",
         "host_token_overhead_us", "place_overhead_us")
# Plausible ranges, 12+ orders of magnitude beyond any device either way (a phone's flash reads at ~1 GB/s, an
# H200's HBM at 4.8 TB/s; tests model an instant link as 1e9 GB/s and a 100-byte expert's host at 3e-11
# TFLOP/s): a value outside is an exponent typo, 1e308 us of latency or 1e-300 GB/s, whose times overflow to
# inf or report nonsense without a word.
RATE_RANGE = (1e-15, 1e15)
TIME_RANGE = (0.0, 1e12)  # us: 11.6 days per event
MAX_MEMORY_GB = float(1 << 20)  # a PiB: beyond any device (an exponent typo otherwise)
FRACTIONS = ("roofline_serial", "host_roofline_serial", "host_link_contention")
# rates a profile may leave out (null: the rate beside it serves): a one-row product's weight reads, the
# link's small copies
OPTIONAL_RATES = ("gemv_bandwidth_gbps", "host_gemv_bandwidth_gbps", "small_copy_gbps")


def default_profile() -> dict:
    """The figures of the default hardware profile: ``specmd/conf/hardware/<name>.yaml`` for the ``hardware``
    entry of ``specmd/conf/config.yaml``'s defaults. They are :class:`HardwareConfig`'s defaults, so code
    and tests that build one without a profile time the device a run gets by default (one home)."""
    return shipped.option("hardware", shipped.defaults()["hardware"])


_P = default_profile()


@dataclass
class HardwareConfig:
    name: str = _P["name"]
    # Cache size as a fraction of the full model's bytes at its storage dtype (SpecMD's convention); or "auto"
    # (execution=offload): the device's free memory when the stack installs, as memory_gb (on a CPU, memory_gb
    # is required: there is no device memory to read)
    capacity: Union[float, str] = _P["capacity"]
    # Alternative: a fixed number of expert slots per MoE layer (Cache-Conditional Experts, FlashMoE), or a
    # fraction < 1 of each layer's experts (Cache-Conditional Experts' default cache N/2: 0.5).
    experts_per_layer: Optional[float] = _P["experts_per_layer"]
    # One pool shared by all layers, or one pool per MoE layer (capacity split evenly).
    scope: str = _P["scope"]
    # How per-layer pools share the bytes: uniform (each the same), or proportional to each layer's working set
    # measured in the run's first passes (engine.engine.LayerBudget; docs/semantics.md "Per-layer budgets")
    layer_budget: str = _P["layer_budget"]
    # The device's memory in GiB (2^30 bytes, a GPU's "80 GB"): the cache is then what the dense weights, the KV
    # cache of the live sequences and reserve_gb leave of it, per forward pass (engine/memory.py; docs/semantics.md
    # "Device memory"). null: the fixed capacity above (every paper experiment).
    memory_gb: Optional[float] = _P["memory_gb"]
    reserve_gb: float = _P["reserve_gb"]  # GiB kept for activations (with memory_gb)
    bandwidth_gbps: float = _P["bandwidth_gbps"]  # host -> device transfer bandwidth, GB/s (1e9 bytes/s)
    latency_us: float = _P["latency_us"]  # fixed cost per transfer
    peak_tflops: float = _P["peak_tflops"]  # device compute peak at the model's dtype
    mem_bandwidth_gbps: float = _P["mem_bandwidth_gbps"]  # device memory bandwidth (roofline)
    # Host compute (miss=cpu_compute runs missing experts on the host, Zhu et al. 2025 / Fiddler).
    host_tflops: float = _P["host_tflops"]
    host_mem_bandwidth_gbps: float = _P["host_mem_bandwidth_gbps"]
    # Time the run's routing on a real model's sizes and compute: a config shipped in specmd/assets/configs
    # (olmoe, mixtral): expert bytes, dense and LM-head FLOPs/bytes; layers and experts mapped proportionally
    # (docs/models.md "Timing a small model as a real one"). null: the running model's own.
    timing_as: Optional[str] = _P["timing_as"]
    # Fixed costs the roofline does not see (``specmd calibrate`` fits them on this machine; 0 = the ideal
    # device): per decoder layer (its eager ops' launch costs), per token of a pass, per expert a layer runs
    # (one GEMM pair per expert group) and per copy job issued. The papers' GPUs hide them in kernel
    # launches; on a CPU running eager PyTorch they are most of a small model's time.
    layer_overhead_us: float = _P["layer_overhead_us"]
    token_overhead_us: float = _P["token_overhead_us"]
    # per token per decoder layer (its elementwise ops, norms and attention bookkeeping run per token): what
    # ``specmd calibrate`` fits, so the cost scales with depth -- fitted per token of a pass on 16-layer
    # deep_olmoe, it put 32-layer deep_mixtral's 32-token prefill at 0.6-0.7 of measured
    layer_token_overhead_us: float = _P["layer_token_overhead_us"]
    expert_overhead_us: float = _P["expert_overhead_us"]
    # host time to issue one copy job (a layer call's demand fetches, or a prefetch)
    transfer_issue_us: float = _P["transfer_issue_us"]
    # per expert a fetch places in the cache (its slot's allocation and views, the eviction that made room: the
    # executor's bookkeeping, on the compute thread): a prefill at a small capacity places most of its experts
    place_overhead_us: float = _P["place_overhead_us"]
    predict_overhead_us: float = _P["predict_overhead_us"]  # one prefetch prediction (a later layer's router + policy)
    # one expert run from a stored low-precision copy: unpacking it (HQQ's bit-unpacking and scale/zero
    # arithmetic) before its GEMMs; a fused low-bit kernel on a GPU makes it small, eager PyTorch does not
    unpack_overhead_us: float = _P["unpack_overhead_us"]
    # The host computing experts (miss=cpu_compute, hybrid) beyond its roofline: per layer call that sends it
    # work (the hand-off to the host worker and back), per expert (its framework calls) and per token-expert
    # pair (small GEMMs run far below the peak); ``specmd calibrate`` times the model's own experts on the host
    host_call_overhead_us: float = _P["host_call_overhead_us"]
    host_expert_overhead_us: float = _P["host_expert_overhead_us"]
    host_token_overhead_us: float = _P["host_token_overhead_us"]
    # whether the host's overheads above overlap the device's compute (a GPU: kernels are queued ahead of the
    # device, and each segment between synchronisations takes the longer of the two) or add to it (false: a
    # CPU, where the host is the device). ``specmd calibrate --device cuda`` sets it (SimClock's docstring).
    host_overlap: bool = _P["host_overlap"]
    # How far the roofline's two bounds add rather than overlap: time = max(compute, memory) + serial * min(...);
    # 0 is the ideal roofline (a GPU), 1 their sum (a CPU's small GEMMs, measured by ``specmd calibrate`` on
    # the experts' own kernel at several sizes); the host's own beside it
    roofline_serial: float = _P["roofline_serial"]
    host_roofline_serial: float = _P["host_roofline_serial"]
    # Host work and the link's copies at once: the overlapped span costs this fraction more (0: each as if
    # alone, 1: they take turns); ``specmd calibrate`` measures both alone and together
    host_link_contention: float = _P["host_link_contention"]
    # The weights a one-row product reads (a GEMV: one token through an expert, batch-1 decode's dense layers)
    # stream at this rate, not mem_bandwidth_gbps (a BLAS library runs one row on another kernel than two:
    # on a 2-core VM's CPU 16 GB/s against 7.3); the host's beside it. null: mem_bandwidth_gbps
    gemv_bandwidth_gbps: Optional[float] = _P["gemv_bandwidth_gbps"]
    host_gemv_bandwidth_gbps: Optional[float] = _P["host_gemv_bandwidth_gbps"]
    # The link's first small_copy_mb MB of a copy run at small_copy_gbps, the rest at bandwidth_gbps (a CPU's
    # copies of a few MiB run from and to its last-level cache; a 35 MB expert's do not); the clock's link
    # runs at the rate of the model's expert size. null (both): bandwidth_gbps throughout
    small_copy_gbps: Optional[float] = _P["small_copy_gbps"]
    small_copy_mb: Optional[float] = _P["small_copy_mb"]
    # What ``specmd calibrate`` fitted the profile on: host, device, torch, dtype, model and the expert bytes
    # it covers ({} for a hand-written profile); a run on another says so (docs/semantics.md "How far to
    # trust the clock")
    calibrated_on: Optional[dict] = field(default_factory=dict)
    # The host time a policy's decisions cost per MoE layer call beyond calibrate's reference stack (lru
    # eviction, topk prefetch: theirs is in the fitted overheads above), keyed "<group>/<name>", e.g.
    # {"prefetch/score": 180.0}. Policies run in Python between the router and the experts, serial with
    # compute on a CPU and on a GPU alike; ``specmd calibrate`` times each built-in one. Empty: free.
    policy_overhead_us: Optional[dict] = field(default_factory=dict)
    # Layer streaming (docs/semantics.md "Layer streaming"): a layer call requesting at least this fraction of
    # its layer's experts (a prefill, a large batch) brings its misses through a double-buffered staging area
    # outside the capacity instead of the cache, and the next layer's missing experts move while it computes.
    # null: never (the papers' accounting, and the default: docs/semantics.md says why).
    stream_layers: Optional[float] = _P["stream_layers"]

    def __post_init__(self) -> None:
        for f in fields(self):  # also when built in code, not from a config (whose floats check_type checked)
            if isinstance(getattr(self, f.name), float):
                check_finite(getattr(self, f.name), f"hardware.{f.name}")
        _check_cache(self)
        _check_rates_and_times(self)
        _check_optional_figures(self)
        if not hasattr(self.calibrated_on if self.calibrated_on is not None else {}, "items"):
            raise ConfigError(f"hardware.calibrated_on={self.calibrated_on!r} must be a mapping (what calibrate "
                              f"fitted the profile on)")
        self.calibrated_on = dict(self.calibrated_on or {})
        _check_calibrated_on(self.calibrated_on)
        self.policy_overhead_us = _policy_overheads(self.policy_overhead_us)


def _byte_span(v):
    ok = (isinstance(v, (list, tuple)) and len(v) == 2 and all(finite(x) and x > 0 for x in v) and v[0] <= v[1])
    return None if ok else "[smallest, largest] bytes (two positive numbers)"


def _speeds(v):
    ok = isinstance(v, dict) and all(finite(x) and x > 0 for x in v.values())
    return None if ok else "a mapping of the speed probe's figures to positive numbers"


# what calibrate writes (commands/calibrate/command.py's calibrated_on): read back by profile_mismatch, fidelity's
# drift and placement; a hand-edited or damaged value is one line naming the key (exit 2), never a TypeError
CALIBRATED_ON = {"host": Opt(str), "device": Opt(str), "torch": Opt(str), "dtype": Opt(str), "model": Opt(str),
                 "threads": Opt(whole(1, MAX_THREADS)), "host_threads": Opt(whole(1, MAX_THREADS)),
                 "cores": Opt(whole(1)), "pin": Opt(bool), "expert_bytes": Opt(whole(1)), "kernel_bytes": Opt(_byte_span),
                 "speed": Opt(_speeds)}


def _check_calibrated_on(on: dict) -> None:
    from .errors import DamagedFile

    try:
        check(on, CALIBRATED_ON, "hardware profile", "calibrated_on")
    except DamagedFile as exc:
        raise ConfigError(f"hardware.{exc.why} (what calibrate wrote: a hand-edited or damaged profile; "
                          f"`specmd calibrate` writes it again)") from None


def _check_cache(hw: HardwareConfig) -> None:
    """Check the cache's size and layout: capacity, experts_per_layer, stream_layers and scope."""
    if isinstance(hw.capacity, str):
        if hw.capacity != AUTO:
            raise ConfigError(f"hardware.capacity={hw.capacity!r} must be a fraction in (0, 1] of the model's bytes, "
                              f"or {AUTO} (the device's free memory, execution=offload)")
    elif not (0.0 < hw.capacity <= 1.0):
        raise ConfigError(f"hardware.capacity={hw.capacity} must be in (0, 1] (a fraction of model bytes)")
    epl = hw.experts_per_layer
    if epl is not None and not (0 < epl < 1 or (epl >= 1 and float(epl).is_integer())):
        raise ConfigError(f"hardware.experts_per_layer={epl} must be a whole number of slots >= 1, a fraction "
                          f"in (0, 1) of each layer's experts, or null")
    sl = hw.stream_layers
    if sl is not None and (isinstance(sl, bool) or not isinstance(sl, (int, float)) or not 0.0 < sl <= 1.0):
        raise ConfigError(f"hardware.stream_layers={sl!r} must be a fraction in (0, 1] of a layer's experts "
                          f"(a call requesting at least that many streams its layer), or null (never)")
    mem = hw.memory_gb
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or not 0 < mem <= MAX_MEMORY_GB):
        raise ConfigError(f"hardware.memory_gb={mem!r} must be the device's memory in GiB, in (0, {MAX_MEMORY_GB:g}], "
                          f"or null (the fixed hardware.capacity)")
    res = hw.reserve_gb
    if isinstance(res, bool) or not isinstance(res, (int, float)) or not 0 <= res <= MAX_MEMORY_GB:
        raise ConfigError(f"hardware.reserve_gb={res!r} must be GiB kept for activations, in [0, {MAX_MEMORY_GB:g}]")
    if mem is not None and res >= mem:
        raise ConfigError(f"hardware.reserve_gb={res:g} leaves nothing of hardware.memory_gb={mem:g}")
    if mem is not None and hw.experts_per_layer is not None:
        raise ConfigError(f"hardware.memory_gb={mem:g} sizes the cache from the device's memory; "
                          f"hardware.experts_per_layer={hw.experts_per_layer:g} fixes it: set one of them")
    if hw.scope not in SCOPES:
        raise ConfigError(f"hardware.scope={hw.scope!r}; valid choices: {', '.join(SCOPES)}")
    if hw.layer_budget not in LAYER_BUDGETS:
        raise ConfigError(f"hardware.layer_budget={hw.layer_budget!r}; valid choices: {', '.join(LAYER_BUDGETS)}")
    if hw.layer_budget != "uniform" and hw.scope != "per_layer":
        raise ConfigError(f"hardware.layer_budget={hw.layer_budget} shares the bytes between per-layer pools, and "
                          f"hardware.scope={hw.scope} has one pool: set hardware.scope=per_layer")


def _check_rates_and_times(hw: HardwareConfig) -> None:
    """Check the rates (positive) and times (>= 0), and that each lies within any device's range."""
    for key in RATES:
        if not getattr(hw, key) > 0:
            raise ConfigError(f"hardware.{key}={getattr(hw, key)} must be positive")
    if hw.latency_us < 0:
        raise ConfigError(f"hardware.latency_us={hw.latency_us} must be >= 0")
    for key in TIMES[1:]:
        v = getattr(hw, key)
        if not v >= 0:
            raise ConfigError(f"hardware.{key}={v} must be a finite number >= 0")
    for keys, (lo, hi) in ((RATES, RATE_RANGE), (TIMES, TIME_RANGE)):
        for key in keys:
            if not lo <= getattr(hw, key) <= hi:
                unit = "GB/s" if key.endswith("gbps") else "TFLOP/s" if key.endswith("tflops") else "us"
                raise ConfigError(f"hardware.{key}={getattr(hw, key):g} is outside [{lo:g}, {hi:g}] {unit}, "
                                  f"beyond any device (an exponent typo?): the simulated times would overflow "
                                  f"or vanish")


def _check_optional_figures(hw: HardwareConfig) -> None:
    """Check the rates a profile may leave out, the small-copy pair (both or neither) and the fractions."""
    for key in OPTIONAL_RATES:
        v = getattr(hw, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not RATE_RANGE[0] <= v <= RATE_RANGE[1]):
            raise ConfigError(f"hardware.{key}={v!r} must be a rate in [{RATE_RANGE[0]:g}, {RATE_RANGE[1]:g}] "
                              f"GB/s, or null (the rate beside it serves)")
    mb = hw.small_copy_mb
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0.0 < mb <= 1e12):
        raise ConfigError(f"hardware.small_copy_mb={mb!r} must be a size in (0, 1e12] MB, or null")
    if (mb is None) != (hw.small_copy_gbps is None):
        raise ConfigError(f"hardware.small_copy_gbps={hw.small_copy_gbps!r} and small_copy_mb={mb!r}: give "
                          f"both (a copy's first small_copy_mb MB at small_copy_gbps) or neither")
    for key in FRACTIONS:
        v = getattr(hw, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ConfigError(f"hardware.{key}={v!r} must be a fraction in [0, 1]")


def _policy_overheads(raw) -> dict:
    """``hardware.policy_overhead_us`` checked (keys '<group>/<policy>', times in range), as a plain dict."""
    from .engine import GROUPS  # the policy families: the groups of policy_overhead_us's keys

    table = raw if raw is not None else {}
    if not hasattr(table, "items"):
        raise ConfigError(f"hardware.policy_overhead_us={table!r} must be a mapping '<group>/<policy>': us")
    for key, v in table.items():
        if key.count("/") != 1 or key.split("/")[0] not in GROUPS:
            raise ConfigError(f"hardware.policy_overhead_us: key {key!r} must be '<group>/<policy>' with group "
                              f"one of {', '.join(GROUPS)}, e.g. 'prefetch/score'")
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and TIME_RANGE[0] <= v <= TIME_RANGE[1]):
            raise ConfigError(f"hardware.policy_overhead_us[{key!r}]={v} must be a finite number in "
                              f"[{TIME_RANGE[0]:g}, {TIME_RANGE[1]:g}] us")
    return {str(k): float(v) for k, v in table.items()}  # plain (a profile gives a DictConfig)


def profile_mismatch(hw: HardwareConfig, facts: dict) -> list[str]:
    """What differs between where ``hw`` was calibrated (``hardware.calibrated_on``) and this run's ``facts``
    (``host``, ``device``, ``torch``, ``dtype``, ``threads`` and ``pin`` -- a timed run's compute threads and
    whether they were pinned, issue 56 --, ``model``,
    ``expert_bytes``): one line each, naming both;
    [] for a profile calibrate did not write. The clock's fitted costs belong to the machine, the framework
    and the sizes they were measured at (docs/semantics.md "How far to trust the clock")."""
    on = hw.calibrated_on or {}
    out = []
    for key in ("host", "device", "torch", "dtype", "threads", "pin"):
        if on.get(key) is not None and facts.get(key) is not None and str(on[key]) != str(facts[key]):
            out.append(f"hardware={hw.name} was calibrated with {key} {on[key]}; this run's is {facts[key]}")
    if on.get("model") and facts.get("model") and on["model"] != facts["model"]:
        out.append(f"hardware={hw.name}'s overheads were fitted on model={on['model']}; this run's is "
                   f"model={facts['model']} (`specmd calibrate --model {facts['model']}` fits it)")
    span, eb = on.get("kernel_bytes"), facts.get("expert_bytes")
    if span and eb:  # an expert is three projections (gate, up, down) of about equal size
        if not span[0] <= eb / 3 <= span[1]:
            out.append(f"hardware={hw.name}'s roofline was fitted on weights of {span[0]:.3g}-{span[1]:.3g} bytes; "
                       f"this model's expert projections are {eb / 3:.3g}")
    return out

