"""Speculative replay against a live speculative run on the embedded model: how far the replay's approximation
(i.i.d. acceptances, rejected drafts routed as the true tokens) is from what transformers' prompt-lookup decoding
does, printed side by side with the differences.

    python benchmarks/speculative.py                  # K = 3, lru at capacity 0.25, 6 prompts x 48 tokens
    python benchmarks/speculative.py --K 1 3 7 --eviction least_stale

1. Live, speculating: each prompt generated greedily with ``prompt_lookup_num_tokens=K`` through the stack (every
   decode pass a verify step); its accepted tokens are the generated tokens after the prefill's first.
2. Live, not speculating, recording its routing: greedy decoding gives the same tokens (assisted generation is
   lossless), so the trace holds the routing of every token the speculating run accepted.
3. The trace replayed as verify steps of K drafts (``replay.speculative``) at the acceptance p whose expected
   accepted tokens per step, ``(1 - p^(K+1)) / (1 - p)``, equal the live run's (bisection), several seeds.

Measured (2026-11-29, K = 1, 3, 7): accepted tokens per step within 2% and the verify steps within 3; the union
per verify step 24% / 47% / 68% above live, because prompt lookup proposes fewer than K drafts where the prompt
has no match (live verifies 1.55 / 2.47 / 4.02 tokens a step at K = 1 / 3 / 7, the replay 1.98 / 3.87 / 7.39):
the replay models a drafter that always drafts K (a draft model, an MTP head), not prompt lookup's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specmd.cli import script
from specmd.compose import spec_of
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.models.loader import ModelConfig, load_model
from specmd.replay.driver import run_replay
from specmd.replay.speculative import live_section, speculate, speculative_section
from specmd.replay.trace import TraceWriter, read_trace

TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
        "clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. Natalia sold "
        "48+24 = 72 clips altogether in April and May. Weng earns $12 an hour for babysitting. Yesterday, she just "
        "did 50 minutes of babysitting. How much did she earn? Weng earns 12/60 = $0.2 per minute. Working 50 "
        "minutes, she earned 0.2 x 50 = $10.")
KEYS = ("verify_steps", "verified_per_step", "accepted_per_step", "union_per_layer_call", "loads_per_accepted_token",
        "bytes_per_accepted_token", "decode_seconds_per_accepted_token")


def prompts(tokenizer, n: int, length: int) -> list:
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[0]
    return [ids[i * 7:i * 7 + length].unsqueeze(0) for i in range(n)]


def generate(model, spec, ids_list, new_tokens, K=0, trace_dir=None):
    stack = install(model, spec)
    if trace_dir is not None:
        stack.writer = TraceWriter(trace_dir, stack.geom, stack.scoring, stack.store, 0)
    generated = 0
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if K:
        kw["prompt_lookup_num_tokens"] = K
    outs = []
    with torch.no_grad(), stack:
        for ids in ids_list:
            out = model.generate(ids, **kw)
            generated += int(out.shape[1]) - int(ids.shape[1]) - 1
            outs.append(out)
    if stack.writer is not None:
        stack.writer.close()
    return stack.engine, generated, outs


def fit_acceptance(per_step: float, K: int) -> float:
    """The i.i.d. acceptance p whose expected accepted tokens per verify step is ``per_step``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        if sum(p ** i for i in range(K + 1)) < per_step:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


def main(argv: list) -> int:
    ap = script.ArgumentParser()
    ap.add_argument("--K", type=script.whole(1), nargs="+", default=[3])
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--capacity", type=float, default=0.25)
    ap.add_argument("--prompts", type=script.whole(1), default=6)
    ap.add_argument("--tokens", type=script.whole(2), default=48)
    ap.add_argument("--seeds", type=script.whole(1), default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    spec = spec_of(eviction=args.eviction, prefetch="none", measure="decode",
                   hardware=HardwareConfig(capacity=args.capacity))
    ids = prompts(tokenizer, args.prompts, 32)
    with tempfile.TemporaryDirectory() as d:
        _, _, plain_out = generate(model, spec, ids, args.tokens, 0, Path(d) / "trace")
        trace = read_trace(Path(d) / "trace")
        print(f"embedded model, {args.eviction} at capacity {args.capacity}, {args.prompts} prompts x {args.tokens} "
              f"generated tokens; replay: median over {args.seeds} seeds (min-max)")
        print(f"{'K':>2} {'figure':<34} {'live':>12} {'replay':>28} {'replay - live':>14}")
        for K in args.K:
            engine, accepted, outs = generate(model, spec, ids, args.tokens, K)
            assert all(torch.equal(a, b) for a, b in zip(outs, plain_out)), "assisted generation changed the tokens"
            live = live_section(engine, K, accepted)
            p = fit_acceptance(live["accepted_per_step"], K)
            reps = [speculative_section(tr, run_replay(tr, spec))
                    for tr in (speculate(trace, K, p, seed) for seed in range(args.seeds))]
            print(f"{K:>2} {'fitted acceptance p':<34} {'':>12} {p:>28.3f}")
            for key in KEYS:
                vals = sorted(float(r[key]) for r in reps)
                med = vals[len(vals) // 2]
                cell = f"{med:.4g} ({vals[0]:.4g}-{vals[-1]:.4g})"
                print(f"{K:>2} {key:<34} {float(live[key]):>12.4g} {cell:>28} {med - float(live[key]):>+14.4g}")
    return 0


if __name__ == "__main__":
    script.run("benchmarks/speculative.py", main)
