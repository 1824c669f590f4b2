"""``specmd fidelity [--profile P] [--quick] [--out FILE]``: how far to trust the simulated clock on this
machine -- a grid of short runs under ``execution=offload``, each cell's wall time beside its simulated time,
the error per cell, per component and over the grid (docs/semantics.md "How far to trust the clock").

The grid (:data:`GRID`; ``--quick``: :data:`QUICK`): models x capacity x miss x batch. A cell is one stack
(the default eviction and prefetch, the cell's miss policy, the profile at the cell's capacity) in a fresh
install (a cold cache): a warm-up generation, then two measured ones of ``batch`` random sequences, each a
``--prompt``-token prefill and half of ``--decodes`` greedy decodes (:func:`~.cell.run_cell`: calibrate's check is the same measurement), at
the thread settings the profile was calibrated at (:func:`profile_placement`). Each model's cells are preceded by one warm-up run; then the cells run ``--repeats`` times,
**alternated** (repeat 1 of every cell, then repeat 2 ...): a slow minute of the machine lands on every cell
alike rather than on one. A cell's wall TTFT and TPOT are the median over its repeats; its simulated ones the
median too (under offload the simulated clock still decides, and a copy still in flight on the wall can
change a prefetch's outcome between repeats).

Per cell: ``err = wall / simulated - 1`` for TTFT and TPOT; the **noise**, the repeats' spread
``(max - min) / median`` of the wall; a cell whose noise exceeds ``|err|`` is marked ``noise``: its error is
the machine's, not the model's. The error is split into the clock's components, as additive shares of the
simulated time (they sum to ``err``): ``compute`` (the device's own work: dense layers, experts, the
framework's per-layer/token/expert/copy-issue costs) and ``waits`` (what the pass spent beyond it: copies
waited for, and on a CPU the host's experts, which run inline on the same cores); and two resources timed on
their own, each as measured / simulated busy time: the ``link`` (the copies) and the ``host`` (the host's
expert kernel). And the machine's **drift**: :func:`~specmd.commands.calibrate.speed_probe` at the start and the end
against the one calibrate took (``calibrated_on.speed``): a shared machine slower now than when the profile
was fitted shows as error in every cell, which the repeats, alternated within the run, cannot see. Over the grid: median |err|, p90, the worst cell, and the **ranking**: in each (model,
capacity, batch) group, whether the simulated order of the miss policies by decode speed is the measured one
(two policies whose measured TPOTs differ by less than their noise count as a tie either way).

The profile is a name (as ``hardware=NAME`` selects it: the user config directory, then the shipped ones), or
a path to a profile's yaml; default: calibrate's default name (:func:`specmd.commands.calibrate.default_name`).
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# The grid: three expert sizes (49 kB, 0.4 MB and 35 MB float32 experts), caches from a small fraction to all
# of the experts, the three places a miss can go, one request and a batch.
GRID = {"models": ("deep_olmoe", "deep_mixtral", "qwen2_moe_shaped"), "capacities": (0.05, 0.3, 1.0),
        "misses": ("fetch", "cpu_compute", "hybrid"), "batches": (1, 4)}
QUICK = {"models": ("tiny",), "capacities": (0.05, 1.0), "misses": ("fetch", "cpu_compute", "hybrid"),
         "batches": (1, 4)}
COMPONENTS = ("compute", "waits")  # additive shares of the error
RESOURCES = ("link", "host")  # measured / simulated busy time


@dataclass(frozen=True)
class Cell:
    model: str
    capacity: float
    miss: str
    batch: int

    @property
    def key(self) -> str:
        return f"{self.model} c={self.capacity:g} {self.miss} B={self.batch}"

    @property
    def group(self) -> tuple:
        return (self.model, self.capacity, self.batch)

    @property
    def stack(self) -> dict:
        return {"capacity": self.capacity, "miss": self.miss}


def cells_of(grid: dict) -> list[Cell]:
    return [Cell(m, c, miss, b) for m in grid["models"] for c in grid["capacities"] for miss in grid["misses"]
            for b in grid["batches"]]


# ---- the grid --------------------------------------------------------------------------------------------
def _median_run(runs: list[dict]) -> dict:
    """Each figure's median over a cell's repeats, and the wall's spread per kind."""
    out = {}
    for kind in ("prefill", "decode"):
        rs = [r[kind] for r in runs if kind in r]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        walls = [r["wall_s"] for r in rs]
        med["noise"] = (max(walls) - min(walls)) / med["wall_s"] if med["wall_s"] > 0 else 0.0
        med["repeats"] = [r["wall_s"] for r in rs]
        out[kind] = med
    return out


