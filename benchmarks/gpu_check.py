"""The one GPU check a user runs (and a session lent a GPU runs): correctness and speed of the hooked and the
offloaded paths on one device, in one table (and as JSON). About 6 minutes on one H100.

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick          # the same sections at toy sizes (a smoke run)
    python benchmarks/gpu_check.py --stand-in --quick            # ... through the CUDA branches (specmd.accel)

Sections (each reports its own failure and the next one runs):

1. **lossless**: hooked == unhooked logits and greedy tokens, the 8 tiny families (``lossless_check``);
2. **policies**: every policy of every family on the tiny OLMoE (``policy_check``; the oracles need a trace
   and are skipped with a line);
3. **offload == simulated**: deep_olmoe, five stacks (lru; lru + topk; least_stale + score; + HQQ
   ``miss=fetch_priority``; ``miss=cpu_compute``): tokens and hit rates equal, logits bit-equal (where they
   differ the maximum difference is printed: the remapped grouped GEMM may differ from the stock one in the
   last bits on a GPU);
4. **the link**: raw pinned host-to-device bandwidth (the PCIe bound's denominator);
5. **syncs and launches**: torch.profiler over 8 decode tokens of deep_olmoe at 5% (offload, lru + topk):
   per MoE layer call, kernel launches, ``cudaStreamSynchronize``/``cudaEventSynchronize``/
   ``cudaDeviceSynchronize`` and device-to-host copies (the CPU proxy, ``specmd.counting``, says 1 sync);
6. **decode at the link**: deep_olmoe and a Qwen1.5-MoE-A2.7B-shaped random bf16 model (28.6 GB, built in
   memory: ``--quick`` uses 2 layers) offloaded from pinned RAM, throttle off, prefetch topk, at 5% and 25%:
   TTFT, decode tok/s, bytes moved per token, and **% of the PCIe bound** for the bytes moved (link time of
   those bytes / measured time: 100% = the link never idles);
7. **ratios**: hooked / unhooked decode (lru, no prefetch, capacity 1.0) and offload at capacity 1.0 /
   simulated, on both models;
8. **calibrate**: ``specmd calibrate`` on the device, timed (target <= 90 s), with its own check;
   then **fidelity**: ``specmd fidelity --quick``'s grid on that profile (median and p90 |measured /
   simulated - 1| of TTFT and TPOT, the noise, the miss policies' ranking);
9. **hybrid**: on both models at 5% with the calibrated profile, ``fetch``, ``cpu_compute`` and ``hybrid``
   against the all-fetch bound (every requested expert fetched over this link, hit rate 0: 31 tok/s for the
   Qwen-shaped model on PCIe gen5) and the bound at the run's own misses per token (which no fetch-only stack
   passes) -- target: hybrid above them -- and the calibrated clock's measured / simulated TTFT and TPOT
   (target within +-15%).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (tests.conftest)
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS: list = []  # (section, item, value, note)
RESULT: dict = {}


def row(section: str, item: str, value, note: str = "") -> None:
    ROWS.append((section, item, value, note))
    print(f"[{section}] {item}: {value}{'  (' + note + ')' if note else ''}", flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1, 2: lossless and the policies --------------------------------------------------------------------------
def lossless(device: str, quick: bool) -> None:
    from tests.conftest import FAMILIES, make_stack

    from specmd.models.loader import build_tiny

    ok = 0
    for family in FAMILIES:
        model = build_tiny(family).to(device)
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.no_grad():
            ref, gref = model(ids).logits, model.generate(ids[:1, :16], max_new_tokens=8, do_sample=False)
            with make_stack(model, family, capacity=0.05):
                out, gout = model(ids).logits, model.generate(ids[:1, :16], max_new_tokens=8, do_sample=False)
        same = torch.equal(out, ref) and torch.equal(gout, gref)
        ok += same
        if not same:
            row("lossless", family, "DIFFERS", f"max|diff| {float((out - ref).abs().max()):.3g}")
    row("lossless", "hooked == unhooked", f"{ok}/{len(FAMILIES)}")
    RESULT["lossless"] = f"{ok}/{len(FAMILIES)}"


def policies(device: str, quick: bool) -> None:
    import policy_check

    good, bad, skipped = policy_check.run(device, "olmoe", 0.1, quiet=True)
    row("policies", "stacks ok", f"{good}/{good + len(bad)}", f"skipped (need a trace): {', '.join(skipped)}")
    for name in bad:
        row("policies", name, "FAILED")
    RESULT["policies"] = {"ok": good, "failed": bad, "skipped": skipped}


# ---- 3: offload == simulated ----------------------------------------------------------------------------------
PARITY = {
    "lru": dict(prefetch="none"),
    "lru + topk": dict(),
    "least_stale + score": dict(eviction="least_stale", prefetch="score"),
    "+ fetch_priority (HQQ int8/4/2)": dict(eviction="least_stale", prefetch="score", miss="fetch_priority",
                                            quant={"name": "hqq", "optimize": False,
                                                   "precisions": ["int8", "int4", "int2"]}),
    "cpu_compute": dict(miss="cpu_compute"),
    "hybrid": dict(miss="hybrid"),  # on CUDA the host's experts run on the CPU: its bits, not the GPU's
}


def run_stack(model, spec, ids, prefill, device, new_tokens=6):
    from specmd.hook import install

    with torch.no_grad():
        st = install(model, spec, device=device)
        if not st.executor.device_experts:
            model.to(device)
        try:
            tokens = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            logits = model(prefill).logits
            res = st.engine.results()
            res.update(st.executor.results())
        finally:
            st.remove()
    return tokens, logits, res


def spec_for(stack: dict, capacity: float, execution: dict, hw: dict | None = None):
    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig

    spec = spec_of(hardware=HardwareConfig(**{**(hw or {}), "capacity": capacity}), **stack)
    spec.execution = EXECUTION.params(execution)
    return spec


def deep_olmoe(device: str):
    from specmd.models.loader import ModelConfig, load_model

    model, _ = load_model(ModelConfig(name="deep_olmoe", family="olmoe", pretrained="specmd:deep-olmoe",
                                      dtype="float32"))
    return model.to(device)


def parity(device: str, quick: bool) -> None:
    model = deep_olmoe(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g).to(device)
    prefill = torch.randint(0, model.config.vocab_size, (1, 24), generator=g).to(device)
    out = {}
    for name, stack in PARITY.items():
        sim = run_stack(model, spec_for(stack, 0.05, {"name": "simulated"}), ids, prefill, device)
        model.to(device)
        # (at the simulated run's compute threads: a CPU GEMM's last bits depend on its thread count, and
        # execution.threads=auto keeps a core for the copy thread; on CUDA they set only the host side; the
        # host lane's too, where it is a thread of its own: on CUDA and its stand-in)
        n = torch.get_num_threads()
        off = run_stack(model, spec_for(stack, 0.05, {"name": "offload", "throttle": False, "threads": n,
                                                      "host_threads": n}), ids, prefill, device)
        model.to(device)
        tokens = torch.equal(sim[0], off[0])
        hits = sim[2]["cache"]["hit_rate"] == off[2]["cache"]["hit_rate"]
        bits = torch.equal(sim[1], off[1])
        diff = float((sim[1] - off[1]).abs().max())
        out[name] = {"tokens": tokens, "hit_rate": hits, "logits_bit_equal": bits, "max_diff": diff}
        row("offload == simulated", name, "equal" if tokens and hits else "DIFFERS",
            f"tokens {tokens}, hit rate {hits}, logits bit-equal {bits}" + ("" if bits else f" (max|diff| {diff:.3g})"))
    RESULT["parity"] = out


# ---- 4: the link ---------------------------------------------------------------------------------------------
def link(device: str, quick: bool) -> float:
    n = (64 if quick else 512) << 20
    dev = torch.device(device)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    gbps = n / best / 1e9
    row("link", "pinned host -> device", f"{gbps:.1f} GB/s", f"best of 5 copies of {n >> 20} MiB")
    RESULT["link_gbps"] = gbps
    return gbps


# ---- 5: syncs and launches (torch.profiler) -------------------------------------------------------------------
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def profile(device: str, quick: bool) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from specmd.hook import install

    model = deep_olmoe("cpu")
    st = install(model, spec_for({}, 0.05, {"name": "offload", "throttle": False}), device=device)
    model.to(device)
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
            past = model(ids, use_cache=True).past_key_values
            nxt = ids[:, -1:]
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
            calls0 = st.engine.calls
            steps = 2 if quick else 8
            log0 = len(_standin_log())
            with prof(activities=activities) as p:
                for _ in range(steps):
                    out = model(nxt, past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                sync(device)
            calls = st.engine.calls - calls0
            log = _standin_log()[log0:]
    finally:
        st.remove()
    counts = {}
    for e in p.key_averages():
        counts[e.key] = counts.get(e.key, 0) + e.count
    launches = sum(v for k, v in counts.items() if k in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    syncs = {k: counts.get(k, 0) for k in SYNC_EVENTS}
    d2h = counts.get("cudaMemcpyAsync", 0)
    per = {k: v / max(calls, 1) for k, v in syncs.items()}
    row("syncs", "per MoE layer call", ", ".join(f"{k} {v:.2f}" for k, v in per.items()) or "(no CUDA)",
        f"{calls} layer calls ({steps} decode tokens at 5%, offload, lru + topk); the 2 per pass of the wall clock included")
    row("syncs", "kernel launches per MoE layer call", f"{launches / max(calls, 1):.1f}",
        f"cudaMemcpyAsync {d2h / max(calls, 1):.1f} per call; aten::mm {counts.get('aten::mm', 0) / max(calls, 1):.1f}, "
        f"grouped {counts.get('aten::_grouped_mm', 0) / max(calls, 1):.1f}")
    RESULT["profile"] = {"calls": calls, "syncs_per_call": per, "launches_per_call": launches / max(calls, 1),
                         "memcpy_per_call": d2h / max(calls, 1)}
    if log:  # the CUDA stand-in's own log of the same steps (what torch.profiler counts on a GPU)
        n = {k: sum(1 for e in log if (e[0], e[1] if e[0] == "sync" else None) == k) / max(calls, 1)
             for k in (("sync", "event"), ("sync", "device"), ("sync", "stream"), ("copy", None), ("wait", None))}
        row("syncs", "stand-in log per MoE layer call",
            f"event synchronize {n['sync', 'event']:.2f}, device synchronize {n['sync', 'device']:.2f}",
            f"stream synchronize {n['sync', 'stream']:.2f}; side-stream copies {n['copy', None]:.1f}, stream waits "
            f"{n['wait', None]:.1f}")
        RESULT["profile"]["standin_per_call"] = {" ".join(x for x in k if x): v for k, v in n.items()}


def _standin_log() -> list:
    """The CUDA stand-in's log (``--stand-in``), else empty."""
    from specmd.accel import standin, standin_active

    return standin().log if standin_active() else []


