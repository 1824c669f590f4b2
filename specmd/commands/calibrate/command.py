"""``specmd calibrate``: its arguments checked (:func:`prepare`), then the stages of the module's doc in order
(:func:`run_stages`), each stage's measurement saved as it completes (:class:`~.measure.Measurements`), and the
two profiles written together (:func:`write_profiles`)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import time
from pathlib import Path

import torch

from ...models.loader import load_configured
from ...results import content_fill, writable_dir, write_files
from .cell import check_profile
from .fit import fit_overheads
from .measure import (Measurements, disk_probe_path, measure_compute, measure_contention, measure_disk_link,
                      measure_host_experts, measure_policies, measure_ram_link, measurement_key, speed_probe)
from .profile import (check_model, check_name, check_output, default_name, inside, profile_yaml,
                      small_copy_fields, use_command)


def prepare(out: str | None, name: str | None, model: str, device: str, threads="auto",
            pin: bool = False) -> tuple[str, Path]:
    """Everything calibrate checks before it measures (minutes of it): the device, the thread settings
    (:func:`check_threads`), the profile name (:func:`~.profile.check_name`; default
    :func:`~.profile.default_name`), the output directory (:func:`~.profile.check_output`), the disk probe's
    directory, and the model (:func:`~.profile.check_model`). Returns (name, hardware directory); ConfigError
    (bad input) or DataError (an unreachable hub) otherwise."""
    from ...checks import check_device

    check_device(device)
    check_threads(threads, pin)
    name = check_name(default_name() if name is None else name)
    hw_dir = check_output(out, name)
    writable_dir(disk_probe_path().parent, "the disk probe's directory ($SPECMD_CACHE)")
    check_model(model)
    return name, hw_dir


def calibrate(out: str | None = None, name: str | None = None, model: str = "deep_olmoe", device: str = "cpu",
              quick: bool = False, log=print, remeasure: bool = False, threads="auto", pin: bool = False) -> dict:
    """Measure this machine and write ``<out or the user config directory>/hardware/<name>.yaml`` (and
    ``<name>_disk.yaml``); see the package's doc. Its arguments are checked first (:func:`prepare`)."""
    name, hw_dir = prepare(out, name, model, device, threads, pin)
    return run_stages(hw_dir, name, out is not None, model, device, quick, log, remeasure, threads, pin)


def check_threads(threads, pin) -> None:
    """``--threads`` is ``auto`` or an integer >= 1, and ``--pin`` possible here: ConfigError otherwise."""
    from ...errors import ConfigError
    from ...machine import can_pin, threads_error

    why = threads_error(threads, "--threads")
    if why:
        raise ConfigError(why)
    if pin and not can_pin():
        raise ConfigError("--pin needs Linux's sched_setaffinity, which this platform lacks")


def thread_plan(threads, pin: bool, dev: torch.device):
    """The thread placement calibrate measures at: an offloaded run's (:class:`specmd.machine.CorePlan`: a copy
    thread beside the compute threads; on CUDA a host lane of its own, as ``miss=hybrid`` has there), so that
    a run at the same ``execution.threads``/``pin`` is timed as the profile was fitted."""
    from ...accel import accel_for
    from ...machine import CorePlan

    return CorePlan.plan(threads, "auto", pin, copy_thread=True, host_lane=accel_for(dev) is not None)


def run_stages(hw_dir: Path, name: str, out: bool, model: str, device: str, quick: bool, log,
               remeasure: bool = False, threads="auto", pin: bool = False) -> dict:
    """The measurements of the package's doc, 1 to 4, at the thread placement :func:`thread_plan` (applied to this
    process for the whole calibration, each offloaded install applying the same), then the profiles written
    and (not ``quick``) checked."""
    from ...executor.base import steady_host_allocator
    from .cell import offload_execution

    t_start = time.perf_counter()
    log = _timed(log, t_start)
    steady_host_allocator()  # as execution=offload measures: the fit and the runs it predicts see the same heap
    dev = torch.device(device)
    plan = thread_plan(threads, pin, dev)
    execution = offload_execution(plan.threads, plan.pin, plan.host_threads if plan.host_lane else "auto")
    undo = plan.enter()
    try:
        return _stages(hw_dir, name, out, model, dev, quick, log, remeasure, plan, execution, t_start)
    finally:
        undo()


