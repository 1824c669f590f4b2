"""Hybrid misses against fetch-only and host-only at 5%, simulated and measured (``execution=offload``), on a
calibrated profile: deep_olmoe and a Qwen1.5-MoE-shaped 2-layer model (the real one's hidden size, 60 experts
of 1408, top-4, shared expert; random weights, float32, 4.3 GB).

    specmd calibrate --out /tmp/cal --name cal
    python benchmarks/hybrid.py --profile /tmp/cal/hardware/cal.yaml

Per model, the host's expert costs are measured on that model's own experts (``measure_host_experts``, as
``specmd calibrate --model`` does for the model it is given), then for miss = fetch, cpu_compute, hybrid (lru,
topk prefetch, capacity 5%): a 64-token prompt and 24 greedy decodes, after a warm-up generation. Prints the
simulated and measured decode tokens/s, measured / simulated TTFT and TPOT, where the misses went, and
hybrid's margin over the better of the other two in both clocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from specmd.cli import script

ROOT = Path(__file__).resolve().parent.parent
MISSES = ("fetch", "cpu_compute", "hybrid")


def qwen_shaped():
    """The Qwen1.5-MoE-A2.7B shape at 2 layers: the shipped random-weight model config ``qwen2_moe_shaped``."""
    from specmd.models.loader import load_configured

    return load_configured("qwen2_moe_shaped")[0], None


def deep_olmoe():
    from specmd.models.loader import load_configured
    from specmd.models.loader import local_checkpoint

    model, cfg = load_configured("deep_olmoe")
    return model, local_checkpoint(cfg.pretrained)


def run(model, ckpt, hw: dict, miss: str, prompt: int, tokens: int) -> dict:
    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    spec = spec_of(hardware=HardwareConfig(**{**hw, "capacity": 0.05}), prefetch="topk", miss=miss)
    spec.execution = EXECUTION.params({"name": "offload", "throttle": True})
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(3))
    out = {}
    for warm in (True, False):
        st = install(model, spec, checkpoint=ckpt)
        try:
            with torch.no_grad():
                model.generate(ids[:, :16] if warm else ids, max_new_tokens=tokens, min_new_tokens=tokens,
                               do_sample=False, pad_token_id=0)
            out = {**st.engine.results(), **st.executor.results()}
        finally:
            st.remove()
    return out


def profile_file(value: str) -> str:
    """``--profile``: a hardware profile file that exists and reads as a mapping."""
    import argparse

    try:
        prof = yaml.safe_load(Path(value).read_text())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{value}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{value}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(prof, dict):
        raise argparse.ArgumentTypeError(f"{value}: not a hardware profile (a mapping; specmd calibrate writes one)")
    return value


def main(argv: list) -> int:
    ap = script.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, type=profile_file,
                    help="a calibrated hardware profile (specmd calibrate)")
    ap.add_argument("--models", nargs="*", default=["deep_olmoe", "qwen_shaped"],
                    type=script.choice_of(["deep_olmoe", "qwen_shaped"], "--models"))
    ap.add_argument("--prompt", type=script.whole(1), default=64)
    ap.add_argument("--tokens", type=script.whole(2), default=24)
    ap.add_argument("--out", type=script.out_file, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    from specmd.commands.calibrate.measure import measure_host_experts
    from specmd.executor.base import steady_host_allocator

    steady_host_allocator()
    prof = yaml.safe_load(Path(a.profile).read_text())
    prof.pop("name", None)
    results = {}
    for name in a.models:
        model, ckpt = {"deep_olmoe": deep_olmoe, "qwen_shaped": qwen_shaped}[name]()
        family = "olmoe" if name == "deep_olmoe" else "qwen2_moe"
        host, _ = measure_host_experts(model, family, prof, torch.device("cpu"))
        hw = {**prof, **host}
        print(f"{name}: host costs on its own experts: " + ", ".join(f"{k} {v:.3g}" for k, v in host.items()),
              flush=True)
        rows = {}
        for miss in MISSES:
            r = run(model, ckpt, hw, miss, a.prompt, a.tokens)
            t, w, o = r["timing"], r["wall"], r["cache"]["miss_outcomes"]
            rows[miss] = {"sim_tok_s": t["decode_tokens_per_s"], "wall_tok_s": w["decode_tokens_per_s"],
                          "ttft_ratio": w["ttft_s"] / t["ttft_s"], "tpot_ratio": w["tpot_s"] / t["tpot_s"],
                          "fetched": o.get("fetched_native", 0), "host": o["host_computed"],
                          "hit_rate": r["cache"]["hit_rate"], "fetch_bound_tok_s": t.get("fetch_bound_tokens_per_s"),
                          "host_busy_s": t["host_busy_s"], "link_busy_s": t["link_busy_s"], "wall_host_s": w["host_s"]}
            x = rows[miss]
            print(f"  {miss:12s} decode tok/s simulated {x['sim_tok_s']:8.2f} measured {x['wall_tok_s']:8.2f} | "
                  f"measured/simulated TTFT {x['ttft_ratio']:.2f} TPOT {x['tpot_ratio']:.2f} | fetched {x['fetched']}, "
                  f"host {x['host']}, hit rate {x['hit_rate']:.3f}", flush=True)
        for clock in ("sim", "wall"):
            other = max(rows[m][f"{clock}_tok_s"] for m in MISSES if m != "hybrid")
            margin = rows["hybrid"][f"{clock}_tok_s"] / other - 1
            print(f"  hybrid vs the better of fetch and cpu_compute ({'simulated' if clock == 'sim' else 'measured'}):"
                  f" {margin:+.1%}")
            rows[f"hybrid_margin_{clock}"] = margin
        results[name] = rows
        del model
    if a.out:
        from specmd.results import write_text_atomic

        write_text_atomic(a.out, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    script.run("benchmarks/hybrid.py", main)
