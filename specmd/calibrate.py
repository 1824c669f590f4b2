"""``specmd calibrate [--out DIR] [--name NAME] [--model MODEL] [--device DEV] [--quick]``: measure this machine
and write a hardware profile that makes the simulated clock predict what ``execution=offload`` measures.

1. **The link, per host tier**: the transfer path's own copies (:class:`~specmd.executor.transfer.ThreadMover`,
   unthrottled) of 256 KiB .. 16 MiB from host memory (``ram``) and, with the page cache dropped, from a file
   (``disk``); ``latency + nbytes / bandwidth`` fitted by least squares.
2. **Compute**: a float32 GEMM (``peak_tflops``) and a large copy (``mem_bandwidth_gbps``) on the device,
   the same on the host (``host_*``; equal on a CPU-only machine).
3. **What the roofline does not see**: the model (default: the embedded ``deep_olmoe``) generates greedily
   under ``execution=offload`` at capacity 1.0 (every expert resident after the first pass) and at 5% with prefetching;
   each pass's measured compute time minus its roofline time is fitted as ``decoder layers * layer + tokens * token + experts run *
   expert + transfers issued * issue + predictions * prediction`` overheads (non-negative least squares; generations at 5% and 100%
   capacity with prefetching make the transfer and prediction terms identifiable): the costs of eager framework calls and
   of issuing copies that a GPU hides in kernel launches and a CPU does not.
4. **Policy decisions**: each built-in eviction and prefetch policy's host time per MoE layer call beyond
   the reference stack's (lru, topk), timed on the engine (``hardware.policy_overhead_us``).

The profile goes to ``DIR/hardware/<name>.yaml``; the default DIR is the user config directory, which
specmd puts on Hydra's search path (``hardware=<name>`` works at once; with ``--out``, add
``hydra.searchpath=[file://DIR]``). ``<name>_disk.yaml`` carries the disk tier's link.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _fit_link(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of ``t = latency + n / bandwidth`` by least squares."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    slope, icpt = np.polyfit(n, t, 1)
    return 1.0 / max(slope, 1e-15), max(icpt, 0.0)


def measure_ram_link(device: torch.device, reps: int = 7) -> tuple[float, float]:
    """The ``ram`` tier's own copies (:class:`~specmd.executor.tiers.RamTier`, whose packed rows a fetch
    copies) through the transfer channel, from sources cycling through 256 MiB -- more than a last-level cache,
    so a copy reads memory as a fetch of a cold expert does (one source copied over and over measured the
    cache: 50 GB/s on a machine whose memory copies at half that)."""
    from .executor.tiers import BYTES, RamTier, words
    from .executor.transfer import CudaMover, ThreadMover

    mover = CudaMover(None, 0.0, device) if device.type == "cuda" else ThreadMover(None, 0.0)
    points = []
    try:
        for size in SIZES:
            rows = max(4, (256 << 20) // size)
            tier = RamTier([{"w": torch.randint(0, 255, (rows, size), dtype=torch.uint8)}], pin=device.type == "cuda")
            dst = {BYTES: words(torch.empty(size, dtype=torch.uint8, device=device))}
            times = []
            for r in range(reps):
                t = mover.submit(lambda r=r: tier.copy_into(0, (r * 7) % rows, dst), size, True)
                mover.wait(t)
                times.append(t.finished - t.issued)  # the channel as a fetch sees it: hand-off included
            points.append((size, statistics.median(times)))
            del tier
    finally:
        mover.close()
    return _fit_link(points)


def measure_disk_link(device: torch.device, path: Path, reps: int = 5) -> tuple[float, float]:
    """pread into a tensor of the device's (host side) with the page cache dropped before each read."""
    from .executor.transfer import ThreadMover

    total = 64 << 20
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.stat().st_size != total:
        with open(path, "wb") as f:
            f.write(os.urandom(total))
            f.flush()
            os.fsync(f.fileno())  # dirty pages cannot be dropped: the reads below would hit memory
    fd = os.open(path, os.O_RDONLY)
    mover = ThreadMover(None, 0.0)
    points = []
    try:
        for size in SIZES:
            buf = torch.empty(size, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            times = []
            for r in range(reps):
                off = (r * size) % (total - size)
                os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)

                def job(off=off):
                    os.preadv(fd, [mv], off)

                t = mover.submit(job, size, True)
                mover.wait(t)
                times.append(t.finished - t.issued)  # the channel as a fetch sees it: hand-off included
            points.append((size, statistics.median(times)))
    finally:
        mover.close()
        os.close(fd)
    return _fit_link(points)


