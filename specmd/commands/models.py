"""``specmd models [--json]``: every MoE model family of the installed transformers, and whether specmd runs it.

One row a family (a causal-LM or image-text-to-text class whose text config names experts,
:func:`specmd.models.derive.moe_families`, plus the families with a record): ``runs`` -- through its record
(``record``), its structure derived from transformers' own classes (``derived``), or as the text family a
wrapper's checkpoint loads (``as <family>``) -- or ``refused`` with the reason (the step of the derivation it
fails: a block at ``layer.feed_forward``, a router that takes more than the hidden states, ...). Beside it:
the checkpoint its transformers config class's docstring links (usually the real model whose configuration
the class defaults are; now and then a test checkpoint: check the size columns), the MoE layers, experts and
top-k of those defaults, the selection rule every policy ranks by (the score
function, a selection bias, a group limit, renormalisation, a scale field), and whether a real-sized
configuration is at hand for ``hardware.timing_as=<family>`` (a family that runs and whose config class's
defaults build a model on the meta device) and for the random checkpoint writer (the hub layout transformers'
conversion mapping declares for it).

``--json`` prints the rows as a JSON list (for scripts); the table is the same rows. Deriving the families
takes ~0.1 s each (a tiny random instance of each, on the CPU) and the sizes a meta-device build each:
~15 s for the whole table on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Optional

from ..errors import ArgumentParser, ConfigError


def rows() -> list[dict]:
    """The table's rows, families sorted by name."""
    from ..models.adapters import ADAPTERS
    from ..models.derive import derive, moe_families

    out = []
    for family in sorted(set(moe_families()) | set(ADAPTERS)):
        adapter, reason, source, bias, hashed = ADAPTERS.get(family), None, "record", None, False
        if adapter is None:
            d = derive(family)
            adapter, reason, source, bias = d.adapter, d.reason, f"as {d.runs_as}" if d.runs_as else "derived", d.bias
            hashed = d.hashed
        out.append(_row(family, adapter, reason, source if adapter is not None else None, bias, hashed))
    return out


def _row(family: str, adapter, reason: Optional[str], source: Optional[str], bias: Optional[bool],
         hashed: bool = False) -> dict:
    from ..models.derive import real_model

    row = {"family": family, "runs": adapter is not None, "through": source, "refused_because": reason,
           "real_model": real_model(family), "moe_layers": None, "experts": None, "top_k": None,
           "selection": None, "timing_as": False, "random_checkpoint": bool(adapter and adapter.hub_layout())}
    if adapter is None:
        return row
    geometry = _real_geometry(family)
    if geometry is not None:  # (what hardware.timing_as=<family> times with)
        row.update(moe_layers=geometry.num_layers, experts=geometry.num_experts, top_k=geometry.top_k, timing_as=True)
    if bias is None:  # a record: the bias is whatever its loaded routers hold (DeepSeek-V3's do)
        bias = _router_has(family)
    rule = [adapter.score]
    if bias:
        rule.append("selection bias" + (" on logits" if adapter.bias_on_logits else ""))
    if adapter.group_score:
        rule.append(f"group-limited ({adapter.group_score})" + (f" if {adapter.groups_if[0]}={adapter.groups_if[1]}"
                                                                 if adapter.groups_if else "")
                    + (f", left-out groups {adapter.group_fill:g}" if adapter.group_fill != float("-inf") else ""))
    if hashed:
        rule.append("hash-routed layers")
    rule.append(f"renorm={adapter.renorm}")
    if adapter.scale_attr:
        rule.append(f"scale={adapter.scale_attr}")
    if adapter.weight_scale_attr:
        rule.append(f"per-expert scale={adapter.weight_scale_attr}")
    if adapter.experts_layout.input_weighted:
        rule.append("input-weighted experts")
    if adapter.identity_attr:
        rule.append(f"identity experts={adapter.identity_attr}")
    if adapter.reweigh_note:
        rule.append("own rule (reweigh_note)")
    row["selection"] = ", ".join(rule)
    return row


@functools.lru_cache(maxsize=None)
def _real_geometry(family: str):
    """The geometry of the family's config class defaults (meta device), or None where they do not build."""
    from ..models.loader import shipped_geometry

    try:
        return shipped_geometry(family)
    except ConfigError:  # defaults that do not build a model: the row says nothing of its size
        return None


@functools.lru_cache(maxsize=None)
def _router_has(family: str) -> bool:
    """Whether the family's router holds a selection bias (its tiny instance's)."""
    from ..models.adapters import adapter_for
    from ..models.loader import build_tiny

    adapter = adapter_for(family)
    model = build_tiny(family)
    return getattr(adapter.bias_holder(model, adapter.moe_layers(model)[0]), adapter.bias_attr, None) is not None


def table(rs: list[dict]) -> str:
    runs = sum(r["runs"] for r in rs)
    head = f"{runs} of {len(rs)} MoE families of the installed transformers run"
    lines = [head, ""]
    w = max(len(r["family"]) for r in rs)
    t = max(len(f"runs ({r['through']})") for r in rs if r["runs"]) if runs else len("refused")
    for r in rs:
        if r["runs"]:
            size = f"{r['moe_layers']}x{r['experts']} top-{r['top_k']}" if r["experts"] else "?"
            lines.append(f"{r['family']:<{w}}  {'runs (' + r['through'] + ')':<{t}}  {size:<16} "
                         f"{r['real_model'] or '-'}  [{r['selection']}]")
        else:
            lines.append(f"{r['family']:<{w}}  {'refused':<{t}}  {r['refused_because']}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = ArgumentParser(prog="specmd models", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="the rows as JSON (for scripts)")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    rs = rows()
    if not rs:
        raise ConfigError("the installed transformers has no MoE family")
    print(json.dumps(rs, indent=1) if args.json else table(rs), file=sys.stdout)
    return 0


if __name__ == "__main__":  # python -m specmd.commands.models: specmd models, with its one error path
    from ..ending import guarded

    sys.exit(guarded("specmd models", main, sys.argv[1:]))
