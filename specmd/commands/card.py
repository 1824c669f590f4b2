"""Measure what a model card reports: routing statistics and task scores.

    specmd card --model specmd:tiny-olmoe --out card.json      # or python -m specmd.commands.card ...

Routing statistics are measured on WikiText-2 *test* text (measurement only; never trained on), per MoE
layer, from the router's own top-k:
* ``entropy_ratio`` — entropy of the expert-usage distribution divided by log(E) (1 = perfectly balanced);
* ``dead_fraction`` — fraction of experts never selected;
* ``temporal_overlap`` — mean |topk(t) ∩ topk(t-1)| / k over consecutive tokens of a sequence (the
  locality cache-aware routing exploits); ``random_overlap`` = k/E is what independent routing would give;
* ``compare`` — the statistics the OLMoE paper's routing analysis published for real models (OLMoE-1B-7B and
  Mixtral-8x7B on five text domains; ``routing_stats/olmoe_paper`` in the data mirror), measured the same way
  on this model at the same relative depths (real layers 0/7/15 of 16 for OLMoE, 0/7/15 of 32 for
  Mixtral): per-layer expert-popularity skew (usage entropy / log E, the most and least used expert's share
  x E) and cross-layer co-selection (normalised mutual information of rank-aligned expert pairs between
  two layers, 0 for independent layers).

The bounds a shipped model's routing must meet (:func:`routing_failures`, checked by
``tests/models/test_embedded.py``): usage entropy >= 0.85 log E, no dead expert, and token-to-token locality
(``temporal_overlap``) like the real model of its shape. For Mixtral's shape (top-2 of 8) the real figure is
measured: Mixtral-8x7B-Instruct decode routing captured in vLLM (577 tokens x 32 layers) overlaps 0.376 on
average over layers, 0.259 at its lowest layer (layer 0), with 13 of 32 layers below 1.5 x random; so the
bound is the mean within +-0.06 of 0.376 and no layer below 0.25. For OLMoE's shape no per-token real figure
is available and the bound stays every layer > 1.5 x random (k/E).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..models.adapters import measured_locality

CHECK_LIMIT = 2
LOCALITY_MEAN_TOL = 0.06
LOCALITY_FLOOR = 0.25
REFERENCE_LAYERS = (0, 7, 15)
DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")


def routing_failures(stats: dict) -> list[str]:
    """What a shipped model's routing statistics miss of the bounds in the module docstring ([] = passes)."""
    out = []
    E, k = stats["num_experts"], stats["top_k"]
    for i, layer in enumerate(stats["layers"]):
        if stats["entropy_ratio"][i] < 0.85:
            out.append(f"layer {layer}: usage entropy {stats['entropy_ratio'][i]:.3f} log E < 0.85")
        if stats["dead_fraction"][i] > 0:
            out.append(f"layer {layer}: {stats['dead_fraction'][i]:.1%} of experts never selected")
    overlap = stats["temporal_overlap"]
    real = measured_locality(E, k)
    if real is None:
        floor = 1.5 * stats["random_overlap"]
        out += [f"layer {layer}: locality {o:.3f} <= 1.5 x random ({floor:.4f})"
                for layer, o in zip(stats["layers"], overlap) if o <= floor]
    else:
        mean = sum(overlap) / len(overlap)
        if abs(mean - real["mean"]) > LOCALITY_MEAN_TOL:
            out.append(f"mean locality {mean:.3f} not within {LOCALITY_MEAN_TOL} of {real['model']}'s {real['mean']}")
        out += [f"layer {layer}: locality {o:.3f} < {LOCALITY_FLOOR}"
                for layer, o in zip(stats["layers"], overlap) if o < LOCALITY_FLOOR]
    return out