def measure_compute(device: torch.device) -> tuple[float, float]:
    """(FLOP/s of a float32 GEMM, bytes/s of a large copy counted read + write)."""
    n = 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n ** 3 / best
    x = torch.empty(32 << 20, dtype=torch.float32, device=device)  # 128 MiB
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return flops, 2 * x.numel() * 4 / best


def fit_overheads(model_name: str, hw: dict, device: torch.device, new_tokens: int = 24) -> tuple[dict, dict]:
    """Overheads (µs) from a greedy generation under execution=offload at capacity 1.0: per pass residual =
    measured - roofline, regressed on (1, tokens, experts run). Returns (overheads, fit report)."""
    from .engine import StackSpec
    from .executor import EXECUTION
    from .hardware import HardwareConfig
    from .hook import install
    from .models.loader import local_checkpoint

    model, mcfg = _load(model_name)
    X, y, means = [], [], []
    # two stacks: all resident (no transfers after the first pass), and a small cache with prefetching (many
    # transfers issued): the per-transfer term is identifiable
    for capacity, prefetch in ((1.0, "none"), (0.05, "topk"), (1.0, "topk")):
        hwc = HardwareConfig(**{**hw, "capacity": capacity})
        spec = StackSpec.of(hardware=hwc, prefetch=prefetch)
        spec.execution = EXECUTION.params({"name": "offload", "throttle": True})
        stack = install(model, spec, device=device,
                        checkpoint=local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None)
        model.to(device)
        ex, eng = stack.executor, stack.engine
        copies, preds = [], []  # per pass: transfers issued, prefetch predictions made
        begin, end = ex.begin_pass, ex.end_pass
        ex.begin_pass = lambda kind, tokens: (copies.append(ex.copies), preds.append(eng.predictions),
                                              begin(kind, tokens))
        ex.end_pass = lambda: (end(), copies.__setitem__(-1, ex.copies - copies[-1]),
                               preds.__setitem__(-1, eng.predictions - preds[-1]))
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        try:
            with torch.no_grad():
                for prompt in (8, 32, 96):  # several prefill sizes: the token term is identifiable
                    ids = torch.randint(0, min(vocab, 250), (1, prompt), generator=g).to(device)
                    model.generate(ids, max_new_tokens=new_tokens if prompt == 32 else 4, min_new_tokens=4,
                                   do_sample=False, pad_token_id=0)
        finally:
            stack.remove()
        passes = stack.cache.stats.passes[1:]  # the first pass also warms the framework up
        layers = float(sum(stack.geom.attn_layers) + stack.geom.tail_attn_layers)  # decoder layers
        # compute only on both sides: the measured pass minus its measured stall, against the simulated pass
        # minus its simulated stall (stalls depend on compute speed; fitting them would bias the overheads)
        for p, w, ws, c, q in zip(passes, ex.pass_wall[1:], ex.pass_stall[1:], copies[1:], preds[1:]):
            X.append([layers, p.tokens, p.requests, c, q])
            means.append(w)
            y.append((w - ws) - (p.time_s - p.stall_s))
    X, y = np.array(X), np.array(y)
    coef = _nnls(X, y)
    pred = X @ coef
    report = {"passes": len(passes), "residual_rms_us": float(np.sqrt(np.mean((y - pred) ** 2)) * 1e6),
              "mean_pass_us": float(np.mean(means) * 1e6)}
    return {"layer_overhead_us": float(coef[0] * 1e6), "token_overhead_us": float(coef[1] * 1e6),
            "expert_overhead_us": float(coef[2] * 1e6), "transfer_issue_us": float(coef[3] * 1e6),
            "predict_overhead_us": float(coef[4] * 1e6)}, report


