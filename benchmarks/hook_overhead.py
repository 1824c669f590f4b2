"""Wall-time ratio hooked / unhooked for a lossless stack at capacity 1.0 (standard routing, fetch, and
``--eviction``/``--prefetch``: lru + topk by default).

    python benchmarks/hook_overhead.py [--prefetch none|topk|score] [--eviction lru|least_stale] [--repeats 5]
    python benchmarks/hook_overhead.py --eviction least_stale --prefetch score     # issue 20's second target

Models: tiny_olmoe, and a mid-size random OLMoE-shaped model (8 layers, 64 experts top-8, hidden 512,
expert intermediate 256: 201 M expert parameters, ~0.8 GB in float32). Inputs: a batch of random token ids (a prefill-like pass)
and a short greedy generation (decode passes), each timed alternately on an unhooked and a hooked copy of the
model; prints the fastest of --repeats timings per case (and the ratio of medians).
Target (issue #2): ratio <= 1.15 on the mid-size model.
"""

from __future__ import annotations

import statistics
import time

import torch

from specmd.compose import spec_of
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.models.adapters import adapter_for
from specmd.models.loader import build_tiny
from specmd.cli import script

MID = dict(hidden_size=512, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=8, num_experts=64, num_experts_per_tok=8, vocab_size=4096)


def once(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


DEVICE = "cpu"


def sync():
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def bench(name, build, prefetch, repeats, batch, seq, new_tokens, eviction="lru"):
    """Two copies of the model (``build()``, seeded: the same weights), one hooked; each case timed
    alternately on the two, ``repeats`` times after a warm-up, so drift and a noisy neighbour hit both
    alike. The ratio is of the fastest runs (the overhead under the least interference) and of the medians."""
    base_model, hooked_model = build().to(DEVICE), build().to(DEVICE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(256, base_model.config.vocab_size), (batch, seq), generator=g).to(DEVICE)
    prompt = ids[:1, :32]

    def prefill(model):
        with torch.no_grad():
            model(ids)

    def decode(model):
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)

    stack = install(hooked_model, spec_of(eviction=eviction, prefetch=prefetch,
                                          hardware=HardwareConfig(capacity=1.0)), adapter_for("olmoe"))
    rows = []
    try:
        for case, fn in (("prefill", prefill), ("generate", decode)):
            fn(base_model), fn(hooked_model)  # warm-up
            base, hooked = [], []
            for _ in range(repeats):
                base.append(once(lambda: fn(base_model)))
                hooked.append(once(lambda: fn(hooked_model)))
            rows.append((name, case, min(base), min(hooked), min(hooked) / min(base),
                         statistics.median(hooked) / statistics.median(base)))
    finally:
        stack.remove()
    return rows


def main(argv: list) -> int:
    ap = script.ArgumentParser()
    ap.add_argument("--prefetch", default="topk", choices=["none", "topk", "score"])
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--repeats", type=script.whole(1), default=5)
    ap.add_argument("--device", type=script.device, default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    rows += bench("tiny_olmoe", lambda: build_tiny("olmoe", dtype=args.dtype), args.prefetch, args.repeats, batch=4,
                  seq=256, new_tokens=16, eviction=args.eviction)
    mb = sum(p.numel() * p.element_size() for p in build_tiny("olmoe", MID, dtype=args.dtype).parameters()) / 1e6
    rows += bench(f"mid_olmoe ({mb:.0f} MB)", lambda: build_tiny("olmoe", MID, dtype=args.dtype), args.prefetch,
                  args.repeats, batch=4, seq=256, new_tokens=16, eviction=args.eviction)
    from specmd import native

    print(f"lossless stack (standard/fetch/{args.eviction}/{args.prefetch}), capacity 1.0, device={DEVICE}, "
          f"dtype={args.dtype}, threads={torch.get_num_threads()}, engine {native.summary()['engine']}; "
          f"fastest of {args.repeats} alternated runs (and the ratio of medians)")
    print(f"{'model':<22}{'case':<10}{'unhooked s':>12}{'hooked s':>12}{'ratio':>8}{'median':>8}")
    for name, case, base, hooked, ratio, med in rows:
        print(f"{name:<22}{case:<10}{base:>12.4f}{hooked:>12.4f}{ratio:>8.3f}{med:>8.3f}")
    return 0


if __name__ == "__main__":
    script.run("benchmarks/hook_overhead.py", main)
