"""The short rich summary printed after each run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


COMPARE_HINT = ("which stack wins here? python -m specmd -m eviction=lru,least_stale,fld,score "
                "hardware.capacity=0.05,0.25 && specmd report outputs/multirun   (a paper's figure: "
                "python -m specmd -m +experiment=specmd_fig4)")


def _fmt(v, unit="", scale=1.0, digits=4):
    if v is None:
        return "-"
    return f"{v * scale:.{digits}g}{unit}"


def _ratio(measured, simulated) -> str:
    if measured is None or simulated is None or simulated <= 0:
        return "-"
    return f"{measured / simulated:.3g}x"


def _wall_rows(t: Table, timing: dict, wall, memory) -> None:
    """Simulated and measured side by side (execution=offload measures the passes on this machine)."""
    if not wall or wall.get("executor") != "offload":
        return
    for key, label, unit, scale in (("ttft_s", "TTFT", " ms", 1e3), ("tpot_s", "TPOT", " ms", 1e3),
                                    ("tokens_per_s", "tokens/s", "", 1.0)):
        t.add_row(f"{label} simulated | measured",
                  f"{_fmt(timing.get(key), unit, scale)} | {_fmt(wall.get(key), unit, scale)}  "
                  f"(measured/simulated {_ratio(wall.get(key), timing.get(key))})")
    moved = wall.get("bytes_moved") or 0
    t.add_row("transfers (measured)",
              f"{wall.get('transfers')} copies, {moved / 1e6:.4g} MB, {_fmt(wall.get('achieved_gbps'), ' GB/s')}"
              f"{' (throttled)' if wall.get('throttled') else ''}; stall {_fmt(wall.get('stall_s'), ' ms', 1e3)}")
    if memory:
        t.add_row("memory", f"arena {memory.get('arena_capacity_bytes', 0) / 1e6:.4g} MB "
                            f"({memory.get('arena_slots')} slots, peak {memory.get('arena_peak_bytes', 0) / 1e6:.4g} MB), "
                            f"host tier {memory.get('host')} {memory.get('host_tier_bytes', 0) / 1e6:.4g} MB, "
                            f"peak RSS {memory.get('host_peak_rss_bytes', 0) / 1e9:.3g} GB")


def _hit_rate_rows(t: Table, cfg: dict, cache: dict) -> None:
    """The hit-rate rows: overall (in-cache and arrived when prefetches run late), by pass kind, the oracle's."""
    if cache.get("prefetch_late"):  # cache content first (SpecMD counts membership), then transfer timing
        t.add_row("in-cache rate", f"{cache['in_cache_rate']:.4f}  (resident or in flight when requested)")
        t.add_row("hit rate (arrived)", f"{cache['hit_rate']:.4f}  ({cache['hits']}/{cache['requests']} requests; "
                                        f"{cache['prefetch_late']} still in flight)")
    else:
        t.add_row("hit rate", f"{cache['hit_rate']:.4f}  ({cache['hits']}/{cache['requests']} requests)")
    measure = (cfg.get("stack") or {}).get("measure", "all")
    split = [f"{k} {cache[f'{k}_hit_rate']:.4f}" + ("" if measure in ("all", k) else " (not counted above)")
             for k in ("prefill", "decode") if cache.get(f"{k}_hit_rate") is not None]
    if split:
        t.add_row("  by pass kind", ", ".join(split))
    oracle = cache.get("oracle")
    if oracle and oracle.get("hit_rate") is not None:
        t.add_row("  oracle (Belady)", f"{oracle['hit_rate']:.4f}  (same requests, capacity and batch"
                                       f"{'' if oracle.get('exact', True) else '; of the replayed requests'})")


def _union_row(t: Table, cache: dict) -> None:
    """The row of the first pass kind (decode, else prefill) with a union of the experts it routed to."""
    union = cache.get("union") or {}
    for kind in ("decode", "prefill"):
        u = union.get(kind)
        if u:
            d = u["distinct_per_layer"]
            t.add_row(f"{kind} union", f"{d['mean']:.1f} experts/layer/step (p95 {d['p95']:.1f}, "
                      f"{u['fraction']:.0%} of the layer) at {u['tokens_per_step']:.1f} tokens/step; independent "
                      f"routing {u['independent_per_layer']:.1f}; {u['loads_per_token']:.2f} loads/token")
            return


