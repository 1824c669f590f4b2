"""Registries: one per policy family. A policy registers its class under its name; its config file
``specmd/conf/<family>/<name>.yaml`` carries ``name: <name>`` plus the keys of the class's ``Params`` dataclass.

Adding a policy = one new module in ``specmd/policies/<family>/`` and one yaml in ``specmd/conf/<family>/``:
modules in a family package are imported automatically, nothing else needs an edit.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import types
import typing
from typing import Any, Callable, ClassVar, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Plugin:
    """What every registered class shares (policies, quantization methods, executors): its registry name
    and its ``Params`` schema (the keys of its config file besides ``name``)."""

    name: ClassVar[str]  # set by Registry.register
    Params: ClassVar[Any] = None  # optional dataclass

    def __init__(self, params: Any = None):
        self.params = params


def import_modules(package: str) -> None:
    """Import every module of ``package``: what they register at import is then registered."""
    pkg = importlib.import_module(package)
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{mod.name}")


class Registry(Generic[T]):
    def __init__(self, family: str, package: str):
        self.family = family
        self.package = package
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, target: "type[T] | str") -> Any:
        """``FAMILY.register(Cls)``: registers ``Cls`` under the name its class body gives (``name = "lru"``),
        the one style of every built-in policy in all four families (a statement after the class: Cython
        takes no decorator on an extension type, and a compiled policy is one). ``@FAMILY.register("name")``
        on a plain Python class (a user's file, a test) also sets ``name``."""
        if isinstance(target, str):
            return lambda cls: self._add(target, cls)
        name = target.__dict__.get("name")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.family} policy {target.__qualname__} names itself in its class body "
                            f"(name = '...') before it registers")
        return self._add(name, target)

    def _add(self, name: str, cls: type[T]) -> type[T]:
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.family} policy {name!r} registered twice")
        if cls.__dict__.get("name") != name:
            try:
                cls.name = name
            except TypeError:  # an extension type (a compiled policy): its attributes are fixed
                raise TypeError(f"{self.family} policy {cls.__qualname__} is an extension type, whose "
                                f"attributes cannot be set after its class statement: name it in its class "
                                f"body (name = {name!r})") from None
        self._classes[name] = cls
        return cls

    def _load(self) -> None:
        if not self._loaded:
            import_modules(self.package)
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


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "a mapping"}


def check_type(val: Any, want: Any, where: str) -> Any:
    """``val`` checked against a dataclass field's annotation (``bool``, ``int``, ``float``, ``str``,
    ``list``, ``Optional[...]``, ``Union[...]``); an int is widened to a float field. No ``bool("maybe")``,
    no string iterated as a list: a wrong type is a ConfigError naming the key, the value and what it takes."""
    if want is None or want is Any:
        return val
    origin = typing.get_origin(want)
    if origin is typing.Union or (types.UnionType is not None and isinstance(want, types.UnionType)):
        options = typing.get_args(want)
        if val is None and type(None) in options:
            return None
        if isinstance(val, float) and float in options:
            check_finite(val, where)
        if val == "" and str in options and type(None) in options:  # a path or a name: '' is neither
            raise ConfigError(f"{where}='' is empty: give a value, or null for none")
        for opt in options:
            if opt is type(None):
                continue
            try:
                return check_type(val, opt, where)
            except ConfigError:
                continue
        names = [("null" if o is type(None) else _NAMES.get(typing.get_origin(o) or o, str(o))) for o in options]
        raise ConfigError(f"{where}={val!r} must be {' or '.join(names)}")
    base = origin or want
    if not isinstance(base, type):
        return val
    if base is float and isinstance(val, int) and not isinstance(val, bool):
        return float(val)
    ok = isinstance(val, base) and not (base in (int, float) and isinstance(val, bool))
    if not ok:
        hint = f" (e.g. {where}=[{val}])" if base is list and isinstance(val, str) else ""
        raise ConfigError(f"{where}={val!r} must be {_NAMES.get(base, base.__name__)}{hint}")
    if base is float:
        check_finite(val, where)
    elif base is list and typing.get_args(want):  # list[str]: each item too, named by its position
        (item,) = typing.get_args(want)
        return [check_type(v, item, f"{where}[{i}]") for i, v in enumerate(val)]
    return val


def check_finite(val: float, where: str) -> float:
    """A number read from the user is finite: NaN compares false with every bound (``nan > 0`` and
    ``nan < 0`` are both false, so a range check lets it through) and an infinite bandwidth or rate turns
    every time into 0 or inf. Hydra parses ``nan``, ``inf`` and ``-inf`` as floats, so they arrive here."""
    if not math.isfinite(val):
        raise ConfigError(f"{where}={val} must be a finite number (NaN and +/-inf are not valid settings)")
    return val


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
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for key, val in values.items():
        name = key.rstrip("_")
        label = f"{where}: {name}" if "=" in where else f"{where}.{name}"  # eviction=lfu: history / eval.tasks
        kwargs[key] = check_type(val, hints.get(key), label)
    try:
        return schema(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
