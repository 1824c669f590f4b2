"""Serving figures on the embedded models (issue 44), each from ``python -m specmd`` runs whose results.json it
reads (every figure is a run a user can repeat by hand):

1. **Live batches against composed ones.** GSM8K requests run live at batch 1 with ``trace.save=true``, then
   live at batch B (lm-eval batches them, pads and finished sequences no requests), and the batch-1 trace is
   replayed composed at ``replay.batch=B`` (docs/replay.md). Printed per B: the decode union (% of the layer)
   and the decode hit rate, live and composed, and their difference -- how far composing independent requests
   is from a live batch on this model.
2. **Layer streaming** (``hardware.stream_layers``) off and on, replayed at B from the same trace: TTFT, decode
   tokens per simulated second, the decode hit rate and bytes per token.
3. **Batch-aware routing at B=16 live** (``routing=standard,piggyback,budget``): quality (WikiText scored one
   token per pass, ``eval.token_by_token=true``, so every scored token is a decode step of 16 sequences: the
   passes the policies act on; word perplexity, lower is better), routing fidelity, distinct experts per decode
   step and decode tokens per simulated second.

    python benchmarks/batching.py                              # deep_olmoe, B in 4 8 16, 16 requests
    python benchmarks/batching.py --model deep_mixtral --batches 4 8 --requests 8 --skip-policies
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from specmd.cli import script


def run(out: Path, *overrides: str) -> dict:
    """``python -m specmd OVERRIDES`` into ``out``; its results.json."""
    cmd = [sys.executable, "-m", "specmd", *overrides, "logger=none", f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


def pct(x) -> str:
    return "    -" if x is None else f"{100 * x:5.1f}"


def union(res: dict):
    d = (res["cache"].get("union") or {}).get("decode")
    return None if d is None else d["fraction"]


def task_metric(res: dict, task: str, key: str):
    """A task's metric by name (lm-eval's filter suffix, if any, ignored)."""
    for k, v in (res.get("tasks") or {}).get(task, {}).items():
        if k == key or k.startswith(key + "/"):
            return v
    return None


def main(argv: list) -> int:
    ap = script.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deep_olmoe")
    ap.add_argument("--batches", nargs="+", type=script.whole(1), default=[4, 8, 16])
    ap.add_argument("--requests", type=script.whole(1), default=16, help="GSM8K requests (eval.limit)")
    ap.add_argument("--capacity", type=float, default=0.25)
    ap.add_argument("--gen", type=script.whole(1), default=32, help="eval.max_gen_toks")
    ap.add_argument("--stream", type=float, default=0.5, help="hardware.stream_layers in section 2")
    ap.add_argument("--skip-policies", action="store_true", help="leave out section 3")
    ap.add_argument("--skip-live-batches", action="store_true",
                    help="section 1: only the batch-1 recording (what section 2 replays)")
    ap.add_argument("--policy-docs", type=script.whole(1), default=4, help="WikiText documents in section 3")
    a = ap.parse_args(argv)
    common = [f"model={a.model}", f"hardware.capacity={a.capacity}", "prefetch=none", "eviction=lru",
              "eval.tasks=[gsm8k]", f"eval.limit={a.requests}", f"eval.max_gen_toks={a.gen}"]
    tmp = Path(tempfile.mkdtemp(prefix="specmd-batching-"))
    print(f"{a.model}, {a.requests} GSM8K requests x {a.gen} tokens, capacity {a.capacity}, LRU, prefetch none; "
          f"runs under {tmp}")

    one = run(tmp / "live-b1", *common, "eval.batch_size=1", "trace.save=true")
    trace = tmp / "live-b1" / "trace"
    live_against_composed(a, common, tmp, one, trace)
    streaming(a, common, tmp, trace)
    if not a.skip_policies:
        batch_aware_routing(a, tmp)
    return 0


def live_against_composed(a, common: list, tmp: Path, one: dict, trace: Path) -> None:
    """1. Live batches beside batch-1 requests composed into batches (replay.batch)."""
    print("\n1. live batches against batch-1 requests composed (replay.batch): decode union % of the layer, "
          "decode hit %")
    print(f"{'B':>3} | {'union live':>10} {'composed':>9} {'diff':>6} | {'hit live':>8} {'composed':>9} {'diff':>6}"
          f" | {'oracle live':>11} {'composed':>9}")
    print(f"{1:>3} | {pct(union(one)):>10} {'':>9} {'':>6} | {pct(one['cache']['decode_hit_rate']):>8}")
    for b in ([] if a.skip_live_batches else a.batches):
        live = run(tmp / f"live-b{b}", *common, f"eval.batch_size={b}", "trace.save=true")
        comp = run(tmp / f"composed-b{b}", *common, f"replay.trace={trace}", f"replay.batch={b}")
        ul, uc = union(live), union(comp)
        hl, hc = live["cache"]["decode_hit_rate"], comp["cache"]["decode_hit_rate"]
        ol = (live["cache"].get("oracle") or {}).get("decode_hit_rate")
        oc = (comp["cache"].get("oracle") or {}).get("decode_hit_rate")
        du = None if ul is None or uc is None else uc - ul
        dh = None if hl is None or hc is None else hc - hl
        print(f"{b:>3} | {pct(ul):>10} {pct(uc):>9} {pct(du) if du is not None else '':>6} | {pct(hl):>8} "
              f"{pct(hc):>9} {pct(dh) if dh is not None else '':>6} | {pct(ol):>11} {pct(oc):>9}", flush=True)


def streaming(a, common: list, tmp: Path, trace: Path) -> None:
    """2. Layer streaming replayed from the batch-1 trace at each batch size."""
    print(f"\n2. layer streaming (hardware.stream_layers={a.stream}) replayed from the batch-1 trace at each B")
    print(f"{'B':>3} {'stream':>7} | {'TTFT ms':>8} {'decode tok/s':>12} {'decode hit %':>12} {'MB/token':>9} "
          f"{'streamed calls':>14}")
    for b in [1] + a.batches:
        for s in ("null", str(a.stream)):
            res = run(tmp / f"stream-{s}-b{b}", *common, f"replay.trace={trace}", f"replay.batch={b}",
                      f"hardware.stream_layers={s}", "replay.oracle=false")
            t, c = res["timing"], res["cache"]
            print(f"{b:>3} {s:>7} | {t['ttft_s'] * 1e3:8.2f} {t['decode_tokens_per_s'] or 0:12.1f} "
                  f"{pct(c['decode_hit_rate']):>12} {(c['union']['bytes_per_token'] or 0) / 1e6:9.3f} "
                  f"{c['layer_streams']:>14}", flush=True)


def batch_aware_routing(a, tmp: Path) -> None:
    """3. Batch-aware routing at B=16, live."""
    print(f"\n3. batch-aware routing at B=16 live: WikiText ({a.policy_docs} documents) scored one token per pass")
    print(f"{'routing':>10} | {'word ppl':>9} {'fidelity':>8} {'union % (decode)':>16} {'decode tok/s':>12} "
          f"{'decode hit %':>12}")
    for routing in ("standard", "piggyback", "budget"):
        res = run(tmp / f"policy-{routing}", f"model={a.model}", f"hardware.capacity={a.capacity}",
                  "prefetch=none", "eviction=lru", f"routing={routing}", "eval.tasks=[wikitext]",
                  f"eval.limit={a.policy_docs}", "eval.batch_size=16", "eval.token_by_token=true",
                  "eval.max_length=128")
        print(f"{routing:>10} | {task_metric(res, 'wikitext', 'word_perplexity') or float('nan'):9.3f} "
              f"{res['routing']['fidelity']:8.4f} {pct(union(res)):>16} "
              f"{res['timing']['decode_tokens_per_s'] or 0:12.1f} {pct(res['cache']['decode_hit_rate']):>12}",
              flush=True)


if __name__ == "__main__":
    script.run("benchmarks/batching.py", main)
