"""The GPU-cost proxy (:mod:`specmd.counting`) on a generation through the live driver: what the tests pin and
``benchmarks/counting.py`` prints."""

from __future__ import annotations

import torch

from ..counting import Counting, count_layer_calls
from .stack import install


def count_generation(model, adapter, spec, ids: torch.Tensor, new_tokens: int, attention_mask=None) -> Counting:
    """A greedy generation of ``new_tokens`` from ``ids`` counted per MoE layer call, through the policy stack
    ``spec`` (a :class:`~specmd.engine.StackSpec`; None: the unhooked model); ``attention_mask``: a batch's
    left padding (0 = pad), as a serving batch has it."""
    blocks = [adapter.block(model, i) for i in adapter.moe_layers(model)]

    def gen():
        with torch.no_grad():
            model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False)

    stack = install(model, spec, adapter) if spec is not None else None
    try:
        return count_layer_calls(blocks, gen)
    finally:
        if stack is not None:
            stack.remove()
