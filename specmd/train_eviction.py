"""Train FlashMoE's ML eviction networks (``eviction=ml``) from routing traces of any model.

    # record routing of a model on WikiText-2 validation text (never an evaluated split) and train:
    python -m specmd.train_eviction --model specmd:tiny-olmoe --out specmd/assets/tiny-olmoe/ml_eviction.safetensors
    # or from traces saved by runs (python -m specmd ... trace.save=true writes <run dir>/trace):
    python -m specmd.train_eviction --traces outputs/*/*/trace --out my_policy.safetensors

Labels are Belady's next-use distances along the trace (the oracle FlashMoE imitates); one network per MoE
layer (see ``specmd/policies/eviction/ml.py``). The last ``--holdout`` of each trace is kept out of
training and replayed through the real cache manager with ``ml``, ``lru`` and ``lfu`` at
``--eval-capacity`` experts per layer; the hit rates are printed and stored in the file's metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from .policies.eviction.ml import features


# ---- traces -------------------------------------------------------------------------------------------------
@torch.no_grad()
def record_routing(model, texts: list[str], tokenizer, max_tokens: int, window: int = 512) -> list[np.ndarray]:
    """Per MoE layer, the router's own top-k of every token ([N, k] int arrays), in text order."""
    from .models.adapters import adapter_for

    adapter = adapter_for(model.config.model_type)
    routers = [adapter.router(model, i) for i in adapter.moe_layers(model)]
    out: list[list] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: out[i].append(o[2].cpu().numpy()))
             for i, r in enumerate(routers)]
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    try:
        for start in range(0, len(ids), window):
            model(torch.tensor(ids[start:start + window]).unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return [np.concatenate(x) for x in out]


def load_traces(paths: list[str]) -> list[list[np.ndarray]]:
    """Per trace, per MoE layer, the router's own top-k of every token ([N, k]): from specmd trace
    directories (``trace.save=true``) or ``.npz`` files with one ``layer<i>`` array each."""
    from .replay.trace import read_trace

    traces = []
    for p in paths:
        if os.path.isdir(p):
            tr = read_trace(p)
            L = tr.meta["geometry"]["num_layers"]
            traces.append([np.concatenate([tr.index[r0:r0 + n] for _, layer, r0, n in tr.calls if layer == l])
                           for l in range(L)])
            continue
        with np.load(p) as z:
            n = len([k for k in z.files if k.startswith("layer")])
            traces.append([z[f"layer{i}"] for i in range(n)])
    return traces


# ---- features and Belady labels ----------------------------------------------------------------------------
def dataset(trace: np.ndarray, num_experts: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs [T*E, 2] and targets [T*E] for one layer's trace ([T, k] selections, one step per row)."""
    T = len(trace)
    used = np.zeros((T, num_experts), dtype=bool)
    np.put_along_axis(used, trace.astype(np.int64), True, axis=1)
    # next use after t (Belady): scan backwards
    dist = np.empty((T, num_experts), dtype=np.float32)
    nxt = np.full(num_experts, np.inf)
    for t in range(T - 1, -1, -1):
        dist[t] = nxt - t
        nxt[used[t]] = t
    y = np.minimum(dist, cap) / cap
    x = np.empty((T, num_experts, 2), dtype=np.float32)
    last = np.full(num_experts, -1, dtype=np.int64)
    freq = np.zeros(num_experts, dtype=np.float64)
    for t in range(T):
        last[used[t]] = t
        freq[used[t]] += 1
        x[t] = features(last, freq, t)
    return x.reshape(-1, 2), y.reshape(-1)


def train_layer(x: np.ndarray, y: np.ndarray, steps: int, batch: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 128), torch.nn.SiLU(), torch.nn.Linear(128, 128), torch.nn.SiLU(),
                              torch.nn.Linear(128, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)
    loss = None
    for _ in range(steps):
        idx = torch.randint(0, len(X), (batch,), generator=g)
        loss = torch.nn.functional.mse_loss(net(X[idx]).squeeze(-1), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        full = float(torch.nn.functional.mse_loss(net(X).squeeze(-1), Y))
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    tensors = {}
    for i, m in enumerate(lin, 1):
        tensors[f"w{i}"] = m.weight.detach().numpy().copy()
        tensors[f"b{i}"] = m.bias.detach().numpy().copy()
    return {"tensors": tensors, "mse": full}


# ---- replay through the cache manager ------------------------------------------------------------------------
def replay(traces: list[np.ndarray], num_experts: int, capacity: int, name: str, params=None) -> dict:
    """Replay per-token routing (one decode step per token, layers in order) through the real cache
    manager with eviction policy ``name`` and ``capacity`` experts per layer (per-layer pools, demand
    fetches only). Returns the hit rate and the replay's wall time (policy + manager cost)."""
    import time

    from .engine.cache import CacheManager
    from .engine.clock import Roofline, SimClock, TransferChannel
    from .engine.geometry import Geometry
    from .policies.eviction import EVICTION
    from .policies.miss import MISS

    L = len(traces)
    geom = Geometry(num_layers=L, num_experts=num_experts, top_k=traces[0].shape[1], expert_bytes=1,
                    total_bytes=L * num_experts, dense_params=[0] * L, attn_layers=[0] * L)
    cls = EVICTION.get(name)
    m = CacheManager(geom, [capacity] * L, [cls(params) for _ in range(L)], MISS.build({"name": "fetch"}),
                     SimClock(geom, TransferChannel(1e18, 0.0), Roofline(1e18, 1e18)))
    steps = [[sorted(set(tr[t].tolist())) for tr in traces] for t in range(len(traces[0]))]
    t0 = time.perf_counter()
    for t, row in enumerate(steps):
        m.begin_pass("decode", 1, t + 1)
        for layer, req in enumerate(row):
            m.serve(layer, req)
            m.finish_layer()
        m.end_pass()
    seconds = time.perf_counter() - t0
    st = m.stats
    return {"hit_rate": st.total("hits") / st.total("requests"), "seconds": seconds, "calls": len(steps) * L}


def replay_hit_rates(traces: list[np.ndarray], num_experts: int, capacity: int, policies: dict) -> dict:
    return {name: round(replay(traces, num_experts, capacity, name, params)["hit_rate"], 4)
            for name, params in policies.items()}


def belady_hit_rate(traces: list[np.ndarray], capacity: int) -> float:
    """Belady's optimal hit rate for the same replay (per layer: on a miss with a full cache, evict the
    resident expert whose next use is furthest away) -- the upper bound the network imitates."""
    hits = requests = 0
    for trace in traces:
        steps = [sorted(set(row.tolist())) for row in trace]
        nxt_use: list[dict] = [dict() for _ in steps]
        upcoming: dict = {}
        for t in range(len(steps) - 1, -1, -1):
            nxt_use[t] = upcoming.copy()
            for e in steps[t]:
                upcoming[e] = t
        cache: set = set()
        for t, req in enumerate(steps):
            for e in req:
                requests += 1
                if e in cache:
                    hits += 1
                    continue
                if len(cache) >= capacity:
                    cands = [c for c in cache if c not in req] or list(cache)
                    cache.remove(max(cands, key=lambda c: (nxt_use[t].get(c, math.inf), c)))
                cache.add(e)
    return round(hits / requests, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="specmd:<asset>, hub id or local checkpoint to record routing from")
    ap.add_argument("--traces", nargs="*", default=[], help="trace directories saved by runs (trace.save=true) or .npz files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mirror", default=os.environ.get("SPECMD_DATA_MIRROR"))
    ap.add_argument("--tokens", type=int, default=24000, help="tokens of WikiText-2 validation to record")
    ap.add_argument("--cap", type=int, default=64, help="next-use distances are clipped at this many steps")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--eval-capacity", type=int, default=16, help="experts per layer in the replay evaluation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    traces = load_traces(args.traces)
    source = [str(p) for p in args.traces]
    num_experts = None
    if args.model:
        from .eval.mirror import resolve_mirror, set_offline
        from .models.loader import ModelConfig, load_model, resolve_pretrained
        from .train import wikitext2_valid

        cfg_path = Path(resolve_pretrained(args.model)) / "config.json"
        family = json.loads(cfg_path.read_text())["model_type"] if cfg_path.is_file() else None
        root = resolve_mirror(args.mirror)
        if root is not None:
            set_offline()
        model, tok = load_model(ModelConfig(family=family or "olmoe", pretrained=args.model))
        model.eval()
        traces.append(record_routing(model, wikitext2_valid(root), tok, args.tokens))
        from .models.adapters import adapter_for

        num_experts = adapter_for(model.config.model_type).num_experts(model.config)
        source.append(f"{args.model} on WikiText-2 validation ({args.tokens} tokens)")
    if not traces:
        ap.error("give --model or --traces")
    L = len(traces[0])
    if any(len(t) != L for t in traces):
        raise SystemExit("traces have different numbers of MoE layers")
    num_experts = num_experts or int(max(int(t[l].max()) for t in traces for l in range(L)) + 1)

    tensors, mses = {}, []
    held = [[] for _ in range(L)]
    for layer in range(L):
        xs, ys = [], []
        for t in traces:
            cut = int(len(t[layer]) * (1 - args.holdout))
            x, y = dataset(t[layer][:cut], num_experts, args.cap)
            xs.append(x)
            ys.append(y)
            held[layer].append(t[layer][cut:])
        res = train_layer(np.concatenate(xs), np.concatenate(ys), args.steps, args.batch, args.seed + layer)
        mses.append(round(res["mse"], 5))
        for k, v in res["tensors"].items():
            tensors[f"layer{layer}.{k}"] = v
        print(f"layer {layer}: {sum(len(x) for x in xs)} samples, train MSE {res['mse']:.5f}")

    from safetensors.numpy import save_file

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"num_layers": str(L), "num_experts": str(num_experts), "cap": str(args.cap), "source": json.dumps(source),
            "train_mse": json.dumps(mses), "paper": "FlashMoE §3.2 (2 -> 128 -> 128 -> 1, SiLU, MSE, AdamW 1e-3/1e-2)"}
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    from .policies.eviction.ml import ML

    held_traces = [np.concatenate(h) for h in held]
    rates = replay_hit_rates(held_traces, num_experts, args.eval_capacity,
                             {"lru": None, "lfu": None, "ml": ML.Params(weights=str(tmp))})
    rates["belady"] = belady_hit_rate(held_traces, args.eval_capacity)
    meta["holdout_hit_rate"] = json.dumps({"capacity_per_layer": args.eval_capacity, "tokens": len(held_traces[0]),
                                           **rates})
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(out)
    print(f"held-out replay ({len(held_traces[0])} tokens, {args.eval_capacity} experts/layer): {rates}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
