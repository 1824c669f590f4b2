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
   of the window's own experts); the quality loss is ``ppl / ppl_unhooked - 1``. Another task is scored by
   the metric its paper reports (:data:`specmd.eval.harness.QUALITY`: GSM8K strict match, MMLU accuracy...)
   or by ``tune.quality_metric=<lm-eval key>`` with ``tune.quality_higher=true|false``; a higher-is-better
   metric's loss is ``1 - value / value_unhooked``. A task whose metric or direction tune does not know is
   refused before anything runs (taking lm-eval's first key measured GSM8K's ``sample_len``: +0.00% loss for
   every stack), as is an unhooked score of 0 or a non-finite one (nothing to lose). The search stops at the
   first stack within budget (every later one is slower) or at a lossless one (standard routing, every miss
   fetched at the stored precision: bit-identical to the unhooked model); a stack over budget rules out the
   untried ones at least as lossy (same routing and miss policy, every knob as aggressive or more, a cache
   no larger: an assumption that quality falls monotonically with each), so the next live run goes to a
   gentler setting. At most ``tune.finalists`` live runs, then the best lossless stack as the fallback.
   -> ``finalists.csv`` and each run's directory under ``finalists/``.
4. **Pareto front and winner**: the finalists no other finalist beats on both objective and loss are
   printed; the winner is the best objective whose loss is within ``tune.budget`` (a fraction: 0.01 = 1 %
   perplexity), with the command line that re-runs it. -> ``tune.json``.

The space (``tune.<group>=[...]`` restricts a group's choices; ``tune.capacities`` lists capacities; a single
value, ``tune.capacities=0.05``, is a one-element list, and tune says so):
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

import itertools
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, DataError
from . import list_value, plain_value

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
    quality_metric: str = ""  # empty: the task's metric in QUALITY
    quality_higher: Optional[bool] = None  # empty: the metric's known direction
    token_by_token: bool = True
    out: str = ""
    choices: dict = field(default_factory=dict)  # group -> allowed choices
    notes: list = field(default_factory=list)  # how an option was read, said before the work (a scalar as a list)

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
        self.capacities = list(dict.fromkeys(self.capacities))  # a repeated capacity: one stack, one trial
        self.quality_metric, self.quality_higher = quality_measure(self.quality_task, self.quality_metric,
                                                                   self.quality_higher)
        for group, names in self.choices.items():
            bad = [n for n in names if n not in SPACE[group]]
            if bad or not names:
                raise ConfigError(f"tune.{group}={names}: {bad or 'empty'}; valid choices: {', '.join(SPACE[group])}")


# metrics whose direction is known without the task: the perplexities (lower is better) and the scores
LOWER_IS_BETTER = ("word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity")
HIGHER_IS_BETTER = ("acc", "acc_norm", "exact_match", "mc1", "mc2", "f1", "em")


def quality_measure(task: str, metric: str, higher) -> tuple:
    """``(metric, higher is better)`` that ``tune`` judges ``task``'s quality by: the task's in
    :data:`~specmd.eval.harness.QUALITY` unless ``tune.quality_metric`` names another; the direction from
    ``tune.quality_higher``, else known for the task's own metric or a perplexity. Anything else is a
    :class:`ConfigError` before any work."""
    from ..eval.harness import QUALITY

    known = ", ".join(f"{t} ({m}, {'higher' if h else 'lower'} is better)" for t, (m, h) in QUALITY.items())
    if not metric:
        if task not in QUALITY:
            raise ConfigError(f"tune.quality_task={task}: tune knows the quality metric of {known}; for another "
                              f"task name the lm-eval metric and its direction: tune.quality_metric=<key> "
                              f"tune.quality_higher=true|false")
        metric = QUALITY[task][0]
    known = direction(task, metric)
    if higher is None:
        if known is None:
            raise ConfigError(f"tune.quality_metric={metric}: whether higher or lower is better is unknown; set "
                              f"tune.quality_higher=true (an accuracy, a match rate) or false (a perplexity)")
        higher = known
    elif known is not None and bool(higher) != known:  # every lossy stack would "gain" quality and fit any budget
        raise ConfigError(f"tune.quality_higher={str(bool(higher)).lower()} contradicts {metric} of {task}, whose "
                          f"{'higher' if known else 'lower'} values are better: leave tune.quality_higher out")
    return metric, bool(higher)


def direction(task: str, metric: str):
    """Whether higher values of ``metric`` are better when that is known (the task's own metric in QUALITY, a
    perplexity, an accuracy or match rate), else None."""
    from ..eval.harness import QUALITY

    if task in QUALITY and QUALITY[task][0] == metric:
        return QUALITY[task][1]
    base = metric.split("/")[0].split(",")[0]
    return False if base in LOWER_IS_BETTER else True if base in HIGHER_IS_BETTER else None


def quality_loss(value: float, ref: float, higher: bool) -> float:
    """The fraction of quality lost against the unhooked model: ``value / ref - 1`` for a perplexity,
    ``1 - value / ref`` for a score (both > 0 when quality fell)."""
    return 1.0 - value / ref if higher else value / ref - 1.0


