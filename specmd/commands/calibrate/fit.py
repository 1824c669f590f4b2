"""What calibrate fits (the package's doc): the link's two regimes (:func:`fit_link`), the kernel's roofline
(:func:`fit_kernel`), and the overheads the roofline does not see, from the model's own runs under
``execution=offload`` (:func:`fit_overheads`: the passes measured by :func:`overhead_passes`, fitted by
:func:`fit_passes`); then the profile's own check (:func:`check_profile`)."""

from __future__ import annotations

import statistics

import numpy as np
import torch

from ...models.loader import load_configured

def fit_link(points: list[tuple[int, float]], report: dict | None = None) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the link's copies, ``t = latency + min(n, K) / small + max(0, n - K) /
    bandwidth``: the first ``K`` bytes of a copy at the ``small`` rate (``hardware.small_copy_gbps``,
    ``small_copy_mb``), the knee ``K`` one of the measured sizes or none (one rate), whichever fits best by
    least squares on relative error (SciPy's bounded linear least squares; on absolute error the 16 MiB
    copies' jitter, +-100 us, set the latency: 0-65 us from run to run). On this 2-core VM a copy of up to
    4-8 MiB ran at 9-18 GB/s (five calibrations) and beyond at 6-8: one rate over 64 kB-32 MiB came out at 11 GB/s and put a 35 MB
    expert's copy at 0.6 of its time. ``report`` (a dict) receives ``small_bw`` and ``small_bytes`` (None:
    no knee), each point's measured and fitted microseconds and the fit's median and worst error."""
    from scipy.optimize import lsq_linear

    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    best = None
    for knee in [None] + sorted(set(n))[1:-2]:  # (a knee leaves >= 2 sizes beyond it to fit its rate)
        head = n if knee is None else np.minimum(n, knee)
        X = np.stack([np.ones_like(n), head, n - head], axis=1) / t[:, None]
        if knee is None:
            X = X[:, :2]
        fit = lsq_linear(X, np.ones_like(t), bounds=(0.0, np.inf))
        if knee is not None and not 0.0 < fit.x[1] < fit.x[2]:
            continue  # (a knee only where the small copies run faster: else one rate, the no-knee fit)
        pred = (X @ fit.x) * t
        err = float(np.sum((pred / t - 1) ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, knee, fit.x, pred)
    _, knee, x, pred = best
    lat = float(x[0])
    if knee is None:
        slope, small_bw, small_bytes = x[1], None, None
    else:
        slope, small_bw, small_bytes = x[2], 1.0 / x[1], float(knee)
    bw = 1.0 / max(float(slope), 1e-15)
    if report is not None:
        report.update({"small_bw": small_bw, "small_bytes": small_bytes,
                       "points": [{"bytes": float(a), "measured_us": float(b * 1e6), "fitted_us": float(c * 1e6)}
                                  for a, b, c in zip(n, t, pred)],
                       "median_abs_err": float(np.median(np.abs(pred / t - 1))),
                       "max_abs_err": float(np.max(np.abs(pred / t - 1)))})
    return bw, lat


def fit_kernel(pts: list[tuple[float, float, int, float]]) -> tuple[float, float, dict]:
    """:func:`measure_compute`'s fit of its points (flops, weight bytes, rows, seconds)."""
    from scipy.optimize import least_squares

    F, B, R, T = (np.array(c, dtype=float) for c in zip(*pts))
    one = R == 1

    def model(p):  # p: log peak, log bandwidth, log one-row bandwidth, launch seconds, serial
        c, m = F / np.exp(p[0]), B / np.exp(np.where(one, p[2], p[1]))
        return p[3] + np.maximum(c, m) + p[4] * np.minimum(c, m)

    # (a max is not smooth: started from each corner of the rates' lower bounds and the serial share, the best
    # fit kept)
    lo = [np.log(np.max(F / T)), np.log(np.max(B / T)), np.log(np.max(B / T))]
    fit = min((least_squares(lambda p: model(p) / T - 1.0, [lo[0] + a, lo[1] + b, lo[2] + b, 0.0, s],
                             bounds=([-np.inf] * 3 + [0.0, 0.0], [np.inf] * 4 + [1.0]), method="trf")
               for a in (0.0, 2.0) for b in (0.0, 1.0) for s in (0.0, 0.5, 1.0)), key=lambda f: f.cost)
    peak, bw, gemv = (float(np.exp(fit.x[i])) for i in range(3))
    pred = model(fit.x)
    report = {"serial": float(fit.x[4]), "launch_us": float(fit.x[3] * 1e6), "gemv_bw": gemv,
              "points": [{"flops": float(a), "bytes": float(b), "rows": int(r), "measured_us": float(t * 1e6),
                          "fitted_us": float(p * 1e6)} for a, b, r, t, p in zip(F, B, R, T, pred)],
              "median_abs_err": float(np.median(np.abs(pred / T - 1))),
              "max_abs_err": float(np.max(np.abs(pred / T - 1)))}
    return peak, bw, report


