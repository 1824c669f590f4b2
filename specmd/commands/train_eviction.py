"""Train FlashMoE's ML eviction networks (``eviction=ml``) from routing traces of any model.

    # record a model's routing on WikiText-2 validation text (never an evaluated split) and train:
    python -m specmd.commands.train_eviction --model specmd:tiny-olmoe --out specmd/assets/tiny-olmoe/ml_eviction.safetensors
    # or from traces saved by runs (python -m specmd ... trace.save=true writes <run dir>/trace), or imported:
    python -m specmd.commands.train_eviction --traces outputs/*/*/trace --out my_policy.safetensors
    python -m specmd.commands.train_eviction --traces routing.jsonl --format jsonl --num-experts 64 --out my_policy.safetensors
    # specmd train-eviction ... is the same command

Every number here has one producer, the one a run uses:

1. **record** (``--model``): the live driver with the recording stack and a trace writer
   (:func:`specmd.recorder.record_routing`), token by token: each token is a pass of its own, so a
   layer's step is one call of that layer, as in generation;
2. **read** (``--traces``): the trace reader, or an importer (``--format``, :mod:`specmd.replay.formats`);
3. **label**: Belady's next-use distance along each layer's calls. A step is one call of the layer, the
   step ``eviction=ml`` counts (``specmd/policies/eviction/ml.py``): a prefill call is one step that uses
   every expert it requests;
4. **train**: one network per MoE layer on the first ``1 - --holdout`` of each trace's passes;
5. **evaluate**: the last ``--holdout`` of each trace's passes (:func:`~specmd.replay.trace.select_passes`)
   replayed by the replay driver (:func:`~specmd.replay.driver.run_replay`) with ``eviction=ml``, ``lru``,
   ``lfu`` and ``belady`` at ``--eval-capacity`` experts per layer (``hardware.scope=per_layer``,
   ``miss=fetch``, ``prefetch=none``). The hit rates are printed and stored in the file's metadata with the
   passes they cover: ``select_passes`` + ``run_replay`` (or ``python -m specmd replay.trace=...`` on a trace
   of those passes) reproduce them exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..policies.eviction.ml import features

EVALUATED = ("lru", "lfu", "ml", "belady")  # the held-out replay's eviction policies


# ---- steps and Belady labels --------------------------------------------------------------------------------
def layer_steps(trace) -> list[list[np.ndarray]]:
    """Per MoE layer, the experts each of its calls requests (ascending), in call order: ``eviction=ml``'s
    steps."""
    from ..replay.driver import requested_per_call

    L, E = trace.meta.geometry.num_layers, trace.meta.geometry.num_experts
    ptr, experts = requested_per_call(trace, E)
    out: list[list] = [[] for _ in range(L)]
    for c, layer in enumerate(trace.calls[:, 1].tolist()):
        out[layer].append(experts[ptr[c]:ptr[c + 1]])
    return out


def dataset(steps, num_experts: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs [T*E, 2] and targets [T*E] for one layer's steps (``steps[t]``: the experts used at step t;
    rows of a [T, k] selection array work too)."""
    T = len(steps)
    used = np.zeros((T, num_experts), dtype=bool)
    for t, experts in enumerate(steps):
        used[t, np.asarray(experts, dtype=np.int64)] = True
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


# ---- the held-out replay ---------------------------------------------------------------------------------------
def holdout_spec(eviction: str, capacity: int, weights=None):
    """The stack the held-out hit rates are measured with (module docstring, step 5)."""
    from ..compose import spec_of
    from ..hardware import HardwareConfig

    cfg = {"name": eviction, **({"weights": str(weights)} if eviction == "ml" else {})}
    return spec_of(eviction=cfg, miss="fetch", prefetch="none",
                   hardware=HardwareConfig(experts_per_layer=capacity, scope="per_layer"))


def holdout_hit_rates(parts: list, capacity: int, weights) -> dict:
    """Hit rate of each of :data:`EVALUATED` over the held-out ``parts`` (traces), each replayed from an
    empty cache by the replay driver; pooled over the parts (their hits over their requests)."""
    from ..replay.driver import run_replay

    rates = {}
    for name in EVALUATED:
        hits = requests = 0
        spec = holdout_spec(name, capacity, weights)
        for part in parts:
            st = run_replay(part, spec).cache.stats
            hits += st.total("hits")
            requests += st.total("requests")
        rates[name] = round(hits / requests, 4)
    return rates


# ---- command line ------------------------------------------------------------------------------------------
def record_model(args, directory: Path):
    """``--model``'s trace: its routing on WikiText-2 validation, token by token (module docstring, step 1)."""
    from ..eval.corpora import wikitext2_valid
    from ..eval.mirror import resolve_mirror, set_offline
    from ..models.loader import ModelConfig, load_model, resolve_pretrained
    from ..recorder import record_routing

    cfg_path = Path(resolve_pretrained(args.model)) / "config.json"
    family = json.loads(cfg_path.read_text())["model_type"] if cfg_path.is_file() else None
    root = resolve_mirror(args.mirror)
    if root is not None:
        set_offline()
    model, tok = load_model(ModelConfig(family=family or "olmoe", pretrained=args.model))
    model.eval()
    ids: list[int] = []
    for text in wikitext2_valid(root):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= args.tokens:
            break
    source = {"model": args.model, "text": f"WikiText-2 validation, first {args.tokens} tokens, token by token"}
    return record_routing(model, ids[:args.tokens], directory / "recorded", window=args.window,
                          token_by_token=True, source=source)