def check_measured(hw: dict, ms: Measurements) -> None:
    """The machine's figures make a profile (every rate and time in its range): otherwise a measurement fault --
    an H200's link timed to where its copies were *issued* came out at 9.4e4 GB/s and failed later, blamed on
    ``hardware.small_copy_gbps`` -- is calibrate's own error (a bug, exit 1), and its saved measurements are
    removed, so the next calibrate measures anew instead of reusing them."""
    from ...errors import ConfigError
    from ...hardware import HardwareConfig

    try:
        HardwareConfig(**hw)
    except ConfigError as exc:
        ms.path.unlink(missing_ok=True)
        raise RuntimeError(f"calibrate measured figures no device has ({exc}): a measurement fault, not a setting; "
                           f"its saved measurements ({ms.path}) are removed, so the next calibrate measures anew") \
            from None


def _stages(hw_dir, name, out, model, dev, quick, log, remeasure, plan, execution, t_start) -> dict:
    ms = Measurements(measurement_key(model, str(dev), plan), remeasure)
    log(f"specmd calibrate: measuring {platform.node()} ({dev}) at {placement_words(plan)} ..."
        + (f" (reusing measurements of an earlier calibrate: {ms.path}; --remeasure measures anew)" if ms.data else ""))
    for why in ms.dropped:
        log(f"  not reused (measured again): {why}")
    ln, dk, cp = measure_machine(ms, dev, log, plan)
    hw = base_profile(ln, cp, dev)
    check_measured(hw, ms)
    cont = measure_host_side(ms, model, hw, dev, log, plan)
    fit = {} if quick else measure_overheads(ms, model, hw, dev, log, execution)
    if quick:
        log("  --quick: skipped the policies' decision costs, the overhead fit and the check (the simulated clock "
            "then leaves out the framework's per-layer, per-token and per-expert costs)")
    if ms.reused:
        log(f"  reused from an earlier calibrate: {', '.join(ms.reused)}")
    hw["calibrated_on"] = calibrated_on(model, dev, cp["kernel"], plan)
    path, path_disk = write_profiles(hw_dir, name, hw, dk, _note(model, dev, fit))
    check = {}
    if not quick:
        check = check_profile(model, hw, dev, execution=execution)
        log("  check (measured / simulated with this profile, 5%, lru + topk, 256-token prompt + 12 decodes): "
            + "; ".join(f"miss={k}: TTFT {v['ttft']:.2f}, TPOT {v['tpot']:.2f}" for k, v in check.items()))
    use = use_command(name, hw_dir.parent if out else None)
    log(f"wrote {path} and {path_disk} in {time.perf_counter() - t_start:.0f} s\n"
        f"how far to trust it: specmd fidelity --profile {shlex.quote(str(path))}\n"
        f"use: python -m specmd execution=offload {use}{_execution_overrides(plan)}")
    components = {"link": ln["report"], "disk": dk["report"], "kernel": cp["kernel"], "host_kernel": cp["host_kernel"],
                  "contention": cont[1]}
    return {"path": str(path), "path_disk": str(path_disk), "hardware": hw, "fit": fit, "name": name, "check": check,
            "components": components, "reused": ms.reused}


def _timed(log, t_start: float):
    """``log`` with each line followed by the seconds since ``t_start`` (each stage's time)."""
    return lambda m: log(f"{m}  [{time.perf_counter() - t_start:.0f} s]")