# prefill sizes: the token and expert terms are identifiable, and a long prompt's TTFT (GSM8K's 5-shot prompts:
# ~480 tokens) is inside the fitted range: fitted on 8-128 only, the token term came out anywhere in 70-220 us
# and its extrapolation to 480 tokens put TTFT at 0.75-1.0 of measured
PROMPTS = (8, 32, 128, 448)


# the stored copies calibrate's low-precision runs fetch (optimize=false: quantized in seconds; unpacking
# costs the same either way)
LOW_QUANT = {"name": "hqq", "precisions": ["int8", "int4", "int2"], "optimize": False}


def fit_overheads(model_name: str, hw: dict, device: torch.device, new_tokens: int = 10, reps: int = 3,
                  execution: dict | None = None) -> tuple[dict, dict]:
    """Overheads (µs) from greedy generations under execution=offload (``execution``: its section, at the
    profile's thread settings); per pass residual = measured - roofline, regressed on (decoder layers, tokens,
    experts run, copy jobs issued, predictions made, experts placed; then experts unpacked). Returns (overheads,
    fit report).

    Robust by construction, because a single pass of a few ms on a shared CPU varies by tens of percent
    (single-pass fits gave a token overhead anywhere in 0-257 us on the same machine, and TTFT predictions
    0.65-1.0 of measured):

    - every generation runs ``reps`` times, each in a **fresh process** (issue 56: a process's kernels ran in
      one of two speed modes on this VM, fixed for its life: repetitions in one process all land in its mode)
      and a fresh install in it (cold cache: the same decisions, so the same regressors), and each pass's
      residual is the **median** over the repetitions;
    - prefills of ``PROMPTS`` tokens (not one or two sizes): tokens and experts run vary independently
      enough to separate their terms, and TTFT's prompt lies inside the range it is predicted from;
    - each term has a stack that moves it alone (:data:`OVERHEAD_STACKS`): copies without predictions and
      predictions without copies, so the per-expert, per-issue and per-prediction costs no longer trade off
      (fitted without the first, the prediction cost came out anywhere in 4-119 us over four fits);
    - rows are weighted by 1 / the pass's measured time, so the fit minimises *relative* error: the many
      short decode passes do not outvote the few prefills (TTFT and TPOT are judged by ratios);
    - one generation before the repetition warms each process (first calls of kernels, allocator), and one
      at the start of each install, discarded, its first evictions (as ``specmd fidelity``'s cells do)."""
    rows, host_calls, geom = overhead_passes(model_name, hw, device, new_tokens, reps, execution)
    over, report = fit_passes(rows, reps)
    return {**over, **fit_host(host_calls, geom, hw)}, report


# six stacks: all resident (no transfers after the first pass), a small cache fetching on demand (copies
# without predictions), a small cache with prefetching (many transfers issued), all resident with prefetching
# (predictions without transfers), and two small caches fetching stored low-precision copies (experts unpacked
# before they run; with two stacks' policies, since the arena's compactions come with the unpacking): each term
# is identifiable. The seventh, hybrid, times the host's experts per call (not in the pass fit).
# (capacity, prefetch, other groups)
_LOW = {"miss": "fetch_priority", "quant": LOW_QUANT}
OVERHEAD_STACKS = ((1.0, "none", {}), (0.05, "none", {}), (0.05, "topk", {}), (1.0, "topk", {}), (0.05, "topk", _LOW),
                   (0.05, "score", dict(_LOW, eviction="least_stale")),  # unpacking's cost with two stacks' arenas
                   (0.05, "topk", {"miss": "hybrid"}))


