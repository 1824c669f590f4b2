"""Executors carry out what the engine decided (the ``execution`` config group).

``simulated`` (default): the whole model stays on the device; only the engine's accounting says what a cache
would hold. ``offload``: expert weights live only in a host tier (``ram`` or ``disk``), the device holds the
dense weights and one pre-allocated expert arena of exactly the configured capacity, and every insert,
eviction, prefetch and demand fetch the engine decides is a real copy (:mod:`.offload`). Neither decides a
cache question: both follow the cache manager's events and the layer call's
:class:`~specmd.engine.outcomes.Execution`.
"""

from .base import EXECUTION, Executor

__all__ = ["EXECUTION", "Executor"]
