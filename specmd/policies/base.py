"""What every policy class shares: its registry name, its ``Params`` schema and the ``setup`` hook."""

from __future__ import annotations

from typing import Any, ClassVar


class Policy:
    name: ClassVar[str]  # set by Registry.register
    Params: ClassVar[Any] = None  # optional dataclass: the keys of conf/<family>/<name>.yaml besides `name`
    needs_future: ClassVar[bool] = False  # oracles: only a trace replay can run them

    def __init__(self, params: Any = None):
        self.params = params

    def setup(self, model: Any) -> None:
        """Called once with the :class:`~specmd.engine.ModelView` when the engine is built."""


def check_choice(name: str, value: Any, choices) -> None:
    """A reading parameter must be one of ``choices``: else a ValueError naming the value and the choices
    (the registry turns it into a ConfigError before any model work)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}; valid: {', '.join(choices)}")
