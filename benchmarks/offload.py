"""Real expert offloading (``execution=offload``), measured: is the simulated clock right, is the mechanism
fast, and does a model larger than this machine's memory run?

    python benchmarks/offload.py                    # all three parts on this machine (CPU)
    python benchmarks/offload.py --device cuda      # a GPU user's check of the CUDA path (never run in CI)
    python benchmarks/offload.py --skip-large       # parts 1 and 2 only

1. **Simulated vs measured.** ``specmd calibrate`` (into a temporary config dir, or ``--profile NAME``)
   fits this machine; then each stack -- the lossless ones, the headline stack's policies at native
   precision (``eviction=least_stale prefetch=score``) and the headline stack itself (``miss=fetch_priority``:
   HQQ copies, moved as their packed bytes and unpacked when they run) -- runs a greedy generation on the embedded models under ``execution=offload`` with
   a profile calibrated on that model (policy decision costs depend on the geometry; ``--profile P`` uses
   one profile for every model). Table: TTFT and
   TPOT simulated, the median of 3 measured generations, measured/simulated (target: within ±15%).
2. **The mechanism.** Throttling off: the transfer path alone (every expert fetched through the executor's
   tier, channel and slots, nothing else running) beside the copy bandwidth ``calibrate`` measured for host
   memory (target >= 80%), on deep_olmoe's 49 kB experts and on Qwen1.5-MoE's 17.3 MB ones (a 2-layer
   random checkpoint, written once under specmd's cache dir); the same during a generation, where the copies
   share the cores and the memory bus with the model's compute; capacity 1.0 (every expert resident after
   warm-up): offload's wall time over simulated's (target <= 1.10x); with prefetching: the measured stall
   beside the sum of transfer times (prefetches overlap compute when the stall is smaller).
3. **Larger than memory.** A random-weight Qwen1.5-MoE-A2.7B (28.6 GB in bf16, from
   ``specmd/assets/configs/qwen2_moe.json``) is written once under specmd's cache dir; it cannot load
   resident here (more than this machine's RAM: not attempted, the kernel would kill it), and runs offloaded
   from disk at 5% and 25% capacity, each in its own process: peak RSS, arena bytes, tokens/s measured and
   simulated, bytes read; target: peak RSS below dense weights + arena + 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from specmd.cli import script
from specmd.shipped import options

ROOT = Path(__file__).resolve().parent.parent
STACKS = {
    "lossless: lru, no prefetch": dict(prefetch="none"),
    "lossless: lru + topk prefetch (default)": dict(),
    "least_stale + score prefetch (native)": dict(eviction="least_stale", prefetch="score"),
    "headline: + miss=fetch_priority (HQQ copies)": dict(eviction="least_stale", prefetch="score", miss="fetch_priority",
                                                         quant={"name": "hqq", "precisions": ["int8", "int4", "int2"]}),
}


def generate(model_name: str, stack: dict, hw: dict, execution: dict, device: str, prompt: int, new_tokens: int,
             load_experts: bool = True, installed=None) -> dict:
    """One greedy generation through the policy stack; returns results sections + wall + memory. With
    ``installed``, ``installed(stack)`` runs instead of the generation and its value is returned."""
    from omegaconf import OmegaConf

    from specmd import CONF_DIR
    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig
    from specmd.hook import install
    from specmd.models.loader import ModelConfig, load_model, local_checkpoint
    from specmd.registry import build_params

    if model_name.startswith("/"):
        mcfg = ModelConfig(name="bench", family=json.loads((Path(model_name) / "config.json").read_text())["model_type"],
                           pretrained=model_name, dtype="bfloat16", tokenizer=None)
    else:
        mcfg = build_params(ModelConfig, dict(OmegaConf.to_container(
            OmegaConf.load(Path(CONF_DIR) / "model" / f"{model_name}.yaml"))), "model")
    t0 = time.perf_counter()
    if mcfg.tokenizer is None and model_name.startswith("/"):
        from specmd.models.loader import load_dense

        model = load_dense(mcfg.pretrained, mcfg) if not load_experts else load_model(mcfg)[0]
    else:
        model = load_model(mcfg, experts_on_meta=not load_experts)[0]
    t_load = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(model.config.vocab_size, 250), (1, prompt), generator=g)
    if load_experts:  # the process's first forward pass pays one-time costs (kernel selection): not TTFT's
        with torch.no_grad():
            model(ids)  # the prompt's own shapes: kernels chosen for them are not TTFT's
    spec = spec_of(hardware=HardwareConfig(**hw), **stack)
    spec.execution = EXECUTION.params(execution)
    on_device = spec.execution[0].device_experts
    if on_device:
        model.to(device)
    st = install(model, spec, device=device, checkpoint=local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None)
    if not on_device:
        model.to(device)
    ids = ids.to(device)
    if installed is not None:
        try:
            return installed(st)
        finally:
            st.remove()
    with torch.no_grad():
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        t_gen = time.perf_counter() - t1
    st.remove()
    res = st.engine.results()
    res.update(st.executor.results())
    res["tokens"] = out[0, prompt:].tolist()
    res["load_s"], res["generate_s"] = t_load, t_gen
    res["dense_bytes"] = st.dense_bytes
    return res


def _ratio(a, b):
    return a / b if a and b else float("nan")


def part1(profiles: dict, device: str, reps: int = 3) -> None:
    """``profiles[model]``: the hardware profile to run ``model`` with."""
    print(f"\n## 1. Simulated vs measured (calibrated profile, execution=offload host=ram, throttled to the profile; "
          f"measured: median of {reps} generations, each in a fresh install)")
    print(f"{'model':12} {'stack':42} {'TTFT sim ms':>11} {'meas ms':>8} {'ratio':>6} {'TPOT sim ms':>11} "
          f"{'meas ms':>8} {'ratio':>6}")
    for model, profile_hw in profiles.items():
        for name, stack in STACKS.items():
            runs = [generate(model, stack, profile_hw, {"name": "offload"}, device, 48, 24) for _ in range(reps)]
            t = runs[0]["timing"]  # simulated: the same every run
            ttft = statistics.median(r["wall"]["ttft_s"] for r in runs)
            tpot = statistics.median(r["wall"]["tpot_s"] for r in runs)
            print(f"{model:12} {name:42} {t['ttft_s'] * 1e3:11.2f} {ttft * 1e3:8.2f} "
                  f"{_ratio(ttft, t['ttft_s']):6.2f} {t['tpot_s'] * 1e3:11.2f} {tpot * 1e3:8.2f} "
                  f"{_ratio(tpot, t['tpot_s']):6.2f}", flush=True)


def path_alone(st, rounds: int = 3) -> tuple[float, float, int]:
    """The transfer path with nothing else running: every expert of every layer fetched through the
    executor's own tier, channel and arena slots, ``rounds`` times, two ways: as demand fetches (one job per
    layer call, what :meth:`Placement.flush` submits) and as prefetches (one job per expert, queued back to
    back); returns (GB/s demand, GB/s prefetch, bytes of one expert), each from the first submit to the last
    arrival of the best round."""
    from functools import partial

    ex = st.executor
    place, mover = ex.placement, ex.mover
    arena = place.pools[0]
    slots = [arena.views(s) for s in range(arena.n)]
    L, E, nbytes = len(st.moe_ids), place.E, place.slot_bytes
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        t0 = time.perf_counter()
        tickets = [mover.submit(partial(place.tier.copy_many, [(layer, e, slots[(layer * E + e) % len(slots)])
                                                               for e in range(E)], ex._name),
                                nbytes * E, True, f"layer {layer}", E) for layer in range(L)]
        for t in tickets:
            mover.wait(t)
        mover.sync()
        best[0] = min(best[0], time.perf_counter() - t0)
        t0 = time.perf_counter()
        tickets = [mover.submit(partial(place.tier.copy_into, layer, e, slots[(layer * E + e) % len(slots)]),
                                nbytes, False) for layer in range(L) for e in range(E)]
        for t in tickets:
            mover.wait(t)
        mover.sync()
        best[1] = min(best[1], time.perf_counter() - t0)
    total = L * E * nbytes / 1e9
    return total / best[0], total / best[1], nbytes


def qwen_layers(n: int = 2) -> str:
    """A random-weight Qwen1.5-MoE-A2.7B with its first ``n`` decoder layers only: its real 17.3 MB experts
    (bf16) in a model that fits in memory with every expert loaded (the ``ram`` tier)."""
    from specmd.models.loader import SHIPPED_CONFIGS
    from specmd.models.random_checkpoint import checkpoints_dir, write_random_checkpoint

    cfg = dict(json.loads((SHIPPED_CONFIGS / "qwen2_moe.json").read_text()), num_hidden_layers=n)
    return str(write_random_checkpoint(cfg, checkpoints_dir() / f"qwen2_moe-{n}layers-random-bf16"))


def part2(profile_hw: dict, copy_gbps: float, latency_s: float, device: str, large: bool = True) -> None:
    print(f"\n## 2. The mechanism (throttling off; calibrate's host copy: {copy_gbps:.3g} GB/s + {latency_s * 1e6:.3g} us "
          f"per transfer)")
    fast = {"name": "offload", "throttle": False}
    models = [("deep_olmoe", 48, 32)] + ([(qwen_layers(), 16, 8)] if large else [])
    for model, prompt, tokens in models:
        label = "deep_olmoe" if model == "deep_olmoe" else "Qwen1.5-MoE, 2 layers"
        for cap in (0.05, 1.0):  # the arena: small (as the runs above; cache-resident on a CPU) and all experts
            gbps, pre_gbps, nbytes = generate(model, {"prefetch": "none"}, dict(profile_hw, capacity=cap), fast,
                                              device, 8, 1, installed=path_alone)
            model_gbps = nbytes / (latency_s + nbytes / (copy_gbps * 1e9)) / 1e9  # calibrate's link at this size
            print(f"{label}: the transfer path alone, {nbytes / 1e6:.3g} MB experts into a {cap:.0%} arena: demand "
                  f"fetches (a job per layer call) {gbps:.3g} GB/s -> {gbps / copy_gbps:.0%} of calibrate's bandwidth; "
                  f"prefetches (a job per expert) {pre_gbps:.3g} GB/s -> {pre_gbps / copy_gbps:.0%}, "
                  f"{pre_gbps / model_gbps:.0%} of its link at this size ({model_gbps:.3g} GB/s: latency + bytes / "
                  f"bandwidth)")
        r = generate(model, {"prefetch": "topk"}, dict(profile_hw, capacity=0.05), fast, device, prompt, tokens)
        w = r["wall"]
        print(f"{label}: during a generation at capacity 5% (the model computing beside it): {w['copy_gbps']:.3g} "
              f"GB/s in the copies ({w['transfers']} transfers), {w['achieved_gbps']:.3g} GB/s channel busy -> "
              f"{w['copy_gbps'] / copy_gbps:.0%}")
    full_residency(profile_hw, device)
    r = generate("deep_olmoe", {"prefetch": "topk"}, dict(profile_hw, capacity=0.25), {"name": "offload"}, device, 48, 32)
    w = r["wall"]
    print(f"prefetch=topk at 25%: measured stall {w['stall_s'] * 1e3:.4g} ms vs transfer time {w['transfer_s'] * 1e3:.4g} ms "
          f"({w['transfers']} transfers) -> prefetches {'overlap' if w['stall_s'] < w['transfer_s'] else 'do NOT overlap'} compute")


def full_residency(profile_hw: dict, device: str, reps: int = 3) -> None:
    """Offload's own cost: capacity 1.0 (every expert resident after warm-up), best of ``reps`` generations of
    each executor, alternated (target: offload <= 1.10x simulated)."""
    full = dict(profile_hw, capacity=1.0)
    sim, off = [], []
    for _ in range(reps):
        sim.append(generate("deep_olmoe", {"prefetch": "none"}, full, {"name": "simulated"}, device, 48, 32)
                   ["generate_s"])
        off.append(generate("deep_olmoe", {"prefetch": "none"}, full, {"name": "offload", "throttle": False}, device,
                            48, 32)["generate_s"])
    print(f"capacity 1.0 (all resident after warm-up): simulated {min(sim):.3f} s, offload {min(off):.3f} s -> "
          f"{min(off) / min(sim):.3f}x (best of {reps})")


def part3(device: str, tokens: int) -> None:
    from specmd.models.loader import shipped_geometry
    from specmd.models.random_checkpoint import checkpoints_dir, write_random_checkpoint

    print("\n## 3. Larger than memory: Qwen1.5-MoE-A2.7B-shaped, random weights, bf16, experts read from disk")
    g = shipped_geometry("qwen2_moe")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = checkpoints_dir() / "qwen2_moe-random-bf16"
    t0 = time.perf_counter()
    write_random_checkpoint("qwen2_moe", out)
    print(f"checkpoint {out} ({g.total_bytes / 1e9:.1f} GB; ready in {time.perf_counter() - t0:.0f} s)")
    print(f"resident: {g.total_bytes / 1e9:.1f} GB of weights > {ram / 1e9:.1f} GB of RAM on this machine: cannot load "
          f"(not attempted)")
    print(f"{'capacity':>8} {'peak RSS GB':>11} {'dense GB':>8} {'arena GB':>8} {'bound GB':>8} {'tok/s meas':>10} "
          f"{'tok/s sim':>9} {'read GB':>7} {'RSS ok':>6}")
    for cap in (0.05, 0.25):
        arg = json.dumps({"model": str(out), "capacity": cap, "device": device, "tokens": tokens})
        p = subprocess.run([sys.executable, __file__, "--one", arg], capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            print(f"{cap:8.2f} failed:\n{p.stderr[-3000:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        m, w, t = r["memory"], r["wall"], r["timing"]
        bound = r["dense_bytes"] + m["arena_capacity_bytes"] + 2e9
        print(f"{cap:8.2f} {m['host_peak_rss_bytes'] / 1e9:11.2f} {r['dense_bytes'] / 1e9:8.2f} "
              f"{m['arena_capacity_bytes'] / 1e9:8.2f} {bound / 1e9:8.2f} {w['decode_tokens_per_s'] or 0:10.3g} "
              f"{t['decode_tokens_per_s'] or 0:9.3g} {m['disk_bytes_read'] / 1e9:7.2f} "
              f"{'yes' if m['host_peak_rss_bytes'] < bound else 'NO':>6}", flush=True)


def one(arg: str) -> None:
    a = json.loads(arg)
    from specmd.hardware import HardwareConfig

    hw = dict(vars(HardwareConfig()), capacity=a["capacity"])
    r = generate(a["model"], {"prefetch": "topk"}, hw, {"name": "offload", "host": "disk"}, a["device"], 16,
                 a["tokens"], load_experts=False)
    print(json.dumps({k: r[k] for k in ("memory", "wall", "timing", "dense_bytes", "load_s", "generate_s")}))


def main(argv: list) -> int:
    ap = script.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=script.device, default="cpu")
    ap.add_argument("--profile", help="a hardware profile name already calibrated (default: calibrate now)")
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--tokens", type=script.whole(1), default=8, help="tokens generated by the large model")
    ap.add_argument("--models", nargs="+", default=["tiny", "deep_olmoe"],
                    type=script.choice_of(options("model"), "--models"))
    ap.add_argument("--full-residency", action="store_true",
                    help="only offload's cost at capacity 1.0 against simulated (no calibration)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        one(a.one)
        return 0
    if a.full_residency:
        from specmd.hardware import HardwareConfig

        full_residency(dict(vars(HardwareConfig())), a.device)
        return 0
    if a.device.startswith("cuda"):
        print("note: the CUDA path of execution=offload has not run on a GPU in specmd's CI; these figures are "
              "its first check")
    from specmd.commands.calibrate import calibrate
    from specmd.commands.calibrate.measure import measure_ram_link

    if a.profile:
        from omegaconf import OmegaConf

        from specmd import user_config_dir

        hw = dict(OmegaConf.to_container(OmegaConf.load(Path(user_config_dir()) / "hardware" / f"{a.profile}.yaml")))
        hw.pop("name", None)
        profiles = {m: hw for m in a.models}
    else:  # each model with a profile calibrated on it (policy decision costs depend on the geometry)
        with tempfile.TemporaryDirectory() as d:
            profiles = {m: calibrate(out=d, model=m, device=a.device)["hardware"] for m in a.models}
        hw = profiles[a.models[-1]]
    bw_unpaced, lat_unpaced = measure_ram_link(torch.device(a.device))
    part1(profiles, a.device)
    part2(hw, bw_unpaced / 1e9, lat_unpaced, a.device, large=not a.skip_large)
    if not a.skip_large:
        part3(a.device, a.tokens)
    return 0


if __name__ == "__main__":
    script.run("benchmarks/offload.py", main)
