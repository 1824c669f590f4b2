"""Measure what a model card reports: routing statistics and task scores.

    python -m specmd.modelcard --model specmd:tiny-olmoe --out card.json

Routing statistics are measured on WikiText-2 *test* text (measurement only; never trained on), per MoE
layer, from the router's own top-k:
* ``entropy_ratio`` — entropy of the expert-usage distribution divided by log(E) (1 = perfectly balanced);
* ``dead_fraction`` — fraction of experts never selected;
* ``temporal_overlap`` — mean |topk(t) ∩ topk(t-1)| / k over consecutive tokens of a sequence (the
  locality cache-aware routing exploits); ``random_overlap`` = k/E is what independent routing would give.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

CHECK_LIMIT = 2

@torch.no_grad()
def routing_stats(model, tokenizer, texts: list[str], window: int = 512, max_tokens: int = 65536) -> dict:
    from .models.adapters import adapter_for

    adapter = adapter_for(model.config.model_type)
    geom = adapter.geometry(model)
    routers = [adapter.router(model, i) for i in geom.layer_ids]
    E, k = geom.num_experts, geom.top_k
    counts = torch.zeros(len(routers), E, dtype=torch.long)
    overlap_sum = torch.zeros(len(routers), dtype=torch.float64)
    overlap_n = 0
    captured: list = [None] * len(routers)
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[2]))
             for i, r in enumerate(routers)]
    ids = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    ids = torch.tensor(ids[:max_tokens])
    try:
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start: start + window].unsqueeze(0)
            if chunk.shape[1] < 2:
                break
            model(chunk)
            for i, idx in enumerate(captured):  # [T, k]
                counts[i] += torch.bincount(idx.reshape(-1), minlength=E)
                hit = (idx[1:].unsqueeze(-1) == idx[:-1].unsqueeze(-2)).any(-1).sum(-1)  # [T-1]
                overlap_sum[i] += hit.double().sum() / k
            overlap_n += chunk.shape[1] - 1
    finally:
        for h in hooks:
            h.remove()
    p = counts.double() / counts.sum(-1, keepdim=True)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(E)
    return {
        "tokens": int(len(ids)),
        "num_experts": E,
        "top_k": k,
        "layers": geom.layer_ids,
        "entropy_ratio": [round(float(x), 4) for x in ent],
        "dead_fraction": [float((c == 0).sum()) / E for c in counts],
        "temporal_overlap": [round(float(x) / overlap_n, 4) for x in overlap_sum],
        "random_overlap": k / E,
    }


def wikitext_test_pages(mirror) -> list[str]:
    """WikiText-2 test articles from the mirror, as lm-eval presents them (detokenized)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from .eval.mirror import _wikitext

    return [wikitext_detokenizer(r) for r in _wikitext(mirror, "wikitext-2-raw-v1")["test"]]


def measure(model_path: str, mirror: str, limits: dict, max_gen_toks: int = 64) -> dict:
    from .eval.harness import EvalConfig, evaluate
    from .eval.mirror import mirrored, resolve_mirror, set_offline
    from .models.loader import ModelConfig, load_model, resolve_pretrained

    set_offline()
    root = resolve_mirror(mirror)
    family = json.loads((Path(resolve_pretrained(model_path)) / "config.json").read_text())["model_type"]
    model, tok = load_model(ModelConfig(name="card", family=family, pretrained=model_path, dtype="float32"))
    out = {"routing": routing_stats(model, tok, wikitext_test_pages(root)), "tasks": {}, "limits": limits}
    with mirrored(root):
        for task, limit in limits.items():
            res = evaluate(model, tok, EvalConfig(tasks=[task], limit=limit, max_gen_toks=max_gen_toks))
            out["tasks"][task] = res[task]
        # the fixed slice tests/test_embedded.py re-measures
        check = evaluate(model, tok, EvalConfig(tasks=["wikitext"], limit=CHECK_LIMIT))["wikitext"]
    out["check"] = {"task": "wikitext", "limit": CHECK_LIMIT, "word_perplexity": check["word_perplexity"]}
    return out


def render(card: dict, summary: dict) -> str:
    """The measured part of the model card, as markdown tables."""
    r = card["routing"]
    lines = ["| layer | expert-usage entropy / log E | dead experts | top-k overlap with previous token |",
             "|---|---|---|---|"]
    for i, layer in enumerate(r["layers"]):
        lines.append(f"| {layer} | {r['entropy_ratio'][i]:.3f} | {r['dead_fraction'][i]:.1%} "
                     f"| {r['temporal_overlap'][i]:.3f} |")
    lines += ["", f"Measured on the first {r['tokens']:,} tokens of WikiText-2 test; independent routing would "
                  f"overlap k/E = {r['random_overlap']:.3f}.", "",
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specmd:tiny-olmoe")
    ap.add_argument("--mirror", default=None, help="data mirror (default: $SPECMD_DATA_MIRROR)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None, help="also write the card's tables (needs --summary)")
    ap.add_argument("--summary", default=None, help="train_summary.json written by specmd.train")
    ap.add_argument("--limits", default='{"wikitext": null, "mmlu": 10, "gsm8k": 50, "truthfulqa": null, "nq_open": 200}',
                    help="JSON: task -> eval.limit (null = full task)")
    args = ap.parse_args()
    import os

    card = measure(args.model, args.mirror or os.environ.get("SPECMD_DATA_MIRROR"), json.loads(args.limits))
    text = json.dumps(card, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.markdown:
        Path(args.markdown).write_text(render(card, json.loads(Path(args.summary).read_text())))
    print(text)


if __name__ == "__main__":
    main()