def _skew(counts) -> dict:
    """Popularity skew of one layer's selection counts [E]."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64)
    p = c / c.sum()
    nz = p[p > 0]
    return {"entropy_ratio": round(float(-(nz * np.log(nz)).sum() / math.log(len(c))), 4),
            "max_share_x_E": round(float(p.max() * len(c)), 3), "min_share_x_E": round(float(p.min() * len(c)), 3)}


def _nmi(joint) -> float:
    """Mutual information of a joint count matrix [E, E] / log E (0: independent, 1: one determines the other)."""
    import numpy as np

    j = np.asarray(joint, dtype=np.float64)
    p = j / j.sum()
    pa, pb = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    return round(float((p[nz] * np.log(p[nz] / (pa @ pb)[nz])).sum() / math.log(j.shape[0])), 4)


def reference_stats(mirror, family: str) -> Optional[dict]:
    """The real model's popularity skew and co-selection (five domains pooled) from the mirror, or None."""
    import numpy as np

    ref = _reference(family)
    if ref is None or mirror is None:
        return None
    root = Path(mirror) / "routing_stats" / "olmoe_paper" / ref.mirror_dir
    if not root.is_dir():
        return None
    counts, pairs = None, None
    for d in DOMAINS:
        per = json.loads((root / "expert_counts" / f"{d}.json").read_text())
        cross = json.loads((root / "expert_counts_crosslayer" / f"{d}.json").read_text())
        E = max(int(e) for c in per["counts"] for e in c) + 1
        if counts is None:
            counts = np.zeros((len(per["layers"]), E))
            pairs = np.zeros((len(cross["layer_pairs"]), E, E))
        for i, c in enumerate(per["counts"]):
            for e, n in c.items():
                counts[i, int(e)] += n
        for i, c in enumerate(cross["counts"]):
            for ab, n in c.items():
                a, b = ab.split(",")
                pairs[i, int(a), int(b)] += n
    model, top_k = ref.model, ref.top_k
    return {"model": model, "layers": per["layers"], "tokens": int(counts[0].sum()) // top_k,
            "domains": list(DOMAINS),
            "skew": [_skew(c) for c in counts], "layer_pairs": cross["layer_pairs"],
            "co_selection_nmi": [_nmi(p) for p in pairs]}


def _reference(family: str):
    """The family's real-model routing reference (its adapter's ``routing_reference``), or None."""
    from ..models.adapters import ADAPTERS

    adapter = ADAPTERS.get(family)
    return adapter.routing_reference if adapter is not None else None


def reference_layers(family: str, num_layers: int) -> list[int]:
    """This model's layers at the real model's relative depths (layers 0/7/15 of 16 or of 32)."""
    ref = _reference(family)
    real = ref.layers if ref is not None else 16
    return sorted({min(num_layers - 1, round(x * num_layers / real)) for x in REFERENCE_LAYERS})

def routing_stats(model, tokenizer, texts: list[str], window: int = 512, max_tokens: int = 65536) -> dict:
    """The card's routing statistics of ``model`` on ``texts`` (windows of ``window`` tokens, each one
    prefill pass, up to ``max_tokens``), from the trace the one recorder writes
    (:func:`specmd.recorder.record_routing`)."""
    import tempfile

    from ..recorder import record_routing

    ids = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    n = len(ids)
    if n % window == 1:  # a one-token window has no token-to-token pair
        ids = ids[:-1]
    with tempfile.TemporaryDirectory() as tmp:
        trace = record_routing(model, ids, Path(tmp) / "trace", window=window)
        return {**trace_routing_stats(trace, model.config.model_type), "tokens": n}


def trace_routing_stats(trace, family: str) -> dict:
    """Popularity, token-to-token locality and cross-layer co-selection of a trace's router selections."""
    g = trace.meta.geometry
    L, E, k = g.num_layers, g.num_experts, g.top_k
    ref = reference_layers(family, L)
    ref_pairs = list(zip(ref[:-1], ref[1:]))
    joint = torch.zeros(len(ref_pairs), E, E, dtype=torch.long)
    counts = torch.zeros(L, E, dtype=torch.long)
    overlap_sum = torch.zeros(L, dtype=torch.float64)
    overlap_n = 0
    index = torch.from_numpy(np.asarray(trace.index, dtype=np.int64))
    calls = trace.calls.tolist()
    for p, (_, tokens, _) in enumerate(trace.passes.tolist()):
        sel = {layer: index[r0:r0 + n] for _, layer, r0, n in calls[p * L:(p + 1) * L]}  # [T, k]; every layer, every pass
        for j, (a, b) in enumerate(ref_pairs):  # rank-aligned pairs, as the OLMoE paper's analysis counts them
            joint[j] += torch.bincount((sel[a] * E + sel[b]).reshape(-1), minlength=E * E).view(E, E)
        for i in range(L):
            idx = sel[i]
            counts[i] += torch.bincount(idx.reshape(-1), minlength=E)
            hit = (idx[1:].unsqueeze(-1) == idx[:-1].unsqueeze(-2)).any(-1).sum(-1)  # [T-1]
            overlap_sum[i] += hit.double().sum() / k
        overlap_n += tokens - 1
    p = counts.double() / counts.sum(-1, keepdim=True)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(E)
    layer_ids = list(g.layer_ids)
    return {
        "tokens": int(trace.passes[:, 1].sum()),
        "num_experts": E,
        "top_k": k,
        "layers": layer_ids,
        "entropy_ratio": [round(float(x), 4) for x in ent],
        "dead_fraction": [float((c == 0).sum()) / E for c in counts],
        "temporal_overlap": [round(float(x) / overlap_n, 4) for x in overlap_sum],
        "random_overlap": k / E,
        "compare": {"layers": [layer_ids[i] for i in ref], "skew": [_skew(counts[i].tolist()) for i in ref],
                    "layer_pairs": [[layer_ids[a], layer_ids[b]] for a, b in ref_pairs],
                    "co_selection_nmi": [_nmi(j.tolist()) for j in joint]},
    }


