"""Every policy of every family on a tiny model, on any device: lossless stacks (standard routing, plain
fetch, any eviction/prefetch) must reproduce the unhooked logits exactly; lossy ones must run and stay
finite; the cache invariants must hold. Prints one line per stack.

    python benchmarks/policy_check.py --device cuda
"""

import sys

import torch

sys.path.insert(0, ".")  # (the repository root: tests.conftest)
from tests.conftest import sample_ids, tiny  # noqa: E402

from specmd.compose import spec_of
from specmd.hardware import HardwareConfig  # noqa: E402
from specmd.hook import install  # noqa: E402
from specmd.models.adapters import adapter_for  # noqa: E402
from specmd.policies.eviction import EVICTION  # noqa: E402
from specmd.policies.miss import MISS  # noqa: E402
from specmd.policies.prefetch import PREFETCH  # noqa: E402
from specmd.policies.routing import ROUTING  # noqa: E402
from specmd.cli import script  # noqa: E402

LOSSLESS_MISS = {"fetch", "cpu_compute"}


def run(device: str, family: str, capacity: float, quiet: bool = False) -> tuple[int, list, list]:
    """(stacks that passed, names of those that failed, names skipped: the oracles, which need a trace's
    future and run only in a replay)."""
    model = tiny(family).to(device)
    ids = sample_ids().to(device)
    with torch.no_grad():
        ref = model(ids).logits
        gref = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    registries = {"routing": ROUTING, "miss": MISS, "eviction": EVICTION, "prefetch": PREFETCH}
    stacks = [(g, n) for g, reg in registries.items() for n in reg.names() if not (g == "eviction" and n == "ml")]
    good, bad, skipped = 0, [], []
    for group, name in stacks:
        if registries[group].get(name).needs_future:
            skipped.append(f"{group}={name}")
            if not quiet:
                print(f"{group}={name:<22} skipped: an oracle needs the future, which only a trace replay has")
            continue
        choice = {"routing": "standard", "miss": "fetch", "eviction": "lru", "prefetch": "topk", group: name}
        stack = install(model, spec_of(hardware=HardwareConfig(capacity=capacity),
                                       quant={"name": "hqq", "optimize": False}, **choice),
                        adapter_for(family), device=device)
        with torch.no_grad(), stack:
            out = model(ids).logits
            gout = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
        stack.cache.check_invariants()
        lossless = choice["routing"] == "standard" and choice["miss"] in LOSSLESS_MISS
        ok = bool(torch.isfinite(out).all()) and (not lossless or (torch.equal(out, ref) and torch.equal(gout, gref)))
        if ok:
            good += 1
        else:
            bad.append(f"{group}={name}")
        if not quiet:
            s = stack.cache.stats.summary()
            print(f"{group}={name:<22} {'lossless' if lossless else 'lossy   '} ok={ok} "
                  f"max|diff|={float((out - ref).abs().max()):.2e} hit_rate={s['hit_rate']:.3f} "
                  f"outcomes={ {k: v for k, v in s['miss_outcomes'].items() if v} }")
    return good, bad, skipped


def main(argv: list) -> int:
    from tests.conftest import FAMILIES

    ap = script.ArgumentParser()
    ap.add_argument("--device", type=script.device, default="cpu")
    ap.add_argument("--family", default="olmoe", type=script.choice_of(FAMILIES, "--family"))
    ap.add_argument("--capacity", type=float, default=0.1)
    args = ap.parse_args(argv)
    good, bad, skipped = run(args.device, args.family, args.capacity)
    print(f"{good} ok, {len(bad)} failed{': ' + ', '.join(bad) if bad else ''}; skipped {', '.join(skipped)}")
    print("ALL OK" if not bad else "FAILED")
    return 0 if not bad else 1


if __name__ == "__main__":
    script.run("benchmarks/policy_check.py", main)