def _cache_event_rows(t: Table, cache: dict) -> None:
    """The counts of what the cache did (evictions, prefetches, streamed misses), its warnings and miss outcomes."""
    t.add_row("collision misses", str(cache["collision_misses"]))
    t.add_row("evictions", str(cache["evictions"]) + (f" ({cache['evictions_pressure']} as the KV cache grew)"
                                                      if cache.get("evictions_pressure") else ""))
    lb = cache.get("layer_budget")
    if lb:  # per-layer pools: each layer's slots (hardware.layer_budget)
        how = (f"proportional to the working sets measured in the first {lb['warmup_passes']} passes"
               if lb["measured"] else "uniform" if lb["rule"] == "uniform" else
               f"uniform: the run ended within the {lb['warmup_passes']}-pass warm-up")
        t.add_row("slots per layer", f"{' '.join(str(n) for n in lb['slots'])} ({how})")
    mem = cache.get("memory")
    if mem:  # hardware.memory_gb: the cache is what the memory leaves, per pass
        cb, ce, kv = mem["capacity_bytes"], mem["capacity_experts"], mem["kv_bytes"]
        t.add_row("device memory", f"{mem['memory_bytes'] / 2**30:.4g} GiB: dense {mem['dense_bytes'] / 2**30:.3g} GiB, "
                  f"reserve {mem['reserve_bytes'] / 2**30:.3g} GiB, KV cache {kv['min'] / 2**30:.3g}-{kv['max'] / 2**30:.3g} GiB")
        t.add_row("  cache per pass", f"{cb['min'] / 2**30:.3g} / {cb['mean'] / 2**30:.3g} / {cb['last'] / 2**30:.3g} GiB "
                  f"(min / mean / last): {ce['min']} / {ce['mean']:.1f} / {ce['last']} experts")
    t.add_row("prefetch issued / used", f"{cache['prefetch_issued']} / {cache['prefetch_used']}")
    # misses that no cache policy could have turned into hits: they explain a low hit rate
    if cache.get("streamed"):
        t.add_row("  streamed (not cached)",
                  f"{cache['streamed']} misses ran without a cache slot (the layer's own experts filled it)")
    if cache.get("layer_streams"):
        t.add_row("layer streams", f"{cache['layer_streams']} layer calls streamed (hardware.stream_layers): "
                  f"{cache['stream_served']} misses served from the staging area, "
                  f"{cache['bytes_stream'] / 1e6:.3g} MB staged")
    if cache.get("prefetch_skipped"):
        t.add_row("  prefetch skipped", f"{cache['prefetch_skipped']} predictions not fetched (no evictable slot)")
    late = cache.get("prefetch_lateness")
    if late and late["structural"]:
        t.add_row("[yellow]warning[/yellow]",
                  f"[yellow]every decode prefetch is late by construction: one expert transfer takes "
                  f"{late['transfer_s'] * 1e6:.3g} µs, a decode layer computes in "
                  f"{late['decode_window_s'] * 1e6:.3g} µs; "
                  f"prefetch hit rates measure the link, not the predictor: compare in_cache_rate"
                  + ("" if cache.get("timing_geometry", "model") != "model" else
                     ", or time the routing as a real model (hardware.timing_as=olmoe)") + "[/yellow]")
    if cache.get("timing_geometry", "model") != "model":
        t.add_row("timing geometry", f"{cache['timing_geometry']} (sizes and compute; routing from the model)")
    if cache.get("prefetch_precision") is not None:
        t.add_row("prediction precision / recall",
                  f"{cache['prefetch_precision']:.3f} / {cache['prefetch_recall']:.3f}")
    outcomes = {k: v for k, v in (cache.get("miss_outcomes") or {}).items() if v}
    if set(outcomes) - {"fetched_native"}:
        t.add_row("miss outcomes", ", ".join(f"{k}={v}" for k, v in outcomes.items()))


def print_summary(results: dict, run_dir: str, console: Console | None = None) -> None:
    from .engine import GROUPS

    console = console or Console()
    cfg = results["config"]
    stack = " ".join(f"{g}={cfg[g]['name']}" for g in GROUPS)
    hw = cfg["hardware"]
    size = f"memory_gb={hw['memory_gb']}" if hw.get("memory_gb") is not None else f"capacity={hw['capacity']}"
    t = Table(title=f"specmd · {cfg['model']['name']} · {stack} · {hw.get('name')} {size}",
              show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value")
    cache, timing = results.get("cache"), results.get("timing")
    if cache is None:
        t.add_row("stack", "disabled (unhooked baseline)")
    else:
        _hit_rate_rows(t, cfg, cache)
        _union_row(t, cache)
        _cache_event_rows(t, cache)
        t.add_row("stall", _fmt(timing["stall_s"], " ms", 1e3))
        t.add_row("TTFT", _fmt(timing["ttft_s"], " ms", 1e3))
        t.add_row("TPOT", _fmt(timing["tpot_s"], " ms", 1e3))
        t.add_row("tokens/s (simulated)", _fmt(timing["tokens_per_s"], "", 1.0, 6))
        _wall_rows(t, timing, results.get("wall"), results.get("memory"))
        t.add_row("routing fidelity", f"{results['routing']['fidelity']:.4f}")
    for task, metrics in (results.get("tasks") or {}).items():
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if not k.endswith("_stderr") and k != "sample_len")
        t.add_row(task, shown)
    t.add_row("wall time", f"{results['wall_s']:.1f} s")
    t.add_row("run dir", run_dir)
    console.print(t)
    console.print(f"[dim]{COMPARE_HINT}[/dim]", soft_wrap=True)