REFERENCE = {"eviction": "lru", "prefetch": "topk"}  # calibrate's reference stack: its costs are in the fit


def measure_policies(model_name: str, hw: dict, device: torch.device, new_tokens: int = 24, reps: int = 3,
                     log=print) -> tuple[dict, dict]:
    """Host microseconds per MoE layer call each built-in eviction and prefetch policy's decisions cost beyond
    the reference stack's (lru, topk: theirs are in the fitted overheads), as ``{"<group>/<name>": us}``
    (``hardware.policy_overhead_us``), and ``{"<group>/<name>": why}`` of those that cannot run in a plain
    live generation (an oracle needs the future). The engine's :meth:`~specmd.engine.Engine.layer` -- every
    cache decision of a layer call, prefetch predictions included -- is timed over a greedy generation at
    the profile's capacity under ``execution=simulated`` (the decisions are the same as offload's; the
    model's compute is not in the timed span), the best of ``reps``, per call. Costs depend on the model's
    geometry (a percentile over E scores, victims scanned over the pool): calibrate with ``--model`` set to
    the geometry you run."""
    from .engine import StackSpec
    from .errors import ConfigError
    from .hardware import HardwareConfig
    from .hook import install
    from .policies import REGISTRIES

    model, _ = _load(model_name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, min(model.config.vocab_size, 250), (1, 48), generator=g).to(device)
    model.to(device)

    def per_call(stack: dict) -> float:
        spec = StackSpec.of(hardware=HardwareConfig(**hw), **stack)
        best = float("inf")
        for _ in range(reps):
            st = install(model, spec, device=device)
            eng = st.engine
            layer, spent = eng.layer, [0.0, 0]

            def timed(*a, **k):
                t0 = time.perf_counter()
                out = layer(*a, **k)
                spent[0] += time.perf_counter() - t0
                spent[1] += 1
                return out

            eng.layer = timed
            try:
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0)
            finally:
                st.remove()
            best = min(best, spent[0] / max(spent[1], 1))
        return best

    ref = per_call({})
    costs, skipped = {}, {}
    for group, reference in REFERENCE.items():
        for name in REGISTRIES[group].names():
            if name in (reference, "none"):
                continue
            key = f"{group}/{name}"
            try:
                costs[key] = max(0.0, (per_call({group: name}) - ref) * 1e6)
            except ConfigError as exc:  # a policy this run cannot host (an oracle): named in the profile; a bug raises
                skipped[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    log(f"  policy decisions ({model_name}, us per layer call beyond lru+topk's {ref * 1e6:.3g} us): "
        + ", ".join(f"{k} {v:.3g}" for k, v in costs.items())
        + (f"; not measured: {', '.join(skipped)}" if skipped else ""))
    return costs, skipped


def _load(model_name: str):
    from omegaconf import OmegaConf

    from . import CONF_DIR
    from .models.loader import ModelConfig, load_model
    from .registry import build_params

    mcfg = build_params(ModelConfig, dict(OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{model_name}.yaml"))), "model")
    return load_model(mcfg)[0], mcfg


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (a handful of columns: try every subset)."""
    import itertools

    best, best_err = np.zeros(X.shape[1]), float("inf")
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(X.shape[1])
            full[list(cols)] = c
            err = float(np.sum((X @ full - y) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def _yaml(name: str, hw: dict, note: list[str]) -> str:
    lines = [f"# {line}" for line in note]
    lines.append(f"name: {name}")
    for k, v in hw.items():
        if isinstance(v, dict):
            lines.append(f"{k}:" + ("" if v else " {}"))
            lines.extend(f'  "{kk}": {vv:.6g}' for kk, vv in v.items())
            continue
        lines.append(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {'null' if v is None else v}")
    return "\n".join(lines) + "\n"


def calibrate(out: str | None = None, name: str | None = None, model: str = "deep_olmoe", device: str = "cpu",
              quick: bool = False, log=print) -> dict:
    from . import user_config_dir
    from .quant.base import cache_dir

    dev = torch.device(device)
    name = name or f"calibrated_{platform.node().split('.')[0] or 'host'}".replace("-", "_")
    root = Path(out) if out else Path(user_config_dir())
    log(f"specmd calibrate: measuring {platform.node()} ({dev}) ...")
    bw, lat = measure_ram_link(dev)
    log(f"  link (host memory -> {dev}): {bw / 1e9:.3g} GB/s, latency {lat * 1e6:.3g} us")
    dbw, dlat = measure_disk_link(dev, cache_dir().parent / "calibrate" / "disk-probe.bin")
    log(f"  link (disk, page cache dropped -> host): {dbw / 1e9:.3g} GB/s, latency {dlat * 1e6:.3g} us")
    flops, mem = measure_compute(dev)
    hflops, hmem = (flops, mem) if dev.type == "cpu" else measure_compute(torch.device("cpu"))
    log(f"  compute: {flops / 1e12:.3g} TFLOP/s (float32 GEMM), memory {mem / 1e9:.3g} GB/s")
    hw = {"capacity": 0.05, "experts_per_layer": None, "scope": "global", "bandwidth_gbps": bw / 1e9,
          "latency_us": lat * 1e6, "peak_tflops": flops / 1e12, "mem_bandwidth_gbps": mem / 1e9,
          "host_tflops": hflops / 1e12, "host_mem_bandwidth_gbps": hmem / 1e9, "timing_as": None}
    fit = {}
    if not quick:
        over, fit = fit_overheads(model, {k: v for k, v in hw.items()}, dev)
        hw.update(over)
        log(f"  overheads ({model}, {fit['passes']} passes): decoder layer {over['layer_overhead_us']:.4g} us, token "
            f"{over['token_overhead_us']:.4g} us, expert {over['expert_overhead_us']:.4g} us, transfer issue "
            f"{over['transfer_issue_us']:.4g} us, prediction {over['predict_overhead_us']:.4g} us (residual rms "
            f"{fit['residual_rms_us']:.3g} us of a {fit['mean_pass_us']:.4g} us mean pass)")
        costs, skipped = measure_policies(model, hw, dev, log=log)
        hw["policy_overhead_us"] = costs
        fit["policies_not_measured"] = skipped
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    note = [f"specmd calibrate, {stamp}, on {platform.node()} ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores), device {dev}, torch {torch.__version__}",
            f"overheads fitted on model={model}" if fit else "overheads not fitted (--quick)"]
    note += [f"policy_overhead_us: {k} not measured ({why})" for k, why in fit.get("policies_not_measured", {}).items()]
    hw_dir = root / "hardware"
    hw_dir.mkdir(parents=True, exist_ok=True)
    path = hw_dir / f"{name}.yaml"
    path.write_text(_yaml(name, hw, note + ["link: host memory (execution.host=ram)"]))
    disk = dict(hw, bandwidth_gbps=dbw / 1e9, latency_us=dlat * 1e6)
    path_disk = hw_dir / f"{name}_disk.yaml"
    path_disk.write_text(_yaml(f"{name}_disk", disk, note + ["link: the disk, page cache dropped (execution.host=disk)"]))
    use = f"hardware={name}" if not out else f"hardware={name} hydra.searchpath=[file://{root.resolve()}]"
    log(f"wrote {path} and {path_disk}\nuse: python -m specmd execution=offload {use}")
    return {"path": str(path), "path_disk": str(path_disk), "hardware": hw, "fit": fit, "name": name}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specmd calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write DIR/hardware/<name>.yaml (default: the user config directory, on "
                                  "Hydra's search path)")
    ap.add_argument("--name", help="profile name (default: calibrated_<host>)")
    ap.add_argument("--model", default="deep_olmoe", help="model config the overheads are fitted on")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="link and compute only (no overhead fit)")
    a = ap.parse_args(argv)
    from .app import check_device
    from .errors import ConfigError

    try:
        check_device(a.device)
    except ConfigError as exc:
        print(f"specmd calibrate: error: {exc}")
        return 2
    calibrate(a.out, a.name, a.model, a.device, a.quick)
    return 0
