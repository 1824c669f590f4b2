"""The papers' directions on specmd's deep embedded models, measured by replay of recorded routing.

    python experiments/directions.py --out outputs/directions                  # deep_olmoe (132 s on 2 cores)
    python experiments/directions.py --models tiny --limit 2 --out /tmp/d        # a quick look

(Any model config works, e.g. a local checkpoint of the unshipped Mixtral-shaped recipe: experiments/README.md.)

1. Record: one live generation run per model through the CLI (GSM8K test, ``--limit`` problems, 5-shot
   prompts, ``--new-tokens`` greedy tokens each; SpecMD measures on generation tasks) with
   ``trace.save=true trace.depth=1`` (the signal ``prefetch=score`` reads). Skipped when the trace exists.
2. Replay every configuration on the trace (all exact: standard routing, ``miss=fetch``):
   * SpecMD Fig. 4/8: collision and hit rate of FLD (both distances), SB (score eviction), LRU, LS (every
     order) and Belady at 1 / 5 / 25 % capacity, ``prefetch=none``; in-cache rate under ``prefetch=score``;
   * SpecMD Fig. 5/9: per-layer collision rate at 5 %;
   * FlashMoE Fig. 6: decode hit rate (``stack.measure=decode``, FlashMoE measures decoding) vs cache size
     of LRU, LFU, ARC, LeCaR, ML (the networks shipped with each model, trained by its recipe) and Belady.
3. Write ``tables.md`` (the tables of experiments/README.md) and ``rows.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIG4_CAPACITIES = (0.01, 0.05, 0.25)
FIG6_CAPACITIES = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
# (label, eviction config): SpecMD's four policies with every reading, and the oracle
FIG4 = [
    ("FLD absolute", {"name": "fld", "distance": "absolute"}),
    ("FLD forward", {"name": "fld", "distance": "forward"}),
    ("SB", {"name": "score"}),
    ("LRU", {"name": "lru"}),
    ("LS left_then_right", {"name": "least_stale", "order": "left_then_right"}),
    ("LS layer", {"name": "least_stale", "order": "layer"}),
    ("LS needed_last", {"name": "least_stale", "order": "needed_last"}),
    ("LS insertion", {"name": "least_stale", "order": "insertion"}),
    ("Belady", {"name": "belady"}),
]
FIG6 = ["lru", "lfu", "arc", "lecar", "ml", "belady"]


def record(model: str, out: Path, limit: int, new_tokens: int) -> Path:
    run_dir = out / model / "record"
    trace = run_dir / "trace"
    if (trace / "meta.json").exists() and (run_dir / "results.json").exists():
        return trace
    cmd = [sys.executable, "-m", "specmd", f"model={model}", "eval.tasks=[gsm8k]", f"eval.limit={limit}",
           f"eval.max_gen_toks={new_tokens}", "eviction=lru", "prefetch=none", "trace.save=true", "trace.depth=1",
           f"hydra.run.dir={run_dir}"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return trace


def replay(trace, eviction: dict, capacity: float, prefetch="none", measure="all") -> dict:
    from specmd.engine import StackSpec
    from specmd.hardware import HardwareConfig
    from specmd.replay.driver import exactness, run_replay

    spec = StackSpec.of(eviction=eviction, prefetch=prefetch, hardware=HardwareConfig(capacity=capacity),
                        measure=measure)
    assert not exactness(trace, spec), exactness(trace, spec)
    return run_replay(trace, spec).results()["cache"]


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def fig4(model: str, trace, rows: list) -> list[str]:
    lines = [f"#### {model}: SpecMD Fig. 4/8 (collision rate % / hit rate %, all passes; in-cache % under prefetch=score)",
             "", "| policy | " + " | ".join(f"{int(c * 100)}%: coll / hit / in-cache(score)" for c in FIG4_CAPACITIES) + " |",
             "|---|" + "---|" * len(FIG4_CAPACITIES)]
    per_layer = {}
    for label, ev in FIG4:
        cells = []
        for cap in FIG4_CAPACITIES:
            c = replay(trace, ev, cap)
            s = replay(trace, ev, cap, prefetch="score")
            rows.append(dict(model=model, figure="specmd_fig4", policy=label, capacity=cap,
                             collision_rate=c["collision_rate"], hit_rate=c["hit_rate"],
                             in_cache_rate_score=s["in_cache_rate"]))
            cells.append(f"{pct(c['collision_rate'])} / {pct(c['hit_rate'])} / {pct(s['in_cache_rate'])}")
            if cap == 0.05:
                per_layer[label] = c["per_layer"]["collision_rate"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    L = len(next(iter(per_layer.values())))
    picks = sorted({0, L // 4, L // 2, 3 * L // 4, L - 1})
    lines += ["", f"#### {model}: SpecMD Fig. 5/9 (per-layer collision rate % at 5%, layers {picks})", "",
              "| policy | " + " | ".join(f"L{l}" for l in picks) + " | mean first half | mean second half |",
              "|---|" + "---|" * (len(picks) + 2)]
    for label, pl in per_layer.items():
        h = L // 2
        lines.append(f"| {label} | " + " | ".join(pct(pl[l]) for l in picks)
                     + f" | {pct(sum(pl[:h]) / h)} | {pct(sum(pl[h:]) / (L - h))} |")
        rows.append(dict(model=model, figure="specmd_fig5", policy=label, capacity=0.05, per_layer=pl))
    return lines


def fig6(model: str, trace, rows: list) -> list[str]:
    from omegaconf import OmegaConf

    asset = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml").pretrained  # its ml networks ship beside it
    lines = [f"#### {model}: FlashMoE Fig. 6 (decode hit rate % vs capacity)", "",
             "| policy | " + " | ".join(f"{c:g}" for c in FIG6_CAPACITIES) + " |",
             "|---|" + "---|" * len(FIG6_CAPACITIES)]
    from specmd.errors import ConfigError
    from specmd.policies.eviction.ml import resolve_weights

    try:
        has_ml = bool(resolve_weights(asset))  # the networks eviction=ml would load for this model
    except ConfigError:
        has_ml = False
    for name in FIG6:
        if name == "ml" and not has_ml:
            lines.append(f"| ml | networks not shipped for {asset} yet (`python -m specmd.train_eviction`) |")
            continue
        ev = {"name": name, "weights": asset} if name == "ml" else {"name": name}
        cells = []
        for cap in FIG6_CAPACITIES:
            c = replay(trace, ev, cap, measure="decode")
            rows.append(dict(model=model, figure="flashmoe_fig6", policy=name, capacity=cap, hit_rate=c["hit_rate"]))
            cells.append(pct(c["hit_rate"]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def claims(model: str, rows: list) -> list[str]:
    """The papers' directional claims, checked on this model's rows: one table line each."""
    f4 = {(r["policy"], r["capacity"]): r for r in rows if r["model"] == model and r["figure"] == "specmd_fig4"}
    f5 = {r["policy"]: r["per_layer"] for r in rows if r["model"] == model and r["figure"] == "specmd_fig5"}
    f6 = {(r["policy"], r["capacity"]): r["hit_rate"] for r in rows if r["model"] == model
          and r["figure"] == "flashmoe_fig6"}
    coll = lambda p, c=0.05: f4[p, c]["collision_rate"]  # noqa: E731
    out = [f"#### {model}: the papers' directions", "", "| claim (paper) | paper | ours | holds |", "|---|---|---|---|"]

    def line(claim, paper, ours, holds):
        out.append(f"| {claim} | {paper} | {ours} | {'yes' if holds else '**no**'} |")

    for order in ("left_then_right", "layer", "needed_last", "insertion"):
        ls = coll(f"LS {order}")
        line(f"LS ({order}) has fewer collisions than LRU at 5% (SpecMD §5.2)", "1.6–1.9% vs 4.5–12.6%",
             f"{pct(ls)}% vs {pct(coll('LRU'))}%", ls < coll("LRU"))
    worst = max(("FLD absolute", "SB", "LRU", "LS left_then_right"), key=coll)
    line("SB has the most collisions of FLD/SB/LRU/LS at 5% (SpecMD §5.2)", "SB 42.6–60.9%",
         f"worst: {worst} {pct(coll(worst))}%", worst == "SB")
    for reading in ("absolute", "forward"):
        fld = coll(f"FLD {reading}")
        line(f"FLD ({reading}) no worse than LRU at 5% (SpecMD §5.2: slightly better)", "slightly below LRU",
             f"{pct(fld)}% vs {pct(coll('LRU'))}%", fld <= coll("LRU"))
    for order in ("left_then_right", "layer", "needed_last", "insertion"):
        ls = coll(f"LS {order}", 0.01)
        line(f"LS ({order}) collisions below LRU's at 1% (SpecMD: up to 85x fewer)", "up to 85x",
             f"{pct(ls)}% vs {pct(coll('LRU', 0.01))}%", ls < coll("LRU", 0.01))
    if "LRU" in f5:
        pl = f5["LRU"]
        h = len(pl) // 2
        first, second = sum(pl[:h]) / h, sum(pl[h:]) / (len(pl) - h)
        line("LRU's collisions accumulate with depth at 5% (SpecMD Fig. 5)", "rising through the layers",
             f"first half {pct(first)}%, second {pct(second)}%", second > first)
    caps = sorted({c for _, c in f6})
    for base in ("lru", "lfu", "arc", "lecar"):
        if ("ml", caps[0]) not in f6:
            break
        wins = sum(f6["ml", c] >= f6[base, c] for c in caps)
        line(f"ML hit rate >= {base.upper()} at every size (FlashMoE Fig. 6)", "ML highest everywhere",
             f"{wins}/{len(caps)} sizes", wins == len(caps))
    best = all(f6["belady", c] >= max(f6[p, c] for p in FIG6 if (p, c) in f6) for c in caps)
    line("Belady >= every policy (optimum)", "by definition", "all sizes" if best else "violated", best)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["deep_olmoe"])
    ap.add_argument("--limit", type=int, default=10, help="GSM8K problems in the recorded run")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="outputs/directions")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from specmd.replay.trace import read_trace

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lines, rows = [], []
    for model in args.models:
        t0 = time.perf_counter()
        trace = read_trace(record(model, out, args.limit, args.new_tokens))
        kinds = trace.passes[:, 0].tolist()
        lines += [f"### {model}", "", f"Trace: {len(trace.passes)} passes ({kinds.count(0)} prefill, "
                  f"{kinds.count(1)} decode), {len(trace.calls)} layer calls; GSM8K test, {args.limit} problems, "
                  f"{args.new_tokens} new tokens each.", ""]
        lines += fig4(model, trace, rows) + [""] + fig6(model, trace, rows) + [""]
        lines += claims(model, rows) + [""]
        print(f"{model}: {time.perf_counter() - t0:.0f} s", flush=True)
    (out / "tables.md").write_text("\n".join(lines) + "\n")
    with open(out / "rows.csv", "w", newline="") as f:
        keys = sorted({k for r in rows for k in r})
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