def placement_words(plan) -> str:
    """The thread placement in words (calibrate's and fidelity's headers)."""
    r = plan.record()
    where = (f", pinned: compute cores {r['compute_cores']}, copy {r['copy_cores']}"
             + (f", host {r['host_cores']}" if r["host_cores"] else "")) if plan.pin else ", not pinned"
    return (f"{plan.threads} compute thread{'s' if plan.threads > 1 else ''} + a copy thread"
            + (f" + {plan.host_threads} host thread{'s' if plan.host_threads > 1 else ''}" if plan.host_lane else "")
            + f" on {plan.cores} core{'s' if plan.cores > 1 else ''}{where}")


def _execution_overrides(plan) -> str:
    """The overrides that run at the profile's thread settings where auto would not give them."""
    from ...machine import CorePlan

    auto = CorePlan.plan(cores=plan.cores, host_lane=plan.host_lane)
    extra = [] if auto.threads == plan.threads else [f"execution.threads={plan.threads}"]
    return "".join(" " + x for x in extra + (["execution.pin=true"] if plan.pin else []))


def measure_machine(ms: Measurements, dev: torch.device, log, plan=None) -> tuple[dict, dict, dict]:
    """1 and 2 of the package's doc: the link from host memory and from the disk, and the compute roofline
    (the device's and the host's), each a saved stage (``plan``: the copy thread's placement)."""
    def link():
        rep = {}
        bw, lat = measure_ram_link(dev, report=rep, plan=plan)
        return {"bw": bw, "lat": lat, "report": rep}

    def disk():
        rep = {}
        bw, lat = measure_disk_link(dev, disk_probe_path(), report=rep, plan=plan)
        return {"bw": bw, "lat": lat, "report": rep}

    def compute():
        flops, mem, kern = measure_compute(dev)
        hflops, hmem, hkern = (flops, mem, kern) if dev.type == "cpu" else measure_compute(torch.device("cpu"))
        return {"flops": flops, "mem": mem, "kernel": kern, "hflops": hflops, "hmem": hmem, "host_kernel": hkern}

    ln, dk, cp = ms.stage("link", link), ms.stage("disk", disk), ms.stage("compute", compute)
    log(f"  link (host memory -> {dev}): {ln['bw'] / 1e9:.3g} GB/s{_small(ln['report'])}, latency {ln['lat'] * 1e6:.3g} "
        f"us (fit: median error {ln['report']['median_abs_err']:.1%}, worst {ln['report']['max_abs_err']:.1%})")
    log(f"  link (disk, page cache dropped -> host): {dk['bw'] / 1e9:.3g} GB/s{_small(dk['report'])}, latency "
        f"{dk['lat'] * 1e6:.3g} us")
    kern = cp["kernel"]
    log(f"  compute (the experts' kernel, {len(kern['points'])} shapes): {cp['flops'] / 1e12:.3g} TFLOP/s, weights "
        f"read at {cp['mem'] / 1e9:.3g} GB/s (one row: {kern['gemv_bw'] / 1e9:.3g}), serial {kern['serial']:.2f} "
        f"(fit: median error "
        f"{kern['median_abs_err']:.1%}, worst {kern['max_abs_err']:.1%})"
        + (f"; host {cp['hflops'] / 1e12:.3g} TFLOP/s, {cp['hmem'] / 1e9:.3g} GB/s" if dev.type != "cpu" else ""))
    return ln, dk, cp


def base_profile(ln: dict, cp: dict, dev: torch.device) -> dict:
    """The profile's fields from the link and the roofline (the host-memory link's: the disk twin replaces
    them, :func:`write_profiles`)."""
    kern = cp["kernel"]
    return {"capacity": 0.05, "experts_per_layer": None, "scope": "global", "bandwidth_gbps": ln["bw"] / 1e9,
            "latency_us": ln["lat"] * 1e6, "peak_tflops": cp["flops"] / 1e12, "mem_bandwidth_gbps": cp["mem"] / 1e9,
            "host_tflops": cp["hflops"] / 1e12, "host_mem_bandwidth_gbps": cp["hmem"] / 1e9,
            "roofline_serial": kern["serial"], "host_roofline_serial": cp["host_kernel"]["serial"],
            "gemv_bandwidth_gbps": kern["gemv_bw"] / 1e9,
            "host_gemv_bandwidth_gbps": cp["host_kernel"]["gemv_bw"] / 1e9,
            **small_copy_fields(ln["report"]), "timing_as": None,
            # a GPU queues kernels ahead of the device: the host's overheads overlap its compute (SimClock)
            "host_overlap": dev.type == "cuda"}


