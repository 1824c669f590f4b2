"""Miss-ratio curves: hit rate and collision rate vs capacity for several eviction policies (and Belady,
the optimum) over one trace -- "is my problem the policy or the working set?".

    specmd mrc replay.trace=outputs/.../trace eviction=[lru,lfu,least_stale,belady] [mrc.capacities=[...]]
    python -m specmd.commands.mrc replay.trace=...                              # the same

Every other override (prefetch, hardware, ...) applies to every point. Capacities are fractions of the
model's bytes (``hardware.capacity``); default: 12 points from 1% to 100% on a log scale. Writes
``mrc.csv`` and ``mrc.png`` into ``mrc.out`` (default ``outputs/mrc/<date>/<time>``) and prints the table.
The points run on ``mrc.jobs`` processes (default: every core) over one decoded trace.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from . import list_value, plain_value

DEFAULT_CAPACITIES = [0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0]


OPTIONS = ("mrc.capacities", "mrc.out", "mrc.jobs")


def parse(argv: list[str]) -> tuple[list[str], list[float], str, list[str], int]:
    from ..errors import ConfigError
    from ..results import unique_suffix
    from ..pool import check_jobs, default_jobs

    policies, caps, out, rest, jobs = ["lru", "lfu", "least_stale", "belady"], DEFAULT_CAPACITIES, None, [], None
    notes: list = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("-"):
            raise ConfigError(f"{arg!r}: specmd mrc takes overrides (key=value), not options; its own are "
                              f"{', '.join(o + '=' for o in OPTIONS)} (specmd mrc --help)")
        if key.startswith("mrc.") and key not in OPTIONS:
            raise ConfigError(f"{key}: unknown option; valid: {', '.join(OPTIONS)}")
        if key == "eviction":
            policies = list_value(key, value, notes)
        elif key == "mrc.capacities":
            try:
                caps = [float(v) for v in list_value(key, value, notes)]
            except ValueError:
                raise ConfigError(f"mrc.capacities={value!r}: a list of numbers, e.g. [0.01,0.1,0.5]") from None
        elif key == "mrc.out":
            out = plain_value(key, value)
        elif key == "mrc.jobs":
            try:
                jobs = check_jobs(int(value))
            except ValueError:
                raise ConfigError(f"mrc.jobs={value!r} must be a positive integer (processes; this machine has "
                                  f"{default_jobs()} cores)") from None
        else:
            rest.append(arg)
    for key, values in (("eviction", policies), ("mrc.capacities", caps)):
        twice = sorted({v for v in values if values.count(v) > 1}, key=str)
        if twice:
            raise ConfigError(f"{key} lists {twice} twice: each point is computed once")
    bad = [c for c in caps if not (math.isfinite(c) and 0 < c <= 1)]
    if bad:
        raise ConfigError(f"mrc.capacities: {bad} must be fractions of the model's bytes in (0, 1]")
    from ..policies import REGISTRIES

    unknown = [p for p in policies if p not in REGISTRIES["eviction"].names()]
    if unknown:
        raise ConfigError(f"eviction: unknown policy(s) {unknown}; valid choices: "
                          f"{', '.join(REGISTRIES['eviction'].names())}")
    if not any(a.startswith("replay.trace=") for a in rest):
        raise ConfigError("specmd mrc needs replay.trace=PATH (a trace from a run with trace.save=true, or an import)")
    out = out or time.strftime("outputs/mrc/%Y-%m-%d/%H-%M-%S-") + unique_suffix()  # as a run's directory
    for note in notes:  # (the input is valid: how it was read, before any work)
        print(f"specmd mrc: note: {note}", file=sys.stderr)
    return policies, caps, out, rest, jobs


def compute(policies: list[str], capacities: list[float], overrides: list[str], jobs=None) -> list[dict]:
    """One row per (policy, capacity): hit rate, in-cache rate, collision rate, misses, stall. The points
    are replayed on ``jobs`` processes over the one decoded trace (:func:`~specmd.pool.replay_many`; default:
    every core); the rows do not depend on ``jobs``."""
    from hydra import compose, initialize_config_dir

    from .. import CONF_DIR
    from ..app import Run
    from ..replay.config import open_trace
    from ..pool import replay_many

    points, specs, trace = [], [], None
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for name in policies:
            for cap in capacities:
                run = Run(compose(config_name="config", overrides=[*overrides, f"eviction={name}",
                                                                    f"hardware.capacity={cap}"]))
                if trace is None:
                    trace = open_trace(run.replay)
                points.append((name, cap))
                specs.append(run.spec)
    rows = []
    for (name, cap), s in zip(points, replay_many(trace, specs, jobs)):
        c = s["cache"]
        rows.append({"policy": name, "capacity": cap, "hit_rate": c["hit_rate"],
                     "in_cache_rate": c["in_cache_rate"], "collision_rate": c["collision_rate"],
                     "misses": c["misses"], "requests": c["requests"], "stall_s": s["timing"]["stall_s"]})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == name]
        style = dict(ls="--", color="black") if name == "belady" else {}
        a.plot([r["capacity"] for r in pts], [1 - r["hit_rate"] for r in pts], marker="o", label=name, **style)
        b.plot([r["capacity"] for r in pts], [r["collision_rate"] for r in pts], marker="o", label=name, **style)
    for ax, title in ((a, "miss ratio"), (b, "collision rate")):
        ax.set_xscale("log")
        ax.set_xlabel("cache capacity (fraction of model bytes)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    from ..results import write_file

    try:
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    """``specmd mrc``; bad input raises :class:`~specmd.errors.ConfigError` (one line, exit 2: specmd.cli)."""
    from ..errors import ConfigError
    from ..results import csv_fill, keep_elsewhere, output_dir, write_csv

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # its help, not a missing replay.trace (specmd.cli: every command has one)
        print(__doc__.strip())
        return 0
    policies, caps, out, rest, jobs = parse(argv)
    if not policies or not caps:
        raise ConfigError(f"specmd mrc needs at least one policy and one capacity (got eviction={policies}, "
                          f"mrc.capacities={caps})")
    if any(a.startswith("hardware.experts_per_layer=") and a.split("=", 1)[1] not in ("null", "None")
           for a in rest):
        raise ConfigError("specmd mrc varies hardware.capacity; drop hardware.experts_per_layer")
    out = output_dir(out, "mrc.out", "mrc.csv")  # before the replays: a path it cannot write loses no work
    rows = compute(policies, caps, rest, jobs)
    try:
        plot(rows, out / "mrc.png")
    except OSError as exc:  # the curves were computed: kept with the figure, not lost with it
        raise OSError(exc.errno, f"{exc.strerror}; the curves: {keep_elsewhere(out / 'mrc.csv', csv_fill(rows))[1]}",
                      exc.filename) from exc
    write_csv(out / "mrc.csv", rows)  # last: the mark of a complete mrc.out (output_dir refuses one holding it)
    print(f"{'policy':<12} {'capacity':>8} {'hit rate':>9} {'collisions':>10}")
    for r in rows:
        print(f"{r['policy']:<12} {r['capacity']:>8.3f} {r['hit_rate']:>9.4f} {r['collision_rate']:>10.4f}")
    print(f"wrote {out / 'mrc.csv'} and {out / 'mrc.png'}")
    return 0


if __name__ == "__main__":  # python -m specmd.commands.mrc: specmd mrc, with its one error path
    from ..ending import guarded

    sys.exit(guarded("specmd mrc", main, sys.argv[1:]))