# ---- 6, 7: decode at the link, and the ratios ------------------------------------------------------------------
def random_model(config: dict, dtype=torch.bfloat16):
    """A model of ``config`` with random weights, built in host memory without a checkpoint (uniform in
    +-0.02: values do not matter for speed, only that they are finite)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    # one block of random values tiled over every parameter: a generator fills 28.6 GB of bf16 in 122 s on an
    # H200's host (16 cores), a copy in seconds; the values need only be finite and unlike zeros
    pool = torch.empty(1 << 24, dtype=dtype).uniform_(-0.02, 0.02, generator=g)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            for o in range(0, flat.numel(), pool.numel()):
                m = min(pool.numel(), flat.numel() - o)
                flat[o:o + m].copy_(pool[:m])
        for b in model.buffers():
            if b.is_floating_point() and not torch.isfinite(b).all():
                b.zero_()
    model.eval()
    for name, mod in list(model.named_modules()):  # buffers computed at construction (rope): built again
        if "RotaryEmbedding" in type(mod).__name__:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=model.config))
    return model


def qwen_config(quick: bool) -> dict:
    from specmd.models.loader import SHIPPED_CONFIGS

    cfg = {k: v for k, v in json.loads((SHIPPED_CONFIGS / "qwen2_moe.json").read_text()).items()
           if not k.startswith("_")}
    if quick:  # a toy of the same shape family: 2 layers, a small vocabulary, quarter-size experts
        cfg.update(num_hidden_layers=2, vocab_size=4096, moe_intermediate_size=cfg["moe_intermediate_size"] // 4)
    return cfg


def timed_generation(model, spec, device, prompt: int, tokens: int):
    """(TTFT s, TPOT s, results) of a greedy generation through ``spec`` (the executor's own wall clock)."""
    from specmd.hook import install

    st = install(model, spec, device=device) if spec is not None else None
    model.to(device)
    ids = torch.randint(0, 1000, (1, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    try:
        with torch.no_grad():
            model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # warm-up (kernels chosen)
            if st is None:
                sync(device)
                t0 = time.perf_counter()
                model(ids)
                sync(device)
                ttft = time.perf_counter() - t0
                sync(device)
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
                sync(device)
                return ttft, (time.perf_counter() - t0 - ttft) / (tokens - 1), None
            ex = st.executor
            for log in (ex.pass_kinds, ex.pass_wall, ex.pass_tokens, ex.pass_stall, ex.pass_bytes):
                log.clear()  # the warm-up's passes are not the measurement's
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            res = st.engine.results()
            res.update(st.executor.results())
    finally:
        if st is not None:
            st.remove()
    w = res["wall"]
    return w["ttft_s"], w["tpot_s"], res


def at_the_link(name: str, model, device: str, gbps: float, quick: bool) -> None:
    tokens = 3 if quick else 16
    for cap in (0.05, 0.25):
        spec = spec_for({}, cap, {"name": "offload", "throttle": False})
        ttft, tpot, res = timed_generation(model, spec, device, 16, tokens)
        w = res["wall"]
        dec_bytes, pre_bytes = w["decode_bytes_moved_per_token"] or 0, w["prefill_bytes_moved"] or 0
        link_tpot, link_ttft = dec_bytes / (gbps * 1e9), pre_bytes / (gbps * 1e9)
        row("decode at the link", f"{name} {cap:.0%}",
            f"{1 / tpot:.2f} tok/s, {link_tpot / tpot:.0%} of the PCIe bound",
            f"TPOT {tpot * 1e3:.1f} ms for {dec_bytes / 1e6:.1f} MB/token (link: {link_tpot * 1e3:.1f} ms); TTFT "
            f"{ttft * 1e3:.0f} ms, {link_ttft / ttft:.0%} of its link bound ({pre_bytes / 1e9:.2f} GB); hit rate "
            f"{res['cache']['hit_rate']:.3f}; stalled {w['stall_s'] * 1e3:.0f} ms")
        RESULT.setdefault("decode", {})[f"{name} {cap}"] = {
            "tok_s": 1 / tpot, "tpot_s": tpot, "ttft_s": ttft, "decode_bytes_per_token": dec_bytes,
            "prefill_bytes": pre_bytes, "pcie_bound_fraction": link_tpot / tpot,
            "ttft_link_fraction": link_ttft / ttft, "hit_rate": res["cache"]["hit_rate"],
            "stall_s": w["stall_s"]}


def ratios(name: str, model, device: str, quick: bool) -> None:
    tokens = 3 if quick else 16
    _, base, _ = timed_generation(model, None, device, 16, tokens)
    _, hooked, _ = timed_generation(model, spec_for({"prefetch": "none"}, 1.0, {"name": "simulated"}), device, 16,
                                    tokens)
    _, off, _ = timed_generation(model, spec_for({"prefetch": "none"}, 1.0, {"name": "offload", "throttle": False}),
                                 device, 16, tokens)
    row("ratios", f"{name}: hooked / unhooked decode", f"{hooked / base:.3f}",
        f"{base * 1e3:.1f} -> {hooked * 1e3:.1f} ms/token (lru, no prefetch, capacity 1.0)")
    row("ratios", f"{name}: offload 100% / simulated decode", f"{off / hooked:.3f}", f"{off * 1e3:.1f} ms/token")
    RESULT.setdefault("ratios", {})[name] = {"unhooked_tpot_s": base, "hooked_tpot_s": hooked, "offload_tpot_s": off}


# ---- 8, 9: calibrate, then hybrid misses and the calibrated clock ------------------------------------------------
CALIBRATED: dict = {}


def calibrate_section(device: str, quick: bool) -> None:
    """``specmd calibrate`` on this device, timed (target: <= 90 s on an H100; ``--quick`` here: its quick mode),
    its profile kept for section 9."""
    import tempfile

    from specmd.commands.calibrate import calibrate

    t0 = time.perf_counter()
    out = calibrate(tempfile.mkdtemp(), "gpu_check", "deep_olmoe", device, quick, log=lambda m: print(m, flush=True))
    seconds = time.perf_counter() - t0
    hw = {k: v for k, v in out["hardware"].items() if k != "name"}
    CALIBRATED.update(hw)
    check = "; ".join(f"{k}: TTFT {v['ttft']:.2f}, TPOT {v['tpot']:.2f}" for k, v in out["check"].items())
    row("calibrate", "time", f"{seconds:.0f} s", "target <= 90 s" + (f"; its check (measured/simulated): {check}"
                                                                  if check else ""))
    RESULT["calibrate"] = {"seconds": seconds, "hardware": hw, "fit": {k: v for k, v in out["fit"].items()
                                                                       if k != "policies_not_measured"},
                           "check": out["check"]}


def hybrid_section(name: str, model, device: str, family: str, quick: bool) -> None:
    """At 5% with the calibrated profile (host costs measured on this model's experts): fetch, cpu_compute and
    hybrid, throttle off (the real link) -- decode tok/s against the all-fetch bounds (every requested expert
    fetched; at the run's own misses per token), and throttled (the profile's link): measured / simulated TTFT
    and TPOT, the calibrated clock's check on this model."""
    from specmd.commands.calibrate.measure import measure_host_experts

    if not CALIBRATED:
        row("hybrid", name, "skipped", "no calibrated profile (the calibrate section failed or was skipped)")
        return
    host, _ = measure_host_experts(model, family, CALIBRATED, torch.device(device))
    hw = {**CALIBRATED, **host}
    tokens = 3 if quick else 16
    for miss in ("fetch", "cpu_compute", "hybrid"):
        stack = {"miss": miss}
        ttft, tpot, res = timed_generation(model, spec_for(stack, 0.05, {"name": "offload", "throttle": False}, hw),
                                           device, 16, tokens)
        t, o = res["timing"], res["cache"]["miss_outcomes"]
        bound, own = t.get("all_miss_bound_tokens_per_s"), t.get("fetch_bound_tokens_per_s")
        _, _, thr = timed_generation(model, spec_for(stack, 0.05, {"name": "offload", "throttle": True}, hw),
                                     device, 16, tokens)
        r_ttft = thr["wall"]["ttft_s"] / thr["timing"]["ttft_s"]
        r_tpot = thr["wall"]["tpot_s"] / thr["timing"]["tpot_s"]
        row("hybrid", f"{name} {miss} 5%", f"{1 / tpot:.2f} tok/s, {(1 / tpot) / bound:.2f}x the all-fetch bound"
            if bound else f"{1 / tpot:.2f} tok/s",
            f"all-fetch bound {bound or float('nan'):.2f} tok/s, at its own hit rate {own or float('nan'):.2f}; "
            f"fetched {o.get('fetched_native', 0)}, host {o['host_computed']}; calibrated measured/simulated "
            f"TTFT {r_ttft:.2f}, TPOT {r_tpot:.2f}")
        RESULT.setdefault("hybrid", {})[f"{name} {miss}"] = {
            "tok_s": 1 / tpot, "ttft_s": ttft, "all_fetch_bound_tok_s": bound, "fetch_bound_tok_s": own,
            "fetched": o.get("fetched_native", 0), "host": o["host_computed"], "ttft_ratio": r_ttft,
            "tpot_ratio": r_tpot}


def fidelity_section(device: str, quick: bool) -> None:
    """``specmd fidelity --quick`` on the calibrated profile (the tiny model's grid: capacity x miss x batch,
    repeats alternated; ``--quick`` here: two cells): the median and p90 |measured / simulated - 1| of TTFT and
    TPOT, the noise, and the ranking of the miss policies."""
    from specmd.commands.calibrate.fidelity import QUICK, measure, summarize

    if not CALIBRATED:
        row("fidelity", "grid", "skipped", "no calibrated profile (the calibrate section failed or was skipped)")
        return
    grid = dict(QUICK, capacities=(0.05,), misses=("fetch", "hybrid"), batches=(1,)) if quick else QUICK
    cells, meta = measure(CALIBRATED, grid, 3, 8 if quick else 32, 2 if quick else 6, device, log=lambda m: None)
    s = summarize(cells, meta)
    for f in ("ttft", "tpot"):
        x = s[f]
        row("fidelity", f"{f.upper()} median |error|", f"{x['median_abs_err']:.1%}",
            f"p90 {x['p90_abs_err']:.1%}, worst {x['worst']['err']:+.1%} ({x['worst']['cell']}); median noise "
            f"{x['median_noise']:.1%}, {x['noise_bound_cells']}/{x['cells']} cells noise-bound")
    row("fidelity", "ranking", f"{s['ranking']['agree']}/{s['ranking']['groups']} groups agree")
    RESULT["fidelity"] = {"cells": cells, "summary": s}


def decode_sections(device: str, quick: bool, gbps: float) -> None:
    olmoe = deep_olmoe("cpu")
    at_the_link("deep_olmoe", olmoe, device, gbps, quick)
    ratios("deep_olmoe", olmoe, device, quick)
    hybrid_section("deep_olmoe", olmoe, device, "olmoe", quick)
    del olmoe
    t0 = time.perf_counter()
    qwen = random_model(qwen_config(quick))
    nbytes = sum(p.numel() * p.element_size() for p in qwen.parameters())
    row("decode at the link", "Qwen1.5-MoE-shaped model", f"{nbytes / 1e9:.1f} GB",
        f"built in host memory in {time.perf_counter() - t0:.0f} s")
    at_the_link("qwen", qwen, device, gbps, quick)
    ratios("qwen", qwen, device, quick)
    hybrid_section("qwen", qwen, device, "qwen2_moe", quick)


SECTIONS = ("lossless", "policies", "parity", "link", "profile", "calibrate", "fidelity", "decode")


def main(argv: list) -> int:
    """The check; exit 1 when a section failed (its row says FAILED), 2 for bad arguments (before any work)."""
    from specmd.cli.script import ArgumentParser, Sections, choice_of, device, out_file

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=device, help="cuda[:N] where torch sees one, else cpu (with --stand-in: cpu)")
    ap.add_argument("--quick", action="store_true", help="toy sizes (2-layer Qwen, shorter generations)")
    ap.add_argument("--out", type=out_file, help="write the table as JSON here")
    ap.add_argument("--skip", nargs="*", default=[], type=choice_of(SECTIONS, "--skip"),
                    help=f"sections to skip: {' '.join(SECTIONS)}")
    ap.add_argument("--stand-in", action="store_true",
                    help="run the CUDA branches on the CPU (specmd.accel.StandIn: CUDA's ordering, every copy "
                         "deferred until waited for): the script a GPU user runs first has run before")
    a = ap.parse_args(argv)
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() and not a.stand_in else "cpu"
    if a.stand_in:
        if not a.device.startswith("cpu"):
            ap.error(f"--stand-in runs the CUDA branches on the CPU: --device {a.device} is a real device "
                     f"(leave --device out, or --device cpu)")
        from specmd.accel import ENV

        os.environ[ENV] = "1"  # (inherited by calibrate's fresh processes)
    t0 = time.perf_counter()
    RESULT["device"] = (torch.cuda.get_device_name(a.device) if a.device.startswith("cuda")
                        else "cpu (cuda stand-in)" if a.stand_in else "cpu")
    RESULT["torch"] = torch.__version__
    gbps = float("nan")
    sections = Sections()
    for name, fn in zip(SECTIONS, (lossless, policies, parity, link, profile, calibrate_section, fidelity_section,
                                   None)):
        if name in a.skip:
            continue
        t = time.perf_counter()
        with sections.run(name, lambda exc, name=name: row(name, "FAILED", f"{type(exc).__name__}: {exc}")):
            if name == "decode":
                decode_sections(a.device, a.quick, gbps if math.isfinite(gbps) else 25.0)
            elif name == "link":
                gbps = link(a.device, a.quick)
            else:
                fn(a.device, a.quick)
        RESULT.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
    RESULT["total_s"] = round(time.perf_counter() - t0, 1)
    RESULT["failed"] = sections.failed
    print(f"\n{'section':<22} {'item':<44} value  (note)")
    for section, item, value, note in ROWS:
        print(f"{section:<22} {item:<44} {value}" + (f"  ({note})" if note else ""))
    print(f"total {RESULT['total_s']} s on {RESULT['device']}, torch {RESULT['torch']}")
    RESULT["rows"] = [list(r) for r in ROWS]
    if a.out:
        from specmd.results import write_text_atomic

        write_text_atomic(a.out, json.dumps(RESULT, indent=1, default=str))
    return sections.exit_code()


if __name__ == "__main__":
    from specmd.cli.script import run

    run("benchmarks/gpu_check.py", main)