def parse(argv: list[str]) -> tuple[Options, list[str]]:
    """``tune.*`` options and the base configuration's overrides."""
    opts, rest = Options(), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key.startswith("-"):  # (Hydra's grammar error for it named no option: LexerNoViableAltException)
            raise ConfigError(f"{arg!r}: specmd tune takes overrides (key=value), not options; its own are "
                              "tune.<option>=<value> (specmd tune --help)")
        if not key.startswith("tune."):
            rest.append(arg)
            continue
        name = key[len("tune."):]
        valid = ["objective", "budget", "trials", "finalists", "seed", "capacities", "quality_task",
                 "quality_limit", "quality_metric", "quality_higher", "token_by_token", "out", *SPACE]
        if name not in valid:
            raise ConfigError(f"tune.{name}: unknown option; valid: {', '.join(valid)}")
        if not eq:
            raise ConfigError(f"{arg!r}: expected tune.<option>=<value>")
        try:
            if name in SPACE:
                opts.choices[name] = list_value(key, value, opts.notes)
            elif name == "capacities":
                opts.capacities = [float(v) for v in list_value(key, value, opts.notes)]
            elif name == "out":
                opts.out = plain_value(key, value)
            elif name in ("objective", "quality_task", "quality_metric"):
                setattr(opts, name, value)
            elif name in ("trials", "finalists", "seed", "quality_limit"):
                try:
                    setattr(opts, name, int(value))
                except ValueError:
                    raise ConfigError(f"{arg!r}: tune.{name} is a whole number"
                                      + (" >= 1" if name != "seed" else "")) from None
            elif name == "budget":
                opts.budget = float(value)
            elif value.lower() in ("true", "false"):  # token_by_token, quality_higher
                setattr(opts, name, value.lower() == "true")
            else:
                raise ValueError(value)
        except ConfigError:
            raise
        except ValueError:
            raise ConfigError(f"{arg!r}: {value!r} is not a valid value for tune.{name}") from None
    opts.check()
    for arg in rest:
        group = arg.partition("=")[0].split(".")[0].lstrip("+")
        if group in SPACE:
            raise ConfigError(f"{arg!r}: tune searches {group}; restrict it with tune.{group}=[...] instead")
    from ..results import unique_suffix

    opts.out = opts.out or time.strftime("outputs/tune/%Y-%m-%d/%H-%M-%S-") + unique_suffix()  # as a run's
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
    """``specmd tune``; bad input raises :class:`ConfigError` (one line, exit 2: specmd.cli). Exit 1 when no
    finalist is within the budget."""
    from rich.console import Console

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # its help, not a Hydra override error (specmd.cli: every command has one)
        print(__doc__.strip())
        return 0
    opts, base = parse(argv)
    for note in opts.notes:
        print(f"specmd tune: note: {note}", file=sys.stderr)
    result = tune(opts, base, Console())
    return 0 if result["winner"] else 1


def _record(base: list[str], raw: dict) -> tuple:
    """Step 1: record the base configuration's routing once (or take the trace given) and open it for replay;
    (its path, the replay runs' overrides, the trace)."""
    from hydra import compose

    from ..app import Run, recorded_trace
    from ..models.loader import checkpoint_of, model_override
    from ..replay.config import open_trace

    given = any(a.startswith("replay.trace=") and a.split("=", 1)[1] not in ("null", "record") for a in base)
    base_run = Run(compose(config_name="config", overrides=[*base, *([] if given else ["replay.trace=record"])]))
    trace_path = base_run.replay.trace if given else recorded_trace(base_run)
    replay_over = [*(a for a in base if not a.startswith("replay.trace=")), f"replay.trace={trace_path}"]
    trace = open_trace(Run(compose(config_name="config", overrides=replay_over)).replay)
    # the finalists run live on the base's model: the trace's must be it (one identity: the checkpoint, however
    # the trace and the config name it -- a config name, a mapping, a checkpoint id)
    recorded = checkpoint_of(trace.meta.source.get("model"))  # (an import's: none)
    if given and recorded and recorded != checkpoint_of(raw["model"]):
        raise ConfigError(f"replay.trace={trace_path} was recorded on {recorded}, but the live runs of the "
                          f"finalists would run model={raw['model']['name']} ({checkpoint_of(raw['model']) or 'seeded random'}): add "
                          f"{model_override(recorded)}")
    return trace_path, replay_over, trace


def _search(opts: Options, out: Path, trace, trace_path, replay_over: list[str], space: list, own: tuple) -> tuple:
    """Step 2: replay the drawn stacks and score them by the objective, written to trials.csv (and the stacks
    the trace cannot replay to skipped.json); (trials, skipped)."""
    from hydra import compose

    from ..app import Run
    from ..pool import replay_many
    from ..replay.driver import check
    from ..results import write_csv, write_json_atomic

    kind, metric, _ = OBJECTIVES[opts.objective]
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
    write_csv(out / "trials.csv", [{**t, "stack": " ".join(t["stack"])} for t in trials])
    if skipped:
        write_json_atomic(out / "skipped.json", skipped)
    return trials, skipped