def wikitext_test_pages(mirror) -> list[str]:
    """WikiText-2 test articles from the mirror, as lm-eval presents them (detokenized)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from ..eval.mirror import _wikitext

    return [wikitext_detokenizer(r) for r in _wikitext(mirror, "wikitext-2-raw-v1")["test"]]


def _load(model_path: str, mirror: str):
    """(mirror root, family, model, tokenizer) of the model a card describes, offline, in float32."""
    from ..eval.mirror import resolve_mirror, set_offline
    from ..models.loader import ModelConfig, load_model, resolve_pretrained

    set_offline()
    root = resolve_mirror(mirror)
    family = json.loads((Path(resolve_pretrained(model_path)) / "config.json").read_text())["model_type"]
    model, tok = load_model(ModelConfig(name="card", family=family, pretrained=model_path, dtype="float32"))
    return root, family, model, tok


def _routing_part(root, family: str, model, tok) -> dict:
    return {"routing": routing_stats(model, tok, wikitext_test_pages(root)), "reference": reference_stats(root, family)}


def measure(model_path: str, mirror: str, limits: dict, max_gen_toks: int = 64) -> dict:
    from ..eval.harness import EvalConfig, evaluate
    from ..eval.mirror import mirrored

    root, family, model, tok = _load(model_path, mirror)
    out = {**_routing_part(root, family, model, tok), "tasks": {}, "limits": limits}
    with mirrored(root):
        for task, limit in limits.items():
            res = evaluate(model, tok, EvalConfig(tasks=[task], limit=limit, max_gen_toks=max_gen_toks))
            out["tasks"][task] = res[task]
        # the fixed slice tests/models/test_embedded.py re-measures
        check = evaluate(model, tok, EvalConfig(tasks=["wikitext"], limit=CHECK_LIMIT))["wikitext"]
    out["check"] = {"task": "wikitext", "limit": CHECK_LIMIT, "word_perplexity": check["word_perplexity"]}
    return out


def measure_routing(model_path: str, mirror: str) -> dict:
    """The routing part of a card only (``routing`` and ``reference``), for ``--routing-only``."""
    return _routing_part(*_load(model_path, mirror))


def render_compare(card: dict) -> list[str]:
    """This model's routing beside the real model's of its family (popularity skew, co-selection, locality)."""
    r, ref = card["routing"], card.get("reference")
    lines = []
    real = measured_locality(r["num_experts"], r["top_k"])
    mean = sum(r["temporal_overlap"]) / len(r["temporal_overlap"])
    if real:
        lines += ["| token-to-token locality | this model | " + real["model"] + " |", "|---|---|---|",
                  f"| mean over layers | {mean:.3f} | {real['mean']:.3f} |",
                  f"| lowest layer | {min(r['temporal_overlap']):.3f} | {real['min']:.3f} |",
                  f"| bound | mean within ±{LOCALITY_MEAN_TOL} of {real['mean']}, no layer below {LOCALITY_FLOOR} | "
                  f"{real['source']} |", ""]
    c = r.get("compare")
    if ref and c:
        lines += [f"| routing vs {ref['model']} (real, {ref['tokens']:,} tokens of {', '.join(ref['domains'])}) "
                  f"| this model | real |", "|---|---|---|"]
        for i, (mine, theirs) in enumerate(zip(c["skew"], ref["skew"])):
            lines += [f"| layer {c['layers'][i]} (real {ref['layers'][i]}): usage entropy / log E "
                      f"| {mine['entropy_ratio']:.3f} | {theirs['entropy_ratio']:.3f} |",
                      f"| layer {c['layers'][i]} (real {ref['layers'][i]}): most / least used expert's share × E "
                      f"| {mine['max_share_x_E']:.2f} / {mine['min_share_x_E']:.2f} "
                      f"| {theirs['max_share_x_E']:.2f} / {theirs['min_share_x_E']:.2f} |"]
        for i, (mine, theirs) in enumerate(zip(c["co_selection_nmi"], ref["co_selection_nmi"])):
            a, b = c["layer_pairs"][i]
            ra, rb = ref["layer_pairs"][i]
            lines.append(f"| co-selection layers {a}→{b} (real {ra}→{rb}): NMI of rank-aligned pairs "
                         f"| {mine:.3f} | {theirs:.3f} |")
        lines.append("")
    return lines


def render(card: dict, summary: dict) -> str:
    """The measured part of the model card, as markdown tables."""
    r = card["routing"]
    lines = ["| layer | expert-usage entropy / log E | dead experts | top-k overlap with previous token |",
             "|---|---|---|---|"]
    for i, layer in enumerate(r["layers"]):
        lines.append(f"| {layer} | {r['entropy_ratio'][i]:.3f} | {r['dead_fraction'][i]:.1%} "
                     f"| {r['temporal_overlap'][i]:.3f} |")
    lines += ["", f"Measured on the first {r['tokens']:,} tokens of WikiText-2 test; independent routing would "
                  f"overlap k/E = {r['random_overlap']:.3f}.", "", *render_compare(card),
              "| task | limit | metric | value |", "|---|---|---|---|"]
    for task, metrics in card["tasks"].items():
        limit = card["limits"].get(task)
        for k, v in metrics.items():
            if k != "sample_len" and not k.endswith("_stderr"):
                lines.append(f"| {task} | {limit if limit is not None else 'full'} ({int(metrics['sample_len'])} docs) "
                             f"| {k} | {v:.4g} |")
    c = summary["corpus"]
    lines += ["", "| training | value |", "|---|---|",
              f"| parameters | {summary['params']:,} |",
              f"| corpus (train / held-out docs) | {c['train_docs']:,} / {c['valid_docs']:,} |",
              f"| corpus tokens (train / held-out) | {c['train_tokens']:,} / {c['valid_tokens']:,} |",
              f"| steps x batch x seq | {summary['steps']} x {summary['batch_size']} x {summary['seq_len']} "
              f"({summary['train_tokens_seen']:,} tokens) |",
              f"| final train loss (mean of last 20 steps) | {summary['final_train_loss']:.3f} |",
              f"| final held-out loss | {summary['final_valid_loss']:.3f} |"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    from ..errors import ArgumentParser

    ap = ArgumentParser(prog="specmd card", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specmd:tiny-olmoe")
    ap.add_argument("--mirror", default=None, help="data mirror (default: $SPECMD_DATA_MIRROR)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None, help="also write the card's tables (needs --summary)")
    ap.add_argument("--summary", default=None, help="train_summary.json written by specmd.commands.train")
    ap.add_argument("--routing-only", action="store_true",
                    help="re-measure only the routing part of the card --out (keeps its task scores)")
    ap.add_argument("--limits", default='{"wikitext": null, "mmlu": 10, "gsm8k": 50, "truthfulqa": null, "nq_open": 200}',
                    help="JSON: task -> eval.limit (null = full task)")
    args = ap.parse_args(argv)
    import os

    from ..errors import ConfigError
    from ..results import writable_dir, write_text_atomic

    try:
        limits = json.loads(args.limits)
    except ValueError as exc:
        raise ConfigError(f"--limits {args.limits!r} is not JSON ({exc}); e.g. "
                          "'{\"wikitext\": null, \"mmlu\": 10}'") from None
    if not isinstance(limits, dict):
        raise ConfigError(f"--limits {args.limits!r}: a JSON object task -> eval.limit")
    if args.routing_only and not (args.out and Path(args.out).is_file()):
        raise ConfigError(f"--routing-only re-measures the routing part of an existing card: --out {args.out} "
                          "names no card file")
    if args.markdown and not (args.summary and Path(args.summary).is_file()):
        raise ConfigError(f"--markdown needs --summary, the train_summary.json of specmd train (got {args.summary})")
    for option in ("out", "markdown"):  # before minutes of measuring
        path = getattr(args, option)
        if path:
            if Path(path).is_dir():
                raise ConfigError(f"--{option} {path}: a directory; name the file to write")
            writable_dir(Path(path).parent, f"--{option} {path}")
    mirror = args.mirror or os.environ.get("SPECMD_DATA_MIRROR")
    if args.routing_only:
        card = {**json.loads(Path(args.out).read_text()), **measure_routing(args.model, mirror)}
    else:
        card = measure(args.model, mirror, limits)
    text = json.dumps(card, indent=2)
    if args.out:
        write_text_atomic(Path(args.out), text + "\n")
    if args.markdown:
        write_text_atomic(Path(args.markdown), render(card, json.loads(Path(args.summary).read_text())))
    print(text)


if __name__ == "__main__":  # python -m specmd.commands.card: specmd card, with its one error path
    import sys

    from ..ending import guarded

    sys.exit(guarded("specmd card", main, sys.argv[1:]))
