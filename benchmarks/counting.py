"""What a MoE layer call would cost on a GPU, counted on this CPU (:mod:`specmd.counting`): per MoE layer call
(inside the MoE blocks: router, hook, experts, shared experts), device aten ops, kernels (device ops that
are not views), host ops and device-to-host synchronisations, for the unhooked model, the hooked stack
(``execution=simulated``) and the offloaded one (``execution.kernel=grouped``, what runs on CUDA; the last row
the CPU's looped kernel), on the tiny families and deep_olmoe. A greedy generation: a prefill of 16 tokens
and 8 decode steps; then the same at batch 8 (``B=8`` rows: prompts of 9..16 tokens, left-padded, so the hook
finds the live rows of every call; the deltas against the unhooked model at batch 8).

    python benchmarks/counting.py [--models olmoe mixtral ... deep_olmoe | any derived family] [--batch 8]

Targets (issue 35; at B=8, issue 44): syncs per MoE layer call <= 1 on the hooked and the offload paths;
device ops on the offload path <= the unhooked block's + 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (tests.conftest)

GPU = {"name": "offload", "throttle": False, "kernel": "grouped"}  # the kernel offload runs on CUDA
CASES = [  # (label, execution, capacity, prefetch, miss)
    ("hooked (simulated) 100%", {"name": "simulated"}, 1.0, "none", "fetch"),
    ("offload 100%", GPU, 1.0, "none", "fetch"),
    ("offload 5%", GPU, 0.05, "none", "fetch"),
    ("offload 5% + topk", GPU, 0.05, "topk", "fetch"),
    ("offload 5% + topk, looped", dict(GPU, kernel="looped"), 0.05, "topk", "fetch"),  # the CPU's kernel, for contrast
    # miss=hybrid with the host's share inline (counted: a worker thread's ops are not -- the counting modes are
    # per thread; on CUDA the worker adds one copy of the host's rows each way, on its own thread)
    ("offload 5% + topk, hybrid", dict(GPU, host_compute="inline"), 0.05, "topk", "hybrid"),
]


def load(name: str):
    if name == "deep_olmoe":
        from specmd.models.loader import ModelConfig, load_model

        return load_model(ModelConfig(name="deep_olmoe", family="olmoe", pretrained="specmd:deep-olmoe",
                                      dtype="float32"))[0], "olmoe"
    from tests.conftest import tiny

    return tiny(name), name


BATCHED = [case for case in CASES if case[0] in ("hooked (simulated) 100%", "offload 100%", "offload 5% + topk")]


def prompts(batch: int) -> tuple:
    """``batch`` prompts of 16 tokens (batch 1), or of 9..16 tokens left-padded to 16: ids and mask [B, 16]."""
    ids = torch.randint(1, 200, (batch, 16), generator=torch.Generator().manual_seed(0))
    if batch == 1:
        return ids, None
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = b % 8  # 0..7 pads
        ids[b, :pad] = 0
        mask[b, :pad] = 0
    return ids, mask


def measure(model, family: str, spec, batch: int = 1) -> tuple:
    from specmd.hook.counting import count_generation
    from specmd.models.adapters import adapter_for

    ids, mask = prompts(batch)
    c = count_generation(model, adapter_for(family), spec, ids, 8, mask)
    return c.per_call(), c


def main(argv: list) -> int:
    from tests.conftest import FAMILIES

    from specmd.cli.script import ArgumentParser, choice_of, whole

    from specmd.models.adapters import derived_families

    models = FAMILIES + ["deep_olmoe"]  # the default; any derived family (its tiny instance) on request
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=models,
                    type=choice_of(models + list(derived_families()), "--models"))
    ap.add_argument("--batch", type=whole(0), default=8, help="the batched rows' batch (0: none)")
    a = ap.parse_args(argv)
    print(f"per MoE layer call: device ops / kernels / host ops / syncs (delta vs unhooked: ops, kernels); "
          f"torch {torch.__version__}")
    print(f"{'model':12} {'path':26} {'dev ops':>7} {'kernels':>7} {'host':>6} {'syncs':>5} {'+ops':>6} {'+kern':>6}")
    for name in a.models:
        model, family = load(name)
        base, _ = measure(model, family, None)
        print(f"{name:12} {'unhooked':26} {base['device_ops']:7.1f} {base['kernels']:7.1f} {base['host_ops']:6.1f} "
              f"{base['syncs']:5.2f}")
        for label, execution, cap, prefetch, miss in CASES:
            row(name, label, model, family, base, execution, cap, prefetch, miss)
        if a.batch > 1:
            bbase, _ = measure(model, family, None, a.batch)
            print(f"{name:12} {f'unhooked B={a.batch}':26} {bbase['device_ops']:7.1f} {bbase['kernels']:7.1f} "
                  f"{bbase['host_ops']:6.1f} {bbase['syncs']:5.2f}")
            for label, execution, cap, prefetch, miss in BATCHED:
                row(name, f"{label} B={a.batch}", model, family, bbase, execution, cap, prefetch, miss, a.batch)
    return 0


def row(name, label, model, family, base, execution, cap, prefetch, miss, batch=1) -> None:
    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig

    spec = spec_of(prefetch=prefetch, miss=miss, hardware=HardwareConfig(capacity=cap))
    spec.execution = EXECUTION.params(execution)
    got, c = measure(model, family, spec, batch)
    print(f"{name:12} {label:26} {got['device_ops']:7.1f} {got['kernels']:7.1f} {got['host_ops']:6.1f} "
          f"{got['syncs']:5.2f} {got['device_ops'] - base['device_ops']:+6.1f} "
          f"{got['kernels'] - base['kernels']:+6.1f}", flush=True)


if __name__ == "__main__":
    from specmd.cli.script import run

    run("benchmarks/counting.py", main)
