"""Lossless check on any device: hooked == unhooked logits and greedy generations for all 8 tiny families.

    python benchmarks/lossless_check.py --device cuda
"""

import sys

import torch

sys.path.insert(0, ".")  # (the repository root: tests.conftest)
from tests.conftest import FAMILIES, make_stack  # noqa: E402

from specmd.models.loader import build_tiny  # noqa: E402
from specmd.cli import script  # noqa: E402


def main(argv: list) -> int:
    ap = script.ArgumentParser()
    ap.add_argument("--device", type=script.device, default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    ok = True
    for family in FAMILIES:
        model = build_tiny(family, dtype=args.dtype).to(args.device)
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(args.device)
        with torch.no_grad():
            ref, gref = model(ids).logits, model.generate(ids[:1, :16], max_new_tokens=8, do_sample=False)
            with make_stack(model, family, capacity=0.05) as stack:
                out, gout = model(ids).logits, model.generate(ids[:1, :16], max_new_tokens=8, do_sample=False)
        same = torch.equal(out, ref) and torch.equal(gout, gref)
        ok &= same
        s = stack.cache.stats.summary()
        print(f"{family:<12} equal={same} requests={s['requests']} hit_rate={s['hit_rate']:.3f}")
    print("ALL EQUAL" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    script.run("benchmarks/lossless_check.py", main)
