"""Cost of each eviction policy inside the cache manager: replays the embedded model's routing on
WikiText-2 validation (one decode step per token, per-layer pools) and prints microseconds per layer call
and the hit rate. The model is run once to record the trace; the replay has no model in it.

    python benchmarks/eviction_overhead.py --tokens 2000 --capacity 16
"""

import argparse
import os
from pathlib import Path

from specmd.eval.mirror import resolve_mirror, set_offline
from specmd.models.loader import ModelConfig, load_model
from specmd.policies.eviction import EVICTION
from specmd.train import wikitext2_valid
from specmd.train_eviction import belady_hit_rate, record_routing, replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--capacity", type=int, default=16, help="experts per layer")
    ap.add_argument("--mirror", default=os.environ.get("SPECMD_DATA_MIRROR"))
    args = ap.parse_args()
    root = resolve_mirror(args.mirror)
    set_offline()
    model, tok = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    traces = record_routing(model, wikitext2_valid(Path(root) if root else None), tok, args.tokens)
    E = model.config.num_experts
    print(f"{len(traces[0])} tokens x {len(traces)} layers, {args.capacity}/{E} experts per layer")
    print(f"{'policy':<12} {'us/layer call':>14} {'hit rate':>9}")
    for name in EVICTION.names():
        r = replay(traces, E, args.capacity, name)
        print(f"{name:<12} {1e6 * r['seconds'] / r['calls']:>14.1f} {r['hit_rate']:>9.4f}")
    print(f"{'belady':<12} {'-':>14} {belady_hit_rate(traces, args.capacity):>9.4f}")


if __name__ == "__main__":
    main()
