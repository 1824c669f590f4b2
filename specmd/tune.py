"""``specmd tune``: the best policy stack under a quality budget.

    specmd tune [overrides] [tune.objective=tpot|hit_rate] [tune.budget=0.01] [tune.trials=48]
                [tune.finalists=6] [tune.capacities=[0.05,0.1]] [tune.eviction=[lru,least_stale]] ...

What it does, in numbered steps (each writes what it computed into ``tune.out``, so nothing is lost if a
later step fails):

1. **Record** the routing of the base configuration (the overrides given: model, tasks, hardware) once,
   exactly as ``replay.trace=record`` does (or use ``replay.trace=PATH`` when given).
2. **Search** on replay (seconds per trial): ``tune.trials`` stacks drawn without repetition (seeded,
   ``tune.seed``) from the space below, plus the base configuration's own stack; each is replayed and
   scored by ``tune.objective``: simulated ``tpot`` (s per decode token, lower is better) or ``hit_rate``
   (higher is better). Trials the trace cannot replay (e.g. a signal it did not record) are listed, not
   dropped silently. -> ``trials.csv``.
3. **Quality, live, for the finalists only**: the unhooked model and then the trials in order of the
   objective run live on ``tune.quality_task`` (WikiText word perplexity, ``tune.quality_limit`` documents,
   scored token by token as Cache-Conditional Experts does, so every token sees the cache;
   ``tune.token_by_token=false`` scores whole windows, where a cache-conditional router sees a cache full
   of the window's own experts); the quality loss is ``ppl / ppl_unhooked - 1``. The search stops at the
   first stack within budget (every later one is slower) or at a lossless one (standard routing, every miss
   fetched at the stored precision: bit-identical to the unhooked model); a stack over budget rules out the
   untried ones at least as lossy (same routing and miss policy, every knob as aggressive or more, a cache
   no larger: an assumption that quality falls monotonically with each), so the next live run goes to a
   gentler setting. At most ``tune.finalists`` live runs, then the best lossless stack as the fallback.
   -> ``finalists.csv`` and each run's directory under ``finalists/``.
4. **Pareto front and winner**: the finalists no other finalist beats on both objective and loss are
   printed; the winner is the best objective whose loss is within ``tune.budget`` (a fraction: 0.01 = 1 %
   perplexity), with the command line that re-runs it. -> ``tune.json``.

The space (``tune.<group>=[...]`` restricts a group's choices; ``tune.capacities`` lists capacities):
routing ``standard`` or ``cache_prior`` (lambda 0.1/0.2/0.3/0.5 x J 1/2: Cache-Conditional Experts picks
lambda per cache size under a perplexity budget, Fig. 10); miss ``fetch``, ``hybrid`` (each miss fetched or
computed on the host, whichever ends the layer first), ``cpu_compute`` (Zhu et al.'s split), ``drop`` (J 1/2) or
``substitute`` (alpha 0.1/0.2/0.35/0.5: Zhu et al. pick alpha by hand); eviction ``lru``, ``lfu``,
``least_stale``, ``fld``, ``score``, ``arc``, ``lecar``; prefetch ``none``, ``topk`` (overfetch 1/1.5/2) or
``score`` (percentile 70/80/90). Oracles (``belady``, ``oracle``) are not candidates: no real system has
them. Replay of a stack that changes routing or drops experts is not exact (the hidden states differ
after the first changed layer); the live runs of step 3 measure what the finalists really cost in quality.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .mrc import split_list

# group -> choice -> list of parameter overrides (each a tuple of "key=value" strings)
SPACE = {
    "routing": {"standard": [()],
                "cache_prior": [(f"routing.lambda={lam}", f"routing.J={j}") for lam in (0.1, 0.2, 0.3, 0.5)
                                for j in (1, 2)]},
    "miss": {"fetch": [()], "hybrid": [()], "cpu_compute": [()], "drop": [(f"miss.J={j}",) for j in (1, 2)],
             "substitute": [(f"miss.alpha={a}",) for a in (0.1, 0.2, 0.35, 0.5)]},
    "eviction": {name: [()] for name in ("lru", "lfu", "least_stale", "fld", "score", "arc", "lecar")},
    "prefetch": {"none": [()], "topk": [(f"prefetch.overfetch={o}",) for o in (1.0, 1.5, 2.0)],
                 "score": [(f"prefetch.percentile={p}",) for p in (70.0, 80.0, 90.0)]},
}
EXACT_MISSES = ("fetch", "hybrid", "cpu_compute")  # miss policies that run every expert exactly (lossless)
OBJECTIVES = {"tpot": ("timing", "tpot_s", min), "hit_rate": ("cache", "hit_rate", max)}


@dataclass
class Options:
    objective: str = "tpot"
    budget: float = 0.01
    trials: int = 48
    finalists: int = 6
    seed: int = 0
    capacities: list = field(default_factory=list)  # empty: the base configuration's hardware.capacity
    quality_task: str = "wikitext"
    quality_limit: int = 1
    token_by_token: bool = True
    out: str = ""
    choices: dict = field(default_factory=dict)  # group -> allowed choices

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"tune.objective={self.objective!r}; valid choices: {', '.join(OBJECTIVES)}")
        for key in ("budget",):
            v = getattr(self, key)
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"tune.{key}={v} must be a finite number >= 0")
        for key in ("trials", "finalists", "quality_limit"):
            if getattr(self, key) < 1:
                raise ConfigError(f"tune.{key}={getattr(self, key)} must be >= 1")
        for c in self.capacities:
            if not (math.isfinite(c) and 0 < c <= 1):
                raise ConfigError(f"tune.capacities: {c} must be a fraction in (0, 1]")
        for group, names in self.choices.items():
            bad = [n for n in names if n not in SPACE[group]]
            if bad or not names:
                raise ConfigError(f"tune.{group}={names}: {bad or 'empty'}; valid choices: {', '.join(SPACE[group])}")


def parse(argv: list[str]) -> tuple[Options, list[str]]:
    """``tune.*`` options and the base configuration's overrides."""
    opts, rest = Options(), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not key.startswith("tune."):
            rest.append(arg)
            continue
        name = key[len("tune."):]
        valid = ["objective", "budget", "trials", "finalists", "seed", "capacities", "quality_task",
                 "quality_limit", "token_by_token", "out", *SPACE]
        if name not in valid:
            raise ConfigError(f"tune.{name}: unknown option; valid: {', '.join(valid)}")
        if not eq:
            raise ConfigError(f"{arg!r}: expected tune.<option>=<value>")
        try:
            if name in SPACE:
                opts.choices[name] = split_list(value)
            elif name == "capacities":
                opts.capacities = [float(v) for v in split_list(value)]
            elif name in ("objective", "quality_task", "out"):
                setattr(opts, name, value)
            elif name in ("trials", "finalists", "seed", "quality_limit"):
                setattr(opts, name, int(value))
            elif name == "budget":
                opts.budget = float(value)
            elif value.lower() in ("true", "false"):  # token_by_token
                opts.token_by_token = value.lower() == "true"
            else:
                raise ValueError(value)
        except ValueError:
            raise ConfigError(f"{arg!r}: {value!r} is not a valid value for tune.{name}") from None
    opts.check()
    for arg in rest:
        group = arg.partition("=")[0].split(".")[0].lstrip("+")
        if group in SPACE:
            raise ConfigError(f"{arg!r}: tune searches {group}; restrict it with tune.{group}=[...] instead")
    opts.out = opts.out or time.strftime("outputs/tune/%Y-%m-%d/%H-%M-%S")
    return opts, rest