def measure_host_side(ms: Measurements, model: str, hw: dict, dev: torch.device, log, plan=None) -> tuple:
    """2 of the package's doc, continued: the host and the link at once, and the host's experts; into ``hw``.
    Returns the contention stage (its fraction and report)."""
    from ...accel import accel_for

    cont = ms.stage("contention", lambda: measure_contention(dev, hw, plan=plan))
    hw["host_link_contention"] = cont[0]
    log(f"  contention (host experts and copies at once): {cont[0]:.2f} of the overlap (host alone "
        f"{cont[1]['host_ms']:.2f} ms, copies alone {cont[1]['link_ms']:.2f} ms, together {cont[1]['together_ms']:.2f} ms)")

    def host_experts():
        loaded, mcfg = load_configured(model)
        return measure_host_experts(loaded, mcfg.family, hw, dev, plan=plan)

    host, cases = ms.stage("host_experts", host_experts)
    hw.update(host)
    log(f"  host experts ({model}, {'on the host worker' if accel_for(dev) is not None else 'inline'}): "
        f"{host['host_call_overhead_us']:.3g} us per batch + {host['host_expert_overhead_us']:.3g} us per expert + "
        f"{host['host_token_overhead_us']:.3g} us per token beyond the roofline (measured: "
        + ", ".join(f"{k} {v:.0f} us" for k, v in cases.items()) + ")")
    return cont


def measure_overheads(ms: Measurements, model: str, hw: dict, dev: torch.device, log, execution=None) -> dict:
    """3 and 4 of the package's doc, into ``hw``: the policies' decision costs first (the fit's low-precision
    stack, ``miss=fetch_priority``, is then simulated with its decision cost, and the unpack term is what is
    left), then the overheads fitted on the model's runs. Returns the fit's report."""
    costs, skipped = ms.stage("policies", lambda: measure_policies(model, hw, dev, log=log))  # (simulated: no copy
    # thread; on the compute threads calibrate runs at)
    hw["policy_overhead_us"] = costs
    # (fitted as costs that add to compute; on a GPU the clock overlaps them with the device's compute per
    # segment between synchronisations: the tiny fit model's device time is ~0, where the two agree)
    over, fit = ms.stage("overheads", lambda: fit_overheads(model, dict(hw, host_overlap=False), dev,
                                                            execution=execution))
    fit["policies_not_measured"] = skipped
    hw.update(over)
    if "host_call_overhead_us" in over:
        log(f"  host experts in the model's runs (miss=hybrid): {over['host_call_overhead_us']:.3g} us per batch + "
            f"{over['host_expert_overhead_us']:.3g} us per expert + {over['host_token_overhead_us']:.3g} us per "
            f"token (these replace the ones above)")
    log(f"  overheads ({model}, {fit['passes']} passes): decoder layer {over['layer_overhead_us']:.4g} us, token "
        f"x layer {over['layer_token_overhead_us']:.4g} us, expert {over['expert_overhead_us']:.4g} us, transfer issue "
        f"{over['transfer_issue_us']:.4g} us, expert placed {over['place_overhead_us']:.4g} us, prediction "
        f"{over['predict_overhead_us']:.4g} us, unpacking a "
        f"low-precision expert {over['unpack_overhead_us']:.4g} us")
    log(f"  fit: residual rms {fit['native_residual_rms_us']:.3g} us of a {fit['native_mean_pass_us']:.4g} us mean "
        f"pass ({fit['native_residual_rms_us'] / fit['native_mean_pass_us']:.1%}) on the native stacks, "
        f"{fit['low_residual_rms_us']:.3g} us on the low-precision ones (all: "
        f"{fit['residual_rms_us'] / fit['mean_pass_us']:.1%}), relative rms {fit['relative_rms']:.1%}; mean "
        f"relative error " + ", ".join(f"{k} {v:+.1%}" for k, v in fit["relative_by_pass"].items()))
    return fit


