"""Reading back what specmd wrote: each file kind's schema, checked as it is read, so that a damaged, hand-edited
or older file is one line naming the file, the key and what was expected (:class:`~specmd.errors.DamagedFile`,
exit 2) -- never an ``AttributeError`` or ``KeyError`` deep in a command, counted as a bug.

A schema is a mapping of key -> spec: a type or a tuple of types (``bool`` is no ``int`` or ``float`` here, as
in the configs), a nested schema (the value must be a mapping, checked in turn), a :class:`Opt` (the key may be
absent or null), or a callable ``value -> None | "what was expected"``. Keys a schema does not name are left
alone (a newer specmd may write more). The kinds with their own home check their files with :func:`check`
there: a hardware profile's ``calibrated_on`` (:mod:`specmd.hardware`), calibrate's saved measurements
(``commands/calibrate/measure.py``), a trace's ``meta.json`` (:mod:`specmd.replay.trace`); a run's
``results.json`` and ``failed.json`` are read here. (A sweep's ``multirun.yaml`` and ``overrides.yaml`` are read by
:mod:`specmd.sweeps`, which turns any failure into a reason; ``.sweep.json`` by
:mod:`specmd.liveness`, where an unreadable one means "another process".)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import DamagedFile


class Opt:
    """A key that may be absent or null; when present, ``spec``."""

    __slots__ = ("spec",)

    def __init__(self, spec):
        self.spec = spec


def _name(spec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(_name(s) for s in spec)
    if isinstance(spec, type):
        return {dict: "a mapping", list: "a list", str: "a string", int: "an integer", float: "a number",
                bool: "true or false", type(None): "null"}.get(spec, spec.__name__)
    if isinstance(spec, dict):
        return "a mapping"
    return "a valid value"


def _is(value, spec) -> bool:
    if isinstance(spec, tuple):
        return any(_is(value, s) for s in spec)
    if spec in (int, float) and isinstance(value, bool):
        return False
    if spec is float:
        return finite(value)
    return isinstance(value, spec)


# ---- specs the schemas share (each a callable ``value -> None | "what was expected"``) ------------------------
def finite(value) -> bool:
    """A finite number (an int or a float, never a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def whole(low: int, high: int | None = None):
    """A whole number >= ``low`` (and <= ``high``)."""
    what = f"a whole number >= {low}" if high is None else f"a whole number in {low}..{high}"
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= low and (
        high is None or v <= high) else what


def number(above: float | None = None, at_least: float | None = None, at_most: float | None = None):
    """A finite number ``> above`` / ``>= at_least`` (and ``<= at_most``)."""
    what = "a finite number" + (f" > {above:g}" if above is not None else "") + (
        f" in [{at_least:g}, {at_most:g}]" if at_least is not None and at_most is not None
        else f" >= {at_least:g}" if at_least is not None else f" <= {at_most:g}" if at_most is not None else "")
    return lambda v: None if finite(v) and (above is None or v > above) and (at_least is None or v >= at_least) \
        and (at_most is None or v <= at_most) else what


def one_of(names):
    """One of ``names``."""
    return lambda v: None if v in names else f"one of {', '.join(map(str, names))}"


def pair(first, second):
    """``[first, second]`` (a tuple written as JSON reads back as a list)."""
    def ok(value):
        good = isinstance(value, list) and len(value) == 2 and _meets(value[0], first) and _meets(value[1], second)
        return None if good else f"[{_words(first)}, {_words(second)}]"
    return ok


def _words(spec) -> str:
    """What ``spec`` expects: a type's name, or a callable spec's own words (what it tells a null)."""
    return _name(spec) if isinstance(spec, (type, tuple, dict)) else spec(None) or "a valid value"


def _meets(value, spec) -> bool:
    return _is(value, spec) if isinstance(spec, (type, tuple)) else not spec(value)


def check(doc, schema: dict, path, at: str = "") -> dict:
    """``doc`` (read from ``path``) against ``schema``; returns ``doc``. Raises :class:`DamagedFile` naming the
    file, the dotted key and what it should be."""
    if not isinstance(doc, dict):
        raise DamagedFile(path, f"{at or 'the file'} is {_what(doc)}, not a mapping")
    for key, spec in schema.items():
        where = f"{at}.{key}" if at else key
        if isinstance(spec, Opt):
            if doc.get(key) is None:
                continue
            spec = spec.spec
        if key not in doc:
            raise DamagedFile(path, f"{where} is missing")
        value = doc[key]
        if isinstance(spec, dict):
            check(value, spec, path, where)
        elif isinstance(spec, (type, tuple)):
            if not _is(value, spec):
                raise DamagedFile(path, f"{where} is {_what(value)}, not {_name(spec)}")
        else:
            why = spec(value)
            if why:
                raise DamagedFile(path, f"{where} is {_what(value)}, not {why}")
    return doc


def _what(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def read_json(path, what: str = "") -> dict:
    """The JSON object in ``path``; :class:`DamagedFile` when it is unreadable as one (``FileNotFoundError``
    passes: a missing file is the caller's to judge)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise DamagedFile(path, f"not readable as JSON ({type(exc).__name__}: {exc})", what) from None
    if not isinstance(doc, dict):
        raise DamagedFile(path, f"not a JSON object (a {type(doc).__name__ if doc is not None else 'null'})", what)
    return doc


# (the sections' structure: a value that is no finite number is report's to name, with its file and key, and
# leave out of every number -- specmd.sweeps.non_finite -- not a reason to drop the run)
CACHE = {"oracle": Opt(dict), "union": Opt({"decode": Opt(dict)})}
# results.json (specmd.results.assemble): what report, status, resume and a replay reusing a recording read
RESULTS = {"config": Opt(dict), "tasks": Opt(dict), "provenance": Opt(dict), "config_hash": Opt(str),
           "cache": Opt(dict), "timing": Opt(dict), "routing": Opt(dict), "wall": Opt(dict),
           "memory": Opt(dict), "replay": Opt(dict), "speculative": Opt(dict)}
# failed.json (specmd.jobs.write_failed): the stage a job failed in, and what kind of failure
STAGES = ("config", "load", "stack", "evaluate", "replay", "write")
KINDS = ("config", "data", "signal", "error")


FAILED = {"stage": Opt(one_of(STAGES)), "kind": Opt(one_of(KINDS)), "error": str, "config": Opt(dict)}


def read_results(path) -> dict:
    """A run's ``results.json``, checked (:data:`RESULTS`, its ``cache`` section's :data:`CACHE`)."""
    doc = check(read_json(path, "a run's results"), RESULTS, path)
    if doc.get("cache") is not None:
        check(doc["cache"], CACHE, path, "cache")
    return doc


def read_failed(path) -> dict:
    """A run's ``failed.json``, checked (:data:`FAILED`)."""
    return check(read_json(path, "a failed run's record"), FAILED, path)