def candidates(opts: Options, base_capacity: float) -> list[tuple[str, ...]]:
    """Every stack of the space (restricted by ``tune.<group>``) as a tuple of overrides, in a fixed order."""
    groups = []
    for group, choices in SPACE.items():
        allowed = opts.choices.get(group, list(choices))
        groups.append([(f"{group}={name}", *params) for name in allowed for params in choices[name]])
    caps = opts.capacities or [base_capacity]
    return [tuple(itertools.chain(*combo, (f"hardware.capacity={c}",)))
            for combo in itertools.product(*groups) for c in caps]


def lossless(stack: tuple[str, ...]) -> bool:
    """Standard routing and every miss run exactly -- fetched at the stored precision, or computed on the host
    from it (``hybrid`` without a low copy, ``cpu_compute``): outputs equal the unhooked model's (on a CUDA
    device the host's experts are the CPU's arithmetic: equal up to rounding)."""
    return ("routing=standard" in stack and any(f"miss={m}" in stack for m in EXACT_MISSES)
            and all(a == "miss.precision=native" for a in stack if a.startswith("miss.precision="))
            and not any(a.startswith("miss.low=") and a not in ("miss.low=None", "miss.low=null") for a in stack))


def own_stack(raw: dict) -> tuple[str, ...]:
    """The base configuration's stack as overrides, with the parameters the space varies for its choices."""
    out = []
    for group, choices in SPACE.items():
        cfg = raw[group]
        out.append(f"{group}={cfg['name']}")
        for arg in (choices.get(cfg["name"]) or [()])[0]:
            key = arg.split("=", 1)[0]
            out.append(f"{key}={cfg[key.split('.', 1)[1]]}")
        if group == "miss" and cfg.get("precision", "native") != "native":
            out.append(f"miss.precision={cfg['precision']}")
        if group == "miss" and cfg.get("low") is not None:  # hybrid's low-precision option: lossy
            out.append(f"miss.low={cfg['low']}")
    out.append(f"hardware.capacity={raw['hardware']['capacity']}")
    return tuple(out)


