"""What every policy class shares: its registry name and ``Params`` schema (:class:`~specmd.registry.Plugin`:
the keys of specmd/conf/<family>/<name>.yaml besides ``name``) and the ``setup`` hook."""

from __future__ import annotations

from typing import Any, ClassVar

from ..registry import Plugin


class Policy(Plugin):
    needs_future: ClassVar[bool] = False  # oracles: only a trace replay can run them
    # reads its layer call's router logits or probabilities (``record.logits``/``probs``): a live run reads them
    # back with the routing (one synchronisation). False only where the policy never does: a policy that reads
    # them anyway still gets them, for a second read-back per layer call (tests count them)
    reads_logits: ClassVar[bool] = True

    def setup(self, model: Any) -> None:
        """Called once with the :class:`~specmd.engine.ModelView` when the engine is built."""

    @classmethod
    def model_errors(cls, params: Any, model: Any) -> list[str]:
        """What is wrong with ``params`` for this model (``model``: its
        :class:`~specmd.engine.geometry.Geometry`), each message naming ``key=value`` and the valid range.
        The engine asks as soon as the geometry is known, before any forward pass, and reports every
        policy's together (a top-``J`` it checks itself, for every policy that has one). A setting bounded
        by the model (a depth by its layers, a count by its experts or top-k) belongs here, not clamped
        silently in ``setup``."""
        return []


def memory_errors(setting: str, nbytes: int) -> list[str]:
    """A setting whose state takes ``nbytes`` (a window of n steps per layer and expert): more than half of
    this machine's memory is an error naming the setting and both sizes, before anything is allocated (a
    window of 10^9 steps is a typo that would end in a MemoryError mid-run, or in swapping)."""
    import os

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound known
        return []
    if nbytes <= ram // 2:
        return []
    return [f"{setting} needs {nbytes / 2**30:,.1f} GiB for its state, more than half of this machine's "
            f"{ram / 2**30:,.1f} GiB of memory"]


def check_choice(name: str, value: Any, choices) -> None:
    """A reading parameter must be one of ``choices``: else a ValueError naming the value and the choices
    (the registry turns it into a ConfigError before any model work)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}; valid: {', '.join(choices)}")


def ranked_by_score(probs: Any, index: Any) -> Any:
    """``[T, k]``: ``index`` (experts selected per token) ordered by descending ``probs`` [T, E] -- pass the
    record's selection scores (``record.scores``) for the router's ranks -- ties in their selection order
    (rank 0 = the top-1). Some routers return their top-k unsorted (DeepSeek-V2/V3:
    ``topk(sorted=False)``), so code that acts on a rank must not read the index's column order."""
    import torch

    order = torch.argsort(-probs.gather(-1, index), dim=-1, stable=True)
    return index.gather(-1, order)