def _ratio(a: float, b: float):
    return a / b if b > 0 else None


def cell_report(runs: list[dict]) -> dict:
    """A cell's figures: per kind (``ttft``: the prefill, ``tpot``: a decode) the error, the noise, the
    components' shares of the error and the resources' measured / simulated busy time."""
    med = _median_run(runs)
    out = {}
    for name, kind in (("ttft", "prefill"), ("tpot", "decode")):
        m = med.get(kind)
        if m is None:
            continue
        sim = m["sim_s"]
        err = m["wall_s"] / sim - 1
        waits = (m["wall_waits_s"] - m["sim_waits_s"]) / sim
        out[name] = {"wall_s": m["wall_s"], "sim_s": sim, "err": err, "noise": m["noise"],
                     "noise_bound": m["noise"] > abs(err), "repeats_s": m["repeats"],
                     "components": {"compute": err - waits, "waits": waits},
                     "resources": {"link": _ratio(m["wall_link_s"], m["sim_link_s"]),
                                   "host": _ratio(m["wall_host_s"], m["sim_host_s"])},
                     "busy_s": {k: m[k] for k in ("wall_link_s", "sim_link_s", "wall_host_s", "sim_host_s")}}
    return out


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation)."""
    v = sorted(values)
    if not v:
        return math.nan
    i = q * (len(v) - 1)
    lo = math.floor(i)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (i - lo)


def summarize(cells: dict[str, dict], meta: dict[str, Cell]) -> dict:
    """Over the grid: per figure the median, p90 and worst |err|, the share of noise-bound cells, each
    component's median |share| and each resource's median ratio; and the ranking's agreement."""
    out = {}
    for fig in ("ttft", "tpot"):
        rows = [(k, c[fig]) for k, c in cells.items() if fig in c]
        errs = [abs(r["err"]) for _, r in rows]
        worst = max(rows, key=lambda kr: abs(kr[1]["err"]))
        out[fig] = {"cells": len(rows), "median_abs_err": _pct(errs, 0.5), "p90_abs_err": _pct(errs, 0.9),
                    "worst": {"cell": worst[0], "err": worst[1]["err"]},
                    "noise_bound_cells": sum(r["noise_bound"] for _, r in rows),
                    "median_noise": _pct([r["noise"] for _, r in rows], 0.5),
                    "components": {c: _pct([abs(r["components"][c]) for _, r in rows], 0.5) for c in COMPONENTS},
                    "resources": {x: _pct([r["resources"][x] for _, r in rows if r["resources"][x] is not None], 0.5)
                                  for x in RESOURCES}}
    out["ranking"] = ranking(cells, meta)
    return out


def ranking(cells: dict[str, dict], meta: dict[str, Cell]) -> dict:
    """Per (model, capacity, batch) group: does the simulated order of its miss policies by TPOT agree with
    the measured one? A pair whose measured TPOTs differ by less than the larger of their noises is a tie and
    agrees either way."""
    groups: dict[tuple, list] = {}
    for k, c in cells.items():
        if "tpot" in c:
            groups.setdefault(meta[k].group, []).append((meta[k].miss, c["tpot"]))
    verdicts = {}
    for g, rows in groups.items():
        ok = True
        for i in range(len(rows)):
            for j in range(i + 1, len(rows)):
                a, b = rows[i][1], rows[j][1]
                gap = abs(a["wall_s"] - b["wall_s"]) / min(a["wall_s"], b["wall_s"])
                if gap <= max(a["noise"], b["noise"]):
                    continue  # inside the noise: a tie
                if (a["wall_s"] < b["wall_s"]) != (a["sim_s"] < b["sim_s"]):
                    ok = False
        sim_order = [m for m, _ in sorted(rows, key=lambda r: r[1]["sim_s"])]
        wall_order = [m for m, _ in sorted(rows, key=lambda r: r[1]["wall_s"])]
        verdicts[f"{g[0]} c={g[1]:g} B={g[2]}"] = {"agree": ok, "simulated": sim_order, "measured": wall_order}
    n = len(verdicts)
    return {"groups": n, "agree": sum(v["agree"] for v in verdicts.values()),
            "share": sum(v["agree"] for v in verdicts.values()) / n if n else None, "per_group": verdicts}