def _finalists(opts: Options, out: Path, live: list[str], quality: list[str], trials: list) -> tuple:
    """Steps 3-4: the unhooked model's quality, then the finalists measured live in order of the objective
    (see select_finalists), written to finalists.csv; (the unhooked quality, the finalists' rows)."""
    from hydra import compose

    from ..app import execute
    from ..results import write_csv

    better = OBJECTIVES[opts.objective][2]
    scores = {}

    def score(over: list[str], name: str) -> float:
        run_dir = out / "finalists" / name
        res = execute(compose(config_name="config", overrides=[*live, *quality, *over]), run_dir=str(run_dir))
        scores[name] = value = quality_value(res, opts, run_dir / "results.json")
        return value

    ref = score(["stack.enabled=false"], "unhooked")
    if ref == 0:
        raise DataError(f"the unhooked model scores {opts.quality_metric}=0 on {opts.quality_task} "
                        f"({out / 'finalists' / 'unhooked' / 'results.json'}): there is no quality to lose, so "
                        f"the budget judges nothing; use a task the model scores on, or more documents "
                        f"(tune.quality_limit)")
    ranked = sorted(trials, key=lambda t: t["objective"], reverse=better is max)
    rows = select_finalists(ranked, lambda t, i: quality_loss(score(list(t["stack"]), str(i)), ref,
                                                              opts.quality_higher), opts)
    for i, r in enumerate(rows):
        r["quality"] = scores[str(i)]
    write_csv(out / "finalists.csv", rows)
    return ref, rows


def tune(opts: Options, base: list[str], console) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from .. import CONF_DIR
    from ..app import Run

    from ..results import output_dir, write_json_atomic

    out = output_dir(opts.out, "tune.out", "tune.json")  # before any work: a path it cannot write loses nothing
    better = OBJECTIVES[opts.objective][2]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=base), resolve=False)
        if raw["hardware"].get("experts_per_layer") is not None:
            raise ConfigError("specmd tune varies hardware.capacity; drop hardware.experts_per_layer="
                              f"{raw['hardware']['experts_per_layer']}")
        quality = [f"eval.tasks=[{opts.quality_task}]", f"eval.limit={opts.quality_limit}", "replay.trace=null",
                   f"eval.token_by_token={str(opts.token_by_token).lower()}"]
        live = [a for a in base if not a.startswith(("replay.", "eval.tasks=", "eval.limit="))]
        Run(compose(config_name="config", overrides=[*live, *quality]))  # the live runs' config, checked now
        # 1. record the routing once (or take the trace given)
        trace_path, replay_over, trace = _record(base, raw)
        own = own_stack(raw)
        space = candidates(opts, float(raw["hardware"]["capacity"]))

        # 2. search on replay
        trials, skipped = _search(opts, out, trace, trace_path, replay_over, space, own)

        # 3.-4. finalists, measured live in order of the objective (see select_finalists)
        ref, rows = _finalists(opts, out, live, quality, trials)

    # 5. the Pareto front and the winner
    front = sorted(pareto(rows, better), key=lambda r: r["objective"], reverse=better is max)
    within = [r for r in rows if r["loss"] <= opts.budget + 1e-12]
    winner = (max if better is max else min)(within, key=lambda r: r["objective"]) if within else None
    command = None if winner is None else " ".join(["python -m specmd", *live, winner["stack"]])
    quality_command = None if winner is None else " ".join(["python -m specmd", *live, *quality[:2], quality[3], winner["stack"]])
    summary = {"objective": opts.objective, "budget": opts.budget, "trace": trace_path, "trials": len(trials),
               "skipped": len(skipped), "quality_task": opts.quality_task, "quality_metric": opts.quality_metric,
               "higher_is_better": opts.quality_higher, "unhooked_quality": ref, "finalists": rows,
               "pareto": front, "winner": winner, "command": command, "quality_command": quality_command}
    write_json_atomic(out / "tune.json", summary)
    _print(console, summary, opts)
    return summary


def quality_value(results: dict, opts: Options, path: Path) -> float:
    """The quality metric of a live run's ``results`` (written to ``path``): a finite number, else a
    :class:`~specmd.errors.DataError` naming the file and the key (never a loss judged on NaN)."""
    task = results["tasks"].get(opts.quality_task) or {}
    if opts.quality_metric not in task:
        raise DataError(f"{path}: tasks.{opts.quality_task} has no {opts.quality_metric!r} (it has "
                        f"{', '.join(task) or 'no metric'}); name one with tune.quality_metric=<key>")
    value = task[opts.quality_metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{path}: tasks.{opts.quality_task}.{opts.quality_metric} is {value!r}, not a finite "
                        f"number: the quality loss cannot be judged")
    return float(value)


def _print(console, s: dict, opts: Options) -> None:
    from rich.table import Table

    unit = "TPOT ms" if opts.objective == "tpot" else "hit %"
    scale = 1e3 if opts.objective == "tpot" else 100.0
    table = Table(title=f"specmd tune: Pareto front of {len(s['finalists'])} finalists ({s['trials']} stacks "
                        f"replayed; quality: {opts.quality_task} {opts.quality_metric}, unhooked {s['unhooked_quality']:.4g})")
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