def calibrated_on(model: str, dev: torch.device, kern: dict, plan=None) -> dict:
    """The profile's ``calibrated_on``: this host, device, torch, the thread placement it was measured at
    (``threads``, ``pin``, ``host_threads``, ``cores``: a run at other settings is told, and ``specmd fidelity``
    runs at these; issue 56), the model's dtype and expert bytes, the kernel sizes fitted on, and the machine's
    speed as the profile was fitted (not saved with the measurements: a reused stage was measured then, the
    probe says now)."""
    geom = _geometry(model)
    placed = {"threads": plan.threads, "pin": plan.pin, "host_threads": plan.host_threads, "cores": plan.cores} \
        if plan is not None else {"threads": torch.get_num_threads()}
    return {"host": platform.node(), "device": str(dev), "torch": torch.__version__, **placed,
            "dtype": geom["dtype"], "model": model, "expert_bytes": geom["expert_bytes"],
            "kernel_bytes": [min(p["bytes"] for p in kern["points"]), max(p["bytes"] for p in kern["points"])],
            "speed": speed_probe(dev)}


def _note(model: str, dev: torch.device, fit: dict) -> list:
    """The profile's comment lines: when, where and how it was calibrated."""
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    note = [f"specmd calibrate, {stamp}, on {platform.node()} ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores), device {dev}, torch {torch.__version__}",
            f"overheads fitted on model={model}" if fit else "overheads not fitted (--quick)"]
    return note + [f"policy_overhead_us: {k} not measured ({why})"
                   for k, why in fit.get("policies_not_measured", {}).items()]


def write_profiles(hw_dir: Path, name: str, hw: dict, dk: dict, note: list) -> tuple[Path, Path]:
    """``<name>.yaml`` (the host-memory link) and ``<name>_disk.yaml`` (the disk's), both complete or neither
    (:func:`specmd.results.write_files`): an interrupted calibrate leaves no half profile for
    ``hardware=<name>`` to find, and a full disk keeps what calibrate measured elsewhere, named."""
    from ...errors import ConfigError

    path, path_disk = hw_dir / f"{name}.yaml", hw_dir / f"{name}_disk.yaml"
    for p in (path, path_disk):  # (checked before measuring; asserted again where it is written)
        if not inside(p, hw_dir):
            raise ConfigError(f"--name {name!r}: {p} is not inside {hw_dir}")
    disk = dict(hw, bandwidth_gbps=dk["bw"] / 1e9, latency_us=dk["lat"] * 1e6, **small_copy_fields(dk["report"]))
    write_files([(path, content_fill(profile_yaml(name, hw, note + ["link: host memory (execution.host=ram)"]))),
                 (path_disk, content_fill(profile_yaml(f"{name}_disk", disk, note + [
                     "link: the disk, page cache dropped (execution.host=disk)"])))],
                what="what calibrate measured")
    return path, path_disk


def _small(report: dict) -> str:
    f = small_copy_fields(report)
    return f" ({f['small_copy_gbps']:.3g} GB/s up to {f['small_copy_mb']:.3g} MB)" if f["small_copy_gbps"] else ""


def _geometry(model: str) -> dict:
    """The model config's dtype and expert bytes (its geometry; no weights loaded)."""
    from ...models.loader import configured_model, model_geometry

    cfg = configured_model(model)
    return {"dtype": str(cfg.dtype), "expert_bytes": int(model_geometry(cfg).expert_bytes)}