def draw(opts: Options, space: list, base: tuple) -> list[tuple[str, ...]]:
    """The base stack, then up to ``tune.trials`` - 1 others drawn without repetition (seeded)."""
    rng = random.Random(opts.seed)
    rest = [s for s in space if s != base]
    picked = rng.sample(rest, min(len(rest), opts.trials - 1))
    return [base, *picked]


def pareto(rows: list[dict], better) -> list[dict]:
    """The rows no other row beats on both the objective (``better``: min or max) and the quality loss."""
    def dominates(a, b):
        ge = better(a["objective"], b["objective"]) == a["objective"] and a["loss"] <= b["loss"]
        return ge and (a["objective"] != b["objective"] or a["loss"] < b["loss"])

    return [r for r in rows if not any(dominates(o, r) for o in rows if o is not r)]


def lossiness(stack: tuple[str, ...]) -> tuple:
    """(routing, miss, knobs, capacity) of a stack, each knob oriented so that larger is lossier: the cache
    prior's lambda and -J, drop's -J, substitute's alpha."""
    d = dict(a.split("=", 1) for a in stack)
    knobs = []
    if d["routing"] == "cache_prior":
        knobs += [float(d["routing.lambda"]), -float(d["routing.J"])]
    if d["miss"] == "drop":
        knobs.append(-float(d["miss.J"]))
    elif d["miss"] == "substitute":
        knobs.append(float(d["miss.alpha"]))
    return d["routing"], d["miss"], tuple(knobs), float(d["hardware.capacity"])


def at_least_as_lossy(b: tuple, a: tuple) -> bool:
    """Stack b (a :func:`lossiness`) loses at least as much quality as a: same routing and miss policy, every
    knob at least as lossy, a cache no larger (more misses to drop, substitute or route around)."""
    return b[:2] == a[:2] and all(x >= y for x, y in zip(b[2], a[2])) and b[3] <= a[3]


def select_finalists(ranked: list[dict], loss_of, opts: Options) -> list[dict]:
    """Measure quality live (``loss_of(trial, i)``) in order of the objective, at most ``tune.finalists`` runs:
    a lossless stack needs no budget (it is bit-identical to the unhooked model) and ends the search, as does
    the first lossy one within budget (everything after it is slower); a lossy one over budget rules out the
    stacks at least as lossy (:func:`at_least_as_lossy`, an assumption: quality falls monotonically with
    each knob and with the cache size), so the next live run goes to a gentler setting. The best lossless
    stack is measured last if the search ran out of runs first."""
    rows, failed = [], []
    for t in ranked:
        if len(rows) >= opts.finalists:
            break
        lz = lossiness(t["stack"])
        if not t["lossless"] and any(at_least_as_lossy(lz, f) for f in failed):
            continue
        rows.append({**t, "stack": " ".join(t["stack"]), "loss": loss_of(t, len(rows))})
        if t["lossless"] or rows[-1]["loss"] <= opts.budget + 1e-12:
            return rows
        failed.append(lz)
    best_lossless = next((t for t in ranked if t["lossless"]), None)
    if best_lossless is not None:
        rows.append({**best_lossless, "stack": " ".join(best_lossless["stack"]), "loss": loss_of(best_lossless, len(rows))})
    return rows


