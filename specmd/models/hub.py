"""How a family's Hugging Face hub checkpoints name their tensors (:class:`HubLayout`: the MoE block, the router,
the per-expert projections transformers fuses on load), and the layout transformers' own weight conversions
declare for a model (:func:`declared_hub`): what the loader, the disk tier and the random checkpoint writer
read, through the family's :meth:`~specmd.models.family.Adapter.hub_layout`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_BLOCK = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.mlp\.(?P<rest>.*)$")  # a decoder layer's MoE block


@dataclass(frozen=True)
class HubLayout:
    """How a family's Hugging Face hub checkpoints name what transformers renames and fuses on load (and
    ``save_pretrained`` converts back): the MoE block (``mlp`` in transformers), the router when the hub
    calls it ``gate``, and the per-expert projections that transformers fuses into ``gate_up_proj``
    [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I]. One record serves both directions, so what the
    random checkpoint writer names (:meth:`to_hub`) is what loading (:meth:`from_hub`) and the disk tier
    (:meth:`expert_parts`) read."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    router: Optional[str] = None  # transformers' router module, when the hub calls it ``gate``
    # (hub, transformers) substrings of the other tensors transformers renames on load, in its order
    # (ERNIE-4.5's ``mlp.moe_statics.`` bias under ``mlp.gate.``, Hy3's ``mlp.router.gate.`` router; a prefix
    # when it starts with ``^``: Qwen3.5-MoE's ``^model.language_model.`` for ``^model.``)
    renames: tuple = ()

    def to_hub(self, name: str) -> str:
        """A transformers tensor name (not a fused expert tensor) under the hub's name."""
        for hub, ours in reversed(self.renames):
            if not hub.startswith("^"):  # (a prefix change is read, never written: transformers' save drops it)
                name = _renamed(name, ours, hub)
        m = _BLOCK.match(name)
        if m is None:
            return name
        rest = m["rest"]
        if self.router and rest.startswith(self.router + "."):
            rest = "gate." + rest[len(self.router) + 1:]
        return f"{m['pre']}.{self.block}.{rest}"

    def from_hub(self, name: str) -> str:
        """A hub tensor name (not a per-expert tensor) under transformers' name: the inverse of :meth:`to_hub`."""
        if self.block != "mlp":
            if self.router:
                name = name.replace(f".{self.block}.gate.", f".mlp.{self.router}.")
            name = name.replace(f".{self.block}.", ".mlp.")
        for hub, ours in self.renames:
            name = _renamed(name, hub, ours)
        return name

    def layer_prefixes(self, ours: str = "model.layers") -> tuple[str, ...]:
        """Where a checkpoint may keep the decoder layers transformers calls ``ours``: there, and under each
        prefix change it reads (Qwen3.5-MoE's hub checkpoints: ``model.language_model.layers``)."""
        return (ours,) + tuple(_renamed(ours, new, old) for old, new in self.renames
                               if old.startswith("^") and ours.startswith(new[1:]))

    def expert_parts(self, fused: str) -> tuple[str, ...]:
        """The hub's per-expert tensors (after ``experts.{e}.``) whose rows, concatenated in order, are expert
        ``e`` of transformers' fused parameter ``fused``; () when the hub keeps it fused too."""
        parts = {"gate_up_proj": (self.gate, self.up), "down_proj": (self.down,), "up_proj": (self.up,)}
        return tuple(f"{p}.weight" for p in parts.get(fused, ()))


FROM_TRANSFORMERS = "transformers"  # Adapter.hub: the layout transformers' own conversion mapping declares


def declared_hub(transforms) -> Optional[HubLayout]:
    """The :class:`HubLayout` that transformers' weight conversions for a model (``conversion_mapping``'s
    list for its family: ``get_model_conversion_mapping``) declare, or None where they declare none or more
    than it holds. It holds: the MoE block renamed to ``mlp`` (Mixtral's ``WeightRenaming(".block_sparse_moe.",
    ".mlp.")``), the router's ``gate`` renamed (Phi-3.5-MoE's ``.router``), and per-expert projections merged
    into ``gate_up_proj`` (``MergeModulelist(dim=0)`` then gate rows first: ``Concatenate(dim=1)``) and
    ``down_proj`` / ``up_proj`` (``MergeModulelist(dim=0)``)."""
    block, router, parts, renames = "mlp", None, {}, []
    for t in transforms:
        kind, src, dst = type(t).__name__, list(t.source_patterns), list(t.target_patterns)
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(t, "operations", None) or ()]
        if kind == "PrefixChange" and len(src) == len(dst) == 1:  # Qwen3.5-MoE's text weights under the wrapper's
            hub, ours = re.fullmatch(r"\^(.+)\(\.\+\)", src[0]), re.fullmatch(r"(.*)\\1", dst[0])  # language_model
            if hub is None or ours is None or _literal(hub[1]) is None or _literal(ours[1]) is None:
                return None
            renames.append(("^" + _literal(hub[1]), "^" + _literal(ours[1])))
            continue
        if kind == "WeightRenaming" and len(src) == len(dst) == 1:
            hub, ours = _literal(src[0]), _literal(dst[0])
            if hub is None or ours is None:
                return None  # a pattern, not a name
            renamed_router = re.fullmatch(r"\.(\w+)\.weight", ours)
            if re.fullmatch(r"\.\w+\.", hub) and ours == ".mlp.":
                block = hub[1:-1]
            elif hub == ".gate.weight" and renamed_router:
                router = renamed_router[1]
            else:
                renames.append((hub, ours))
            continue
        target = re.fullmatch(r"(?:mlp)?\.?experts\.(gate_up_proj|down_proj|up_proj)", dst[0]) if len(dst) == 1 else None
        names = [re.fullmatch(r"(?:mlp)?\.?experts\.\*\.(\w+)\.weight", x) for x in src]
        if kind != "WeightConverter" or target is None or not all(names):
            return None
        want = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if target[1] == "gate_up_proj" else [])
        if ops != want or len(names) != len(want):
            return None
        parts[target[1]] = [n[1] for n in names]
    if "down_proj" not in parts or not ({"gate_up_proj", "up_proj"} & set(parts)):
        return None
    gate, up = parts["gate_up_proj"] if "gate_up_proj" in parts else ("gate_proj", parts["up_proj"][0])
    return HubLayout(block=block, gate=gate, up=up, down=parts["down_proj"][0], router=router, renames=tuple(renames))


def _renamed(name: str, old: str, new: str) -> str:
    """``name`` with ``old`` replaced by ``new``: a ``^`` prefix only at its start (a prefix change)."""
    if old.startswith("^"):
        return new[1:] + name[len(old) - 1:] if name.startswith(old[1:]) else name
    return name.replace(old, new)


def _literal(pattern: str) -> Optional[str]:
    """The name a renaming pattern matches when it is one literal string (regex escapes undone), else None."""
    plain = re.sub(r"\\(.)", r"\1", pattern)
    return None if re.search(r"[\\^$*+?()\[\]{}|]", plain) else plain