def measure(hw: dict, grid: dict, repeats: int, prompt: int, decodes: int, device: str, log=print,
            execution: dict | None = None) -> dict:
    """Run the grid (see the module's doc) under ``execution`` (:func:`~.cell.offload_execution`: the
    profile's thread settings); returns {cell key: report} and the cells."""
    from ...models.loader import load_configured
    from ...executor.base import steady_host_allocator
    from ...models.loader import local_checkpoint
    from ...signals import Interrupted, check_interrupt
    from .cell import run_cell

    steady_host_allocator()
    dev = torch.device(device)
    cells = cells_of(grid)
    runs: dict[str, list] = {c.key: [] for c in cells}
    t0 = time.perf_counter()
    for name in grid["models"]:
        model, mcfg = load_configured(name)
        model.to(dev)
        ckpt = local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None
        vocab = model.config.vocab_size
        mine = [c for c in cells if c.model == name]
        ids = {b: torch.randint(0, vocab, (b, prompt), generator=torch.Generator().manual_seed(11 + b)).to(dev)
               for b in grid["batches"]}
        run_cell(model, ckpt, hw, mine[0].stack, ids[mine[0].batch], 2, dev, execution)  # the process's warm-up
        for r in range(repeats):
            for c in mine:
                try:
                    check_interrupt()  # (a safe point between cells)
                    runs[c.key].append(run_cell(model, ckpt, hw, c.stack, ids[c.batch], decodes, dev, execution))
                except Interrupted as exc:  # what was measured so far goes with it (main keeps it)
                    exc.fidelity_runs = {k: v for k, v in runs.items() if v}
                    raise
            log(f"  {name}: repeat {r + 1}/{repeats} of {len(mine)} cells  [{time.perf_counter() - t0:.0f} s]")
        del model
        gc.collect()
    return {c.key: cell_report(runs[c.key]) for c in cells}, {c.key: c for c in cells}