def overhead_passes(model_name: str, hw: dict, device: torch.device, new_tokens: int, reps: int,
                    execution: dict | None = None) -> tuple:
    """The passes :func:`fit_overheads` fits, each repetition in a fresh process run after the other
    (:func:`process_passes`): ``({(stack, prompt, pass): [regressors per rep, residual per rep, measured per
    rep]}, host banks [(experts, rows, seconds)] of the hybrid stack, the model's geometry: expert_params,
    expert_bytes)``."""
    rows: dict[tuple, list] = {}
    host_calls: list = []
    geom = None
    from ...machine import process_mask

    mask = process_mask()  # (the child starts on the cores this thread is pinned to: it plans on the process's)
    for _ in range(reps):
        got = _in_fresh_process({"model": model_name, "hw": hw, "device": str(device), "new_tokens": new_tokens,
                                 "execution": execution, "mask": sorted(mask) if mask is not None else None})
        for key, (x, y, m) in got["rows"]:
            row = rows.setdefault(tuple(key), [[], [], []])
            row[0] += x
            row[1] += y
            row[2] += m
        host_calls += [tuple(c) for c in got["host_calls"]]
        geom = got["geometry"]
    from types import SimpleNamespace

    return rows, host_calls, SimpleNamespace(**geom)


def _in_fresh_process(job: dict) -> dict:
    """:func:`process_passes` of ``job`` in a new Python process (killed if this one is interrupted:
    ``subprocess.run``), its result read back from a JSON file; a failure raises with the child's last lines."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="specmd-calibrate-") as d:
        src, dst = Path(d) / "job.json", Path(d) / "passes.json"
        src.write_text(json.dumps(job))
        code = "import sys; from specmd.commands.calibrate.fit import child_main; child_main(sys.argv[1:])"
        r = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True)
        if r.returncode != 0 or not dst.is_file():
            raise RuntimeError(f"calibrate's overhead fit: its process failed (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout)[-2000:]}")
        return json.loads(dst.read_text())


def child_main(argv: list) -> None:
    """The fresh process of :func:`_in_fresh_process`: ``argv`` = (job JSON path, result JSON path)."""
    import json
    from pathlib import Path

    from ...executor.base import steady_host_allocator

    job = json.loads(Path(argv[0]).read_text())
    if job.get("mask"):  # the parent's process mask, not its pinned compute cores
        import os

        os.sched_setaffinity(0, job["mask"])
    steady_host_allocator()  # (as execution=offload measures, and the parent did)
    rows, host_calls, geom = process_passes(job["model"], job["hw"], torch.device(job["device"]), job["new_tokens"],
                                            job["execution"])
    out = {"rows": [[list(k), v] for k, v in rows.items()], "host_calls": host_calls,
           "geometry": {"expert_params": int(geom.expert_params), "expert_bytes": int(geom.expert_bytes)}}
    Path(argv[1]).write_text(json.dumps(out))


def process_passes(model_name: str, hw: dict, device: torch.device, new_tokens: int,
                   execution: dict | None = None) -> tuple:
    """One process's repetition: the model loaded, a warm-up repetition of two prompts per stack (discarded),
    then every stack of :data:`OVERHEAD_STACKS` in a fresh install; ``(rows, host banks, geometry)`` as
    :func:`overhead_passes` (one repetition per row)."""
    from ...models.loader import local_checkpoint

    model, mcfg = load_configured(model_name)
    model.to(device)
    ckpt = local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None
    vocab = model.config.vocab_size  # (token ids over the whole vocabulary: routing as diverse as text's -- ids
    # below 250 routed a 480-token prefill to fewer experts than a GSM8K prompt, and the transfer term came out
    # too large: the default job's TTFT at 0.71-0.87 of the prediction)
    longest = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    prompts = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
               for n in PROMPTS if n + new_tokens <= longest]
    rows: dict[tuple, list] = {}
    host_calls: list = []  # (experts, rows, seconds) of every host bank the hybrid stack computed
    geom = None
    for rep in (-1, 0):  # rep -1: the warm-up, discarded
        for si, stack_of in enumerate(OVERHEAD_STACKS):
            geom = _one_install(model, hw, device, ckpt, prompts, new_tokens, rep, si, stack_of, rows, host_calls,
                                execution)
    return rows, host_calls, geom


def _one_install(model, hw, device, ckpt, prompts, new_tokens, rep, si, stack_of, rows, host_calls, execution=None):
    """One repetition of one stack of :data:`OVERHEAD_STACKS` in a fresh install: its passes into ``rows``
    (not the warm-up's, nor the hybrid stack's, whose host banks go to ``host_calls``). Returns the geometry."""
    from ...compose import spec_of
    from ...executor import EXECUTION
    from ...hardware import HardwareConfig
    from ...hook import install

    capacity, prefetch, extra = stack_of
    spec = spec_of(hardware=HardwareConfig(**{**hw, "capacity": capacity}), prefetch=prefetch, **extra)
    spec.execution = EXECUTION.params(execution or {"name": "offload", "throttle": True})
    stack = install(model, spec, device=device, checkpoint=ckpt)
    hybrid = extra.get("miss") == "hybrid"
    counts = _count_per_pass(stack.executor, stack.engine)
    first = []  # pass index where each prompt's generation starts
    try:
        with torch.no_grad():
            # the install's first generation, discarded: its first prefill pays what a run pays once (the first
            # evictions, the first activations of a size) -- counted, it put the 8-token prefills 8% above the
            # fit and the fit 7-13% above a warmed 32-token prefill
            if rep >= 0:  # (the warm-up repetition is discarded whole)
                model.generate(torch.flip(prompts[1], (1,)), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                               pad_token_id=0)
            skip = len(counts)
            if hybrid:  # (its host banks timed from here on)
                stack.executor.host_worker.calls = host_calls if rep >= 0 else None
            for pi, ids in enumerate(prompts if rep >= 0 else prompts[:2]):
                first.append(len(counts))
                n = new_tokens if pi == 2 else 2
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        stack.remove()
    if rep >= 0 and not hybrid:
        _add_rows(rows, si, stack, counts, first, skip)
    return stack.geom


def _count_per_pass(ex, eng) -> list:
    """Per pass of executor ``ex``: (copy jobs issued, predictions made, experts placed, experts unpacked),
    counted by wrapping its pass boundaries (the counts at a pass's start, then its deltas)."""
    counts: list = []
    begin, end = ex.begin_pass, ex.end_pass
    place = ex.placement
    ex.begin_pass = lambda kind, tokens: (counts.append((place.jobs, eng.predictions, place.copies,
                                                         place.low_runs)), begin(kind, tokens))
    ex.end_pass = lambda: (end(), counts.__setitem__(-1, (place.jobs - counts[-1][0], eng.predictions - counts[-1][1],
                                                           place.copies - counts[-1][2],
                                                           place.low_runs - counts[-1][3])))
    return counts


def _add_rows(rows: dict, si: int, stack, counts: list, first: list, skip: int) -> None:
    """Each counted pass of ``stack`` (from ``skip``) as a row ``(stack, prompt, pass)``: its regressors, and
    compute only on both sides: the measured pass minus its measured stall, against the simulated pass minus its
    simulated stall (stalls depend on compute speed; fitting them would bias the overheads)."""
    ex = stack.executor
    layers = float(sum(stack.geom.attn_layers) + stack.geom.tail_attn_layers)  # decoder layers
    passes = stack.cache.stats.passes
    for i, (p, w, ws, (c, q, pl, u)) in enumerate(zip(passes, ex.pass_wall, ex.pass_stall, counts)):
        if i < skip:
            continue
        pi = max(j for j, f in enumerate(first) if f <= i)
        row = rows.setdefault((si, pi, i - first[pi]), [[], [], []])
        row[0].append([layers, p.tokens * layers, p.requests, c, q, pl, u])  # equal across reps but where
        # wall-clock arrival times changed a decision (a prefetch still in flight): the median of those too
        row[1].append((w - ws) - (p.time_s - p.stall_s))
        row[2].append(w - ws)


def fit_passes(rows: dict, reps: int) -> tuple[dict, dict]:
    """The overheads from :func:`overhead_passes`' rows: native stacks first (six terms, non-negative least
    squares on relative error); then the unpack term alone on the low-precision stacks' residuals given those:
    their passes vary more (unpacking differs by precision, compactions come and go) and, fitted jointly,
    moved the token term by 3x. (A column scaling the roofline's share was tried: on a CPU the roofline is 1-7%
    of a pass and collinear with the token term, and its fitted scale swung from 0.05 to 5 between runs.)"""
    X = np.array([np.median(r[0], axis=0) for r in rows.values()], dtype=float)
    y = np.array([statistics.median(r[1]) for r in rows.values()])
    m = np.array([statistics.median(r[2]) for r in rows.values()])
    native = np.array([not OVERHEAD_STACKS[k[0]][2] for k in rows])
    coef = np.zeros(X.shape[1])
    coef[:6] = nnls(X[native, :6] / m[native, None], y[native] / m[native])
    u, r = X[~native, 6] / m[~native], (y[~native] - X[~native, :6] @ coef[:6]) / m[~native]
    coef[6] = max(0.0, float(u @ r) / float(u @ u)) if (u > 0).any() else 0.0
    # (the token term per token per decoder layer: fitted per token of a pass on one depth, it did not carry to
    # a model of another: see HardwareConfig.layer_token_overhead_us)
    over = {"layer_overhead_us": float(coef[0] * 1e6), "token_overhead_us": 0.0,
            "layer_token_overhead_us": float(coef[1] * 1e6),
            "expert_overhead_us": float(coef[2] * 1e6), "transfer_issue_us": float(coef[3] * 1e6),
            "predict_overhead_us": float(coef[4] * 1e6), "place_overhead_us": float(coef[5] * 1e6),
            "unpack_overhead_us": float(coef[6] * 1e6)}
    return over, _fit_report(list(rows), X @ coef - y, m, native, reps)


def _fit_report(keys: list, err: np.ndarray, m: np.ndarray, native: np.ndarray, reps: int) -> dict:
    """Where the fit misses: the mean relative residual of the prefills per prompt size and of the decodes, and
    the residuals' rms, the native stacks' (the six-term fit) and the low-precision ones' (their unpack term)."""
    rel = err / m
    by: dict = {}
    for (si, pi, i), r in zip(keys, rel):
        by.setdefault("decode" if i else f"prefill {PROMPTS[pi]}", []).append(float(r))
    return {"relative_by_pass": {k: float(np.mean(v)) for k, v in by.items()}, "passes": len(keys),
            "native_residual_rms_us": float(np.sqrt(np.mean(err[native] ** 2)) * 1e6),
            "native_mean_pass_us": float(np.mean(m[native]) * 1e6),
            "low_residual_rms_us": float(np.sqrt(np.mean(err[~native] ** 2)) * 1e6) if (~native).any() else 0.0,
            "reps": reps, "residual_rms_us": float(np.sqrt(np.mean(err ** 2)) * 1e6),
            "relative_rms": float(np.sqrt(np.mean(rel ** 2))), "mean_pass_us": float(np.mean(m) * 1e6)}


def host_roofline(hw: dict):
    """The host's roofline of a profile (``host_tflops``, ``host_mem_bandwidth_gbps``): the clock's own."""
    from ...engine.simclock import Roofline

    return Roofline(hw["host_tflops"] * 1e12, hw["host_mem_bandwidth_gbps"] * 1e9, hw.get("host_roofline_serial", 0.0),
                    (hw.get("host_gemv_bandwidth_gbps") or 0.0) * 1e9)


def fit_host(calls: list, geom, hw: dict) -> dict:
    """The host's per-batch, per-expert and per-token costs beyond its roofline, from the banks the host
    computed in the model's own runs ``calls`` [(experts, rows, seconds)]: non-negative least squares on
    relative error (the many one-token decode batches do not outvote the prefills'). {} without calls."""
    if not calls:
        return {}
    n = np.array([c[0] for c in calls], dtype=float)
    rows = np.array([c[1] for c in calls], dtype=float)
    t = np.array([c[2] for c in calls])
    from ...engine.simclock import one_row

    host = host_roofline(hw)
    roof = np.array([host.time(2.0 * r * geom.expert_params, k * geom.expert_bytes, one_row(r, k) * geom.expert_bytes)
                     for k, r in zip(n, rows)])
    X = np.stack([np.ones_like(n), n, rows], 1)
    c = nnls(X / t[:, None], (t - roof) / t)
    return {"host_call_overhead_us": float(c[0] * 1e6), "host_expert_overhead_us": float(c[1] * 1e6),
            "host_token_overhead_us": float(c[2] * 1e6)}


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: SciPy's bounded solver (``lsq_linear``, trust-region
    reflective / BVLS), which replaced a search over every subset of columns (2**k - 1 unconstrained solves)."""
    from scipy.optimize import lsq_linear

    return lsq_linear(X, y, bounds=(0.0, np.inf), method="bvls").x
