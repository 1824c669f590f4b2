"""Which positions of a forward pass are requests: the live tokens of a batch (docs/semantics.md "Batches and
concurrency").

A batched forward pass computes positions that no serving engine would: the **left padding** of the shorter
prompts of a generation batch, the **right padding** of the shorter windows of a scoring batch, and every
row of a sequence that has **finished** while the others still generate (transformers' ``generate`` runs
the whole batch until every sequence stops). None of them is a request: not counted, not fetched, not timed
(the engine sees the live rows only); what the executors compute there is said in
:mod:`specmd.executor.base` (``full_selection``).

Who knows what:

* the decoder's own ``attention_mask`` (2-D ``[B, past + S]``, 0 = pad), which ``generate`` passes on every
  step, marks left padding;
* the driver that builds a batch says the rest, through the stack's :class:`LiveTokens` (``stack.live``):
  :meth:`LiveTokens.expect` -- the live positions of the next forward pass (right padding of a scoring
  batch, one column of it per token-by-token step) -- and :meth:`LiveTokens.finish` -- the sequences that
  have stopped, whose decode rows are no requests until the next prefill. specmd's lm-eval model
  (:mod:`specmd.eval.harness`) does both; a user's own loop may too.

A pass with every position live costs nothing here (no host read of the mask at batch 1, no index).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..engine.batch import batched_context
from ..errors import ConfigError


class LivePass:
    """One forward pass's live positions, as the hook uses them: ``rows`` (host long ``[n]``, the live rows of
    the flattened ``[B * S]`` input, ascending) or None when every position is live; ``tokens`` (live tokens)
    and ``context`` (:func:`~specmd.engine.batch.batched_context` over the live sequences); ``contexts``: each
    live sequence's own context (its KV cache: a paged server's, no pads; a finished sequence holds none)."""

    __slots__ = ("rows", "tokens", "context", "contexts")

    def __init__(self, rows: Optional[torch.Tensor], tokens: int, context: int, contexts: list):
        self.rows = rows
        self.tokens = tokens
        self.context = context
        self.contexts = contexts


class LiveTokens:
    """The live-position state of one installed stack (``stack.live``)."""

    def __init__(self):
        self._expect: Optional[torch.Tensor] = None  # [B, S] bool for the next pass only
        # tokens the decode passes of one-sequence generations produced (the harness counts them from each
        # generation's output): a speculative run's accepted tokens (eval.speculative)
        self.generated = 0
        self._finished: Optional[torch.Tensor] = None  # [B] bool, until the next prefill

    def expect(self, positions) -> None:
        """The next forward pass's live positions: ``[B, S]`` bool (True = a request). Consumed by that pass."""
        positions = torch.as_tensor(positions).to("cpu", torch.bool)
        if positions.dim() != 2:
            raise ValueError(f"LiveTokens.expect: a [batch, seq] mask, got shape {tuple(positions.shape)}")
        self._expect = positions

    def finish(self, finished) -> None:
        """Sequences of the running generation that have stopped (``[B]`` bool, True = finished): their rows
        are no requests in the decode passes that follow, until the next prefill."""
        finished = torch.as_tensor(finished).to("cpu", torch.bool).reshape(-1)
        self._finished = finished

    def reset(self) -> None:
        self._expect = self._finished = None

    def begin(self, batch: int, seq: int, past: int, attention_mask) -> LivePass:
        """The live positions of a pass of ``batch`` sequences of ``seq`` new positions after ``past`` cached
        ones; ``attention_mask``: the decoder's (None, or a tensor: 2-D ``[B, past + S]`` marks pads)."""
        expect, self._expect = self._expect, None
        if past == 0:  # a prefill starts a new batch: no sequence has finished
            self._finished = None
        finished = self._finished
        if batch == 1 and expect is None and finished is None:  # one sequence: nothing is padded
            return LivePass(None, seq, past + seq, [past + seq])
        live = None  # [B, S] bool
        if expect is not None:
            if tuple(expect.shape) != (batch, seq):
                raise ConfigError(f"the live positions given for the next pass are {tuple(expect.shape)}; the pass "
                                  f"is [{batch}, {seq}] (batch, positions)")
            live = expect
        past_i = None  # [B] live positions before this pass, per sequence
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
                and tuple(attention_mask.shape) == (batch, past + seq):
            # read on the host once per pass, never per layer call (a copy even on a CPU device: what the layer
            # calls index with is host memory, as on a GPU; benchmarks/counting.py's B=8 rows)
            mask = attention_mask.to("cpu", copy=True).bool()
            cur = mask[:, past:]
            live = cur if live is None else live & cur
            past_i = mask[:, :past].sum(1)
        if finished is not None and past > 0:
            if finished.numel() != batch:
                raise ConfigError(f"{finished.numel()} finished flags given for a pass of {batch} sequences")
            gone = finished.unsqueeze(1)
            live = ~gone.expand(batch, seq) if live is None else live & ~gone
        if live is None:
            return LivePass(None, batch * seq, past + seq, [past + seq] * batch)
        t = live.sum(1)  # [B] live tokens per sequence
        c = (past_i if past_i is not None else torch.full((batch,), past)) + t
        tokens = int(t.sum())
        t, c = t.tolist(), c.tolist()
        context = batched_context(t, c)
        contexts = [ci for ti, ci in zip(t, c) if ti > 0]
        if tokens == batch * seq:
            return LivePass(None, tokens, context, contexts)
        return LivePass(live.reshape(-1).nonzero().squeeze(1), tokens, context, contexts)