# ---- the command -----------------------------------------------------------------------------------------
def resolve_profile(profile: str | None) -> tuple[str, dict]:
    """(name, fields) of the profile: a yaml path, or a name as ``hardware=NAME`` finds it (the user config
    directory's ``hardware/``, then the shipped profiles). ConfigError naming what was looked for."""
    import yaml

    from ... import shipped, user_config_dir
    from .profile import default_name
    from ...errors import ConfigError
    from ...hardware import HardwareConfig
    from ...registry import build_params

    name = profile or default_name()
    path = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) and not path.is_file():
        raise ConfigError(f"--profile {name}: no such file (a profile's yaml path, or a name as hardware=NAME "
                          f"selects it); `specmd calibrate --out DIR --name NAME` writes DIR/hardware/NAME.yaml")
    if not (name.endswith((".yaml", ".yml")) and path.is_file()):
        path = Path(user_config_dir()) / "hardware" / f"{name}.yaml"
    if path.is_file():
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:  # (read as hardware=NAME reads it: OmegaConf's YAML, where -5e-09 is a number, not yaml 1.1's string)
            fields = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except (OSError, ValueError, RecursionError, yaml.YAMLError, OmegaConfBaseException) as exc:
            raise ConfigError(f"--profile {name}: {path} is not a readable profile: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"--profile {name}: {path} holds no profile mapping")
    elif name in shipped.options("hardware"):
        fields = shipped.option("hardware", name)
    else:
        raise ConfigError(f"--profile {name!r}: no such profile (looked for a .yaml path, {path}, and the shipped "
                          f"{', '.join(shipped.options('hardware'))}); make one with `specmd calibrate"
                          f"{'' if profile is None else ' --name ' + name}`")
    fields = dict(fields)
    label = str(fields.pop("name", path.stem))
    try:  # every field checked as hardware=NAME checks it (types by name, then ranges), before minutes of runs
        build_params(HardwareConfig, fields, "hardware")
    except ConfigError as exc:
        raise ConfigError(f"--profile {name}: {exc}") from None
    return label, fields


def table(report: dict) -> str:
    """The fidelity table: one row per cell, then the grid's figures."""
    lines = [f"{'cell':38s} {'TTFT w/s':>9s} {'noise':>6s} {'TPOT w/s':>9s} {'noise':>6s}  "
             f"{'TTFT: compute waits':>20s} {'TPOT: compute waits':>20s}  {'link w/s':>8s} {'host w/s':>8s}"]
    for key, c in report["cells"].items():
        def fig(f):
            if f not in c:
                return f"{'-':>9s} {'':>6s}"
            x = c[f]
            return f"{1 + x['err']:9.2f}{'*' if x['noise_bound'] else ' '}{x['noise']:5.0%}"

        def comp(f):
            return f"{c[f]['components']['compute']:+10.0%} {c[f]['components']['waits']:+9.0%}" if f in c else " " * 20

        res = c.get("tpot", c.get("ttft"))["resources"]
        rs = " ".join(f"{res[x]:8.2f}" if res[x] is not None else f"{'-':>8s}" for x in RESOURCES)
        lines.append(f"{key:38s} {fig('ttft')} {fig('tpot')}  {comp('ttft')} {comp('tpot')}  {rs}")
    s = report["summary"]
    lines.append("")
    for f in ("ttft", "tpot"):
        x = s[f]
        lines.append(f"{f.upper()}: median |err| {x['median_abs_err']:.1%}, p90 {x['p90_abs_err']:.1%}, worst "
                     f"{x['worst']['err']:+.1%} ({x['worst']['cell']}); median noise {x['median_noise']:.1%}, "
                     f"{x['noise_bound_cells']}/{x['cells']} cells noise-bound (*); median |share| compute "
                     f"{x['components']['compute']:.1%}, waits {x['components']['waits']:.1%}; busy measured / "
                     f"simulated: link {_fmt(x['resources']['link'])}, host {_fmt(x['resources']['host'])}")
    d = report.get("drift")
    lines.append("machine speed against the profile's calibration (time now / then, > 1: slower now): " + (
        "not recorded (a profile from before calibrate's speed probe, or hand-written)" if not d else
        "; ".join(f"{when}: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in d[when].items()) for when in ("start", "end"))
        + " -- a drift the same in every cell shows as error in every cell, not as noise"))
    rk = s["ranking"]
    lines.append(f"ranking (miss policies by decode speed): simulated order = measured in {rk['agree']}/{rk['groups']} "
                 f"groups" + "".join(f"\n  differs: {g}: simulated {' < '.join(v['simulated'])}, measured "
                                     f"{' < '.join(v['measured'])}" for g, v in rk["per_group"].items() if not v["agree"]))
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def fidelity(profile: str | None = None, quick: bool = False, repeats: int = 3, prompt: int = 32, decodes: int = 16,
             device: str = "cpu", models=None, log=print) -> dict:
    """The whole command (module doc); returns the report written as JSON."""
    from ...checks import check_device
    from ...machine import machine
    from .profile import check_model
    from .measure import drift, speed_probe
    from ...errors import ConfigError

    check_device(device)
    for flag, v, lo in (("--repeats", repeats, 3), ("--prompt", prompt, 1), ("--decodes", decodes, 2)):
        if v < lo:
            raise ConfigError(f"{flag} {v}: at least {lo}" + (" (the median of three tells noise from error)"
                                                              if flag == "--repeats" else ""))
    grid = dict(QUICK if quick else GRID)
    if models:
        twice = sorted({m for m in models if models.count(m) > 1})
        if twice:  # (each cell would collect twice the repeats under one key, the report saying --repeats)
            raise ConfigError(f"--models lists {', '.join(twice)} more than once; each model's cells run once")
        grid["models"] = tuple(models)
    for m in grid["models"]:
        try:
            check_model(m)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("--model ", "--models ", 1)) from None
    label, hw = resolve_profile(profile)
    if not any(hw.get(k) for k in ("layer_overhead_us", "layer_token_overhead_us", "token_overhead_us",
                                   "expert_overhead_us")):
        log(f"note: profile {label} has no framework costs fitted (calibrate --quick, or a hand-written profile): "
            f"on a CPU the simulated times leave out most of a small model's time")
    t0 = time.perf_counter()
    plan, execution = profile_placement(hw, torch.device(device))
    from .command import placement_words

    log(f"specmd fidelity: profile {label}, {len(cells_of(grid))} cells x {repeats} repeats on {platform.node()} "
        f"({device}) at the profile's {placement_words(plan)} ...")
    then = (hw.get("calibrated_on") or {}).get("speed")
    differs = elsewhere(hw, label, device)
    for line in differs:  # (the docs' promise: a run on a profile from elsewhere says what differs)
        log(f"warning: {line}")
    if differs and then:
        log("warning: the drift below compares this machine with another one's probe, not this machine over time")
    undo = plan.enter()  # (the drift probes on the compute threads too; each cell's install applies the same plan)
    try:
        start = drift(then, speed_probe(torch.device(device)))
        cells, meta = measure(hw, grid, repeats, prompt, decodes, device, log, execution)
        end = drift(then, speed_probe(torch.device(device)))
    finally:
        undo()
    report = {"profile": label, "hardware": hw, "device": device, "torch": torch.__version__, "host": platform.node(),
              "placement": plan.record(), "machine": machine(),
              "grid": {k: list(v) for k, v in grid.items()}, "repeats": repeats, "prompt": prompt,
              "decodes": decodes, "cells": cells, "summary": summarize(cells, meta),
              "drift": None if start is None else {"start": start, "end": end}, "profile_differs": differs,
              "seconds": time.perf_counter() - t0}
    return report


def elsewhere(hw: dict, label: str, device: str) -> list[str]:
    """What differs between where the profile was calibrated and this machine (host, device, torch): one line
    each (:func:`specmd.hardware.profile_mismatch`); the grid's models and their dtypes are its own cells'."""
    from ...hardware import HardwareConfig, profile_mismatch

    facts = {"host": platform.node(), "device": device, "torch": torch.__version__}
    return profile_mismatch(HardwareConfig(**{**hw, "name": label}), facts)


def profile_placement(hw: dict, dev: torch.device) -> tuple:
    """(:class:`specmd.machine.CorePlan`, the cells' ``execution`` section) at the thread settings the profile
    was calibrated at (``calibrated_on.threads``/``pin``/``host_threads``; a profile without them: auto, not
    pinned): the cells are timed as the profile was fitted."""
    from ...machine import can_pin, core_budget
    from .cell import offload_execution
    from .command import thread_plan

    on = hw.get("calibrated_on") or {}
    t = on.get("threads")  # (at most this machine's cores: a profile from a larger one runs, and says so)
    threads = min(t, core_budget()[0]) if isinstance(t, int) and not isinstance(t, bool) and t >= 1 else "auto"
    plan = thread_plan(threads, on.get("pin") is True and can_pin(), dev)
    return plan, offload_execution(plan.threads, plan.pin, plan.host_threads if plan.host_lane else "auto")


def main(argv=None) -> int:
    from ...errors import ArgumentParser

    ap = ArgumentParser(prog="specmd fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a hardware profile: its name (as hardware=NAME) or a yaml path "
                                      "(default: calibrate's default name)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, capacities 0.05 and 1.0 (~2 min)")
    ap.add_argument("--models", nargs="+", help="model configs of the grid (default: deep_olmoe deep_mixtral "
                                                "qwen2_moe_shaped; --quick: tiny)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, alternated; the median is kept")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--decodes", type=int, default=16, help="greedy decode steps, over the two measured generations")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="write the report as JSON here")
    a = ap.parse_args(argv)
    out = None
    if a.out:  # checked before minutes of runs
        from ...errors import ConfigError
        from ...results import writable_dir

        out = Path(a.out).expanduser()
        if out.is_dir():
            raise ConfigError(f"--out {a.out}: a directory; name the JSON file to write")
        writable_dir(out.parent, f"--out {a.out}")
    try:
        report = fidelity(a.profile, a.quick, a.repeats, a.prompt, a.decodes, a.device, a.models)
    except BaseException as exc:
        runs = getattr(exc, "fidelity_runs", None)
        if out is not None and runs:  # a signal mid-grid: the cells measured so far are kept, and named
            from ...results import write_json_atomic
            from ...signals import signals_held

            kept = out.with_name(out.stem + ".partial.json")
            with signals_held():
                write_json_atomic(kept, {"complete": False, "stopped_by": str(exc), "profile": a.profile,
                                         "runs": runs})
            print(f"specmd fidelity: kept the {sum(map(len, runs.values()))} runs measured so far in {kept}",
                  file=sys.stderr)
        raise
    print(table(report))
    if out is not None:
        from ...results import write_json_atomic

        write_json_atomic(out, report)
        print(f"wrote {out}")
    return 0
