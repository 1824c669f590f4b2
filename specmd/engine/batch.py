"""What a batch is to the engine (docs/semantics.md "Batches and concurrency"): the two rules both drivers
share -- a batched pass's context, and the union of experts that independent routing would touch.

A batched forward pass is one step over the *live* tokens of several sequences: pad positions and
sequences that already finished are no requests. The live hook (:mod:`specmd.hook.live`) and the replay's
batch composer (:mod:`specmd.replay.batching`) both hand the engine a pass of live tokens only, whose
``context`` is :func:`batched_context`. Nothing here imports a model.
"""

from __future__ import annotations


def batched_context(tokens, contexts) -> int:
    """The ``context`` of a pass over several sequences: the token-weighted mean of their contexts,
    ``round(sum_i t_i * c_i / sum_i t_i)`` (halves up, in integers: exact), for ``t_i`` live tokens of
    sequence ``i`` in the pass and ``c_i`` its context (its own tokens before this pass plus the pass's).

    Why the weighted mean: the clock's attention term is ``4 * tokens * context * hidden`` FLOPs per layer
    (:class:`~specmd.engine.simclock.SimClock`), which over a batch must be the sum of each sequence's own
    ``4 * t_i * c_i * hidden`` -- a serving engine that does not pad attends each sequence over its own
    context, not over the longest one. With ``tokens = sum_i t_i`` that is exactly this mean (up to the
    rounding to a whole token, which a trace's integer pass record needs). One sequence: its own context,
    so a batch-1 pass is unchanged. Sequences with no live token do not count; no live token at all: 0."""
    num = den = 0
    for t, c in zip(tokens, contexts):
        t, c = int(t), int(c)
        num += t * c
        den += t
    if den <= 0:
        return 0
    return (2 * num + den) // (2 * den)


def independent_union(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts a layer call of ``tokens`` tokens touches when every token picks its top-k
    independently and uniformly: ``n * (1 - (1 - k/n) ** b)``. The line the measured union is drawn
    against (a 64-expert top-8 layer: 66% of its experts at b = 8, 99% at b = 32); a measured union
    below it is requests sharing experts."""
    n, k = float(num_experts), float(top_k)
    if n <= 0 or tokens <= 0:
        return 0.0
    return n * (1.0 - (1.0 - k / n) ** float(tokens))
