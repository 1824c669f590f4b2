"""Registries: one per policy family. A policy registers its class under its name; its config file
``conf/<family>/<name>.yaml`` carries ``name: <name>`` plus the keys of the class's ``Params`` dataclass.

Adding a policy = one new module in ``specmd/policies/<family>/`` and one yaml in ``conf/<family>/``:
modules in a family package are imported automatically, nothing else needs an edit.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, family: str, package: str):
        self.family = family
        self.package = package
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.family} policy {name!r} registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def _load(self) -> None:
        if not self._loaded:
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{self.package}.{mod.name}")
            self._loaded = True

    def names(self) -> list[str]:
        self._load()
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        self._load()
        if name not in self._classes:
            raise ConfigError(
                f"unknown {self.family} policy {name!r}; valid choices: {', '.join(self.names())}"
            )
        return self._classes[name]

    def params(self, cfg: Any) -> tuple[type[T], Any]:
        """Validate a group config (mapping with ``name`` + params) against the class's Params."""
        cfg = dict(cfg or {})
        name = cfg.pop("name", None)
        if name is None:
            raise ConfigError(f"{self.family} config has no 'name'; valid choices: {', '.join(self.names())}")
        cls = self.get(name)
        return cls, build_params(getattr(cls, "Params", None), cfg, f"{self.family}={name}")

    def build(self, cfg: Any, **kwargs: Any) -> T:
        cls, params = self.params(cfg)
        return cls(params, **kwargs)


def build_params(schema: type | None, values: dict, where: str) -> Any:
    """Instantiate a Params dataclass from a mapping, rejecting unknown keys and wrong types by name."""
    if schema is None:
        if values:
            raise ConfigError(f"{where} takes no parameters, got {sorted(values)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(schema)}
    # Python keywords (the paper's ``lambda``) are spelled with a trailing underscore in the dataclass.
    values = {(k + "_" if k not in fields and k + "_" in fields else k): v for k, v in values.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown parameter(s) {unknown}; valid: {sorted(f.rstrip('_') for f in fields)}")
    kwargs = {}
    for key, val in values.items():
        want = fields[key].type
        want = want if isinstance(want, type) else {"int": int, "float": float, "str": str, "bool": bool}.get(
            str(want), None
        )
        if want is float and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if want is not None and val is not None and not isinstance(val, want):
            raise ConfigError(f"{where}: {key}={val!r} must be {want.__name__}")
        kwargs[key] = val
    try:
        return schema(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