def read_traces(args) -> list:
    from ..replay.config import ReplayConfig, open_trace
    from ..registry import build_params

    return [open_trace(build_params(ReplayConfig, {"trace": str(p), "format": args.format,
                                                   "num_experts": args.num_experts}, "replay"))
            for p in args.traces]


def main(argv=None):
    from ..errors import ArgumentParser

    ap = ArgumentParser(prog="specmd train-eviction", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="specmd:<asset>, hub id or local checkpoint to record routing from")
    ap.add_argument("--traces", nargs="*", default=[], help="specmd trace directories (trace.save=true) or import files")
    ap.add_argument("--format", default="specmd", help="replay.format of --traces (specmd or an import format)")
    ap.add_argument("--num-experts", type=int, default=None, help="experts per layer of an imported trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-trace", default=None, help="directory to keep --model's recorded trace in")
    ap.add_argument("--mirror", default=os.environ.get("SPECMD_DATA_MIRROR"))
    ap.add_argument("--tokens", type=int, default=24000, help="tokens of WikiText-2 validation to record")
    ap.add_argument("--window", type=int, default=512, help="tokens per recorded sequence (its KV cache is reset)")
    ap.add_argument("--cap", type=int, default=64, help="next-use distances are clipped at this many steps")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--holdout", type=float, default=0.1, help="fraction of each trace's passes held out")
    ap.add_argument("--eval-capacity", type=int, default=16, help="experts per layer in the held-out replay")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.model and not args.traces:
        ap.error("give --model or --traces")
    if not 0 < args.holdout < 1:
        ap.error(f"--holdout={args.holdout} must be in (0, 1)")
    least = {"tokens": 1, "window": 2, "cap": 1, "steps": 1, "batch": 1, "eval_capacity": 1, "num_experts": 1}
    for key, low in least.items():  # 0 steps wrote untrained networks; a negative cap a degenerate target
        v = getattr(args, key)
        if v is not None and v < low:
            raise ConfigError(f"--{key.replace('_', '-')}={v} must be >= {low}")
    from ..results import writable_dir

    out = Path(args.out)
    if out.is_dir() or not out.name:
        raise ConfigError(f"--out {args.out}: a directory; name the weights file (e.g. {out / 'ml.safetensors'})")
    writable_dir(out.parent, f"--out {args.out}")  # before recording and training: minutes of work

    with tempfile.TemporaryDirectory() as tmp:
        traces = read_traces(args)
        if args.model:
            traces.append(record_model(args, Path(args.keep_trace or tmp)))
        train(args, traces)


def train(args, traces: list) -> dict:
    """Steps 3-5 of the module docstring on ``traces``; writes ``args.out`` and returns its metadata."""
    from safetensors.numpy import save_file

    from ..replay.trace import select_passes

    geoms = {(t.meta.geometry.num_layers, t.meta.geometry.num_experts) for t in traces}
    if len(geoms) != 1:
        raise ConfigError(f"the traces have different (MoE layers, experts): {sorted(geoms)}; train on traces of one "
                          "model")
    ((L, E),) = geoms
    if any(len(t.passes) < 2 for t in traces):
        raise ConfigError("every trace needs at least 2 passes (one to train on, one held out): "
                          + ", ".join(f"{t.path} has {len(t.passes)}" for t in traces if len(t.passes) < 2))
    cuts = [max(1, min(len(t.passes) - 1, round(len(t.passes) * (1 - args.holdout)))) for t in traces]
    steps = [layer_steps(select_passes(t, 0, cut)) for t, cut in zip(traces, cuts)]
    tensors, mses = {}, []
    for layer in range(L):
        data = [dataset(s[layer], E, args.cap) for s in steps]
        x, y = np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data])
        res = train_layer(x, y, args.steps, args.batch, args.seed + layer)
        mses.append(round(res["mse"], 5))
        for k, v in res["tensors"].items():
            tensors[f"layer{layer}.{k}"] = v
        print(f"layer {layer}: {len(x)} samples, train MSE {res['mse']:.5f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = [{"trace": t.path, **t.meta.source} for t in traces]
    meta = {"num_layers": str(L), "num_experts": str(E), "cap": str(args.cap), "step": "one call of the layer",
            "source": json.dumps(source, default=str), "train_mse": json.dumps(mses),
            "paper": "FlashMoE §3.2 (2 -> 128 -> 128 -> 1, SiLU, MSE, AdamW 1e-3/1e-2)"}
    from ..results import write_file

    held = [select_passes(t, cut) for t, cut in zip(traces, cuts)]
    rates: dict = {}

    def fill(tmp):  # the weights, then their held-out hit rates measured from that file, into its metadata
        save_file(tensors, str(tmp), metadata=meta)
        rates.update(holdout_hit_rates(held, args.eval_capacity, tmp))
        meta["holdout_hit_rate"] = json.dumps({
            "capacity_per_layer": args.eval_capacity, "passes": [[cut, len(t.passes)] for t, cut in zip(traces, cuts)],
            "layer_calls": sum(len(h.calls) for h in held), **rates})
        save_file(tensors, str(tmp), metadata=meta)

    write_file(out, fill)  # an interrupt or an error leaves no weights file, whole or half; a full disk keeps them
    print(f"held-out replay ({sum(len(h.passes) for h in held)} passes, {args.eval_capacity} experts/layer): {rates}")
    print(f"wrote {out}")
    return meta


if __name__ == "__main__":  # python -m specmd.commands.train_eviction: specmd train-eviction, with its one error path
    from ..ending import guarded

    sys.exit(guarded("specmd train-eviction", main, sys.argv[1:]))