def main(argv=None) -> int:
    from rich.console import Console
    from rich.markup import escape

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # its help, not a Hydra override error (specmd.cli: every command has one)
        print(__doc__.strip())
        return 0
    err = Console(stderr=True)
    try:
        opts, base = parse(argv)
        result = tune(opts, base, Console())
    except ConfigError as exc:
        err.print(f"[bold red]specmd tune: error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    return 0 if result["winner"] else 1


def tune(opts: Options, base: list[str], console) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from . import CONF_DIR
    from .app import Run, execute, recorded_trace
    from .replay.driver import check, open_trace
    from .pool import replay_many

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    kind, metric, better = OBJECTIVES[opts.objective]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=base), resolve=False)
        if raw["hardware"].get("experts_per_layer") is not None:
            raise ConfigError("specmd tune varies hardware.capacity; drop hardware.experts_per_layer="
                              f"{raw['hardware']['experts_per_layer']}")
        # 1. record the routing once (or take the trace given)
        given = any(a.startswith("replay.trace=") and a.split("=", 1)[1] not in ("null", "record") for a in base)
        base_run = Run(compose(config_name="config", overrides=[*base, *([] if given else ["replay.trace=record"])]))
        trace_path = base_run.replay.trace if given else recorded_trace(base_run)
        replay_over = [*(a for a in base if not a.startswith("replay.trace=")), f"replay.trace={trace_path}"]
        trace = open_trace(Run(compose(config_name="config", overrides=replay_over)).replay)
        own = own_stack(raw)
        space = candidates(opts, float(raw["hardware"]["capacity"]))

        # 2. search on replay
        trials, skipped, stacks, specs = [], [], [], []
        for stack in draw(opts, space, own):
            run = Run(compose(config_name="config", overrides=[*replay_over, *stack]))
            try:
                check(trace, run.spec)
            except ConfigError as exc:
                skipped.append({"stack": " ".join(stack), "why": str(exc)})
                continue
            stacks.append(stack)
            specs.append(run.spec)
        for stack, res in zip(stacks, replay_many(trace, specs)):  # every core, one decoded trace
            trials.append({"stack": stack, "objective": res[kind][metric], "hit_rate": res["cache"]["hit_rate"],
                           "tpot_s": res["timing"]["tpot_s"], "lossless": lossless(stack)})
        if not trials:
            raise ConfigError(f"no stack of the space replays on {trace_path}: {skipped[0]['why']}")
        if any(t["objective"] is None for t in trials):  # tpot of a trace without decode steps
            raise ConfigError(f"tune.objective={opts.objective}: the trace {trace_path} gives no {metric} (it has no "
                              f"decode passes: record a generation task, or use tune.objective=hit_rate)")
        _write_csv(out / "trials.csv", [{**t, "stack": " ".join(t["stack"])} for t in trials])
        if skipped:
            (out / "skipped.json").write_text(json.dumps(skipped, indent=2))

        # 3.-4. finalists, measured live in order of the objective (see select_finalists)
        quality = [f"eval.tasks=[{opts.quality_task}]", f"eval.limit={opts.quality_limit}", "replay.trace=null",
                   f"eval.token_by_token={str(opts.token_by_token).lower()}"]
        live = [a for a in base if not a.startswith(("replay.", "eval.tasks=", "eval.limit="))]

        def perplexity(over: list[str], name: str) -> float:
            res = execute(compose(config_name="config", overrides=[*live, *quality, *over]),
                          run_dir=str(out / "finalists" / name))
            task = res["tasks"][opts.quality_task]
            key = "word_perplexity" if "word_perplexity" in task else next(iter(task))
            return float(task[key])

        ref = perplexity(["stack.enabled=false"], "unhooked")
        ranked = sorted(trials, key=lambda t: t["objective"], reverse=better is max)
        rows = select_finalists(ranked, lambda t, i: perplexity(list(t["stack"]), str(i)) / ref - 1.0, opts)
        for r in rows:
            r["perplexity"] = (1.0 + r["loss"]) * ref
        _write_csv(out / "finalists.csv", rows)

    # 5. the Pareto front and the winner
    front = sorted(pareto(rows, better), key=lambda r: r["objective"], reverse=better is max)
    within = [r for r in rows if r["loss"] <= opts.budget + 1e-12]
    winner = (max if better is max else min)(within, key=lambda r: r["objective"]) if within else None
    command = None if winner is None else " ".join(["python -m specmd", *live, winner["stack"]])
    quality_command = None if winner is None else " ".join(["python -m specmd", *live, *quality[:2], quality[3], winner["stack"]])
    summary = {"objective": opts.objective, "budget": opts.budget, "trace": trace_path, "trials": len(trials),
               "skipped": len(skipped), "unhooked_perplexity": ref, "finalists": rows, "pareto": front,
               "winner": winner, "command": command, "quality_command": quality_command}
    (out / "tune.json").write_text(json.dumps(summary, indent=2))
    _print(console, summary, opts)
    return summary


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _print(console, s: dict, opts: Options) -> None:
    from rich.table import Table

    unit = "TPOT ms" if opts.objective == "tpot" else "hit %"
    scale = 1e3 if opts.objective == "tpot" else 100.0
    table = Table(title=f"specmd tune: Pareto front of {len(s['finalists'])} finalists ({s['trials']} stacks "
                        f"replayed; quality: {opts.quality_task}, unhooked perplexity {s['unhooked_perplexity']:.4g})")
    for col in ("stack", unit, "quality loss %", f"within {opts.budget:.1%}"):
        table.add_column(col)
    for r in s["pareto"]:
        table.add_row(r["stack"], f"{r['objective'] * scale:.3f}", f"{100 * r['loss']:+.2f}",
                      "yes" if r["loss"] <= opts.budget + 1e-12 else "no")
    console.print(table)
    if s["winner"] is None:
        console.print(f"no finalist is within the budget of {opts.budget:.1%}", highlight=False)
    else:
        console.print(f"winner: {s['command']}", highlight=False, soft_wrap=True)
    console.print(f"wrote {opts.out}/tune.json, trials.csv, finalists.csv", highlight=False)
