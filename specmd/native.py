"""The compiled engine: which modules are compiled, and which copy of each one this process imports.

The engine (cache manager, pools, clock, stats, outcomes, view, records), the replay driver's loop and
every built-in policy are compiled by Cython from their own ``.py`` sources, written as Cython's own compiler
is: plain annotated Python in the ``.py`` (no import of Cython's shadow module), every C declaration
(``cdef class``, typed fields, ``cpdef``/``cdef`` signatures, typed locals, ``final``) in the augmenting
``.pxd`` beside it. There is one source per module and per policy, and the uncompiled source is the pure-Python
fallback, which needs no Cython at all. It gives the same results, only slower (``tests/test_native.py``
checks that). ``setup.py`` builds the extensions when
the package is installed (``pip install -e .`` builds them beside the sources). If the build fails, the
package still installs and runs pure Python.

At import (:func:`select`, called by ``specmd/__init__``), each module :func:`sources` lists loads

* its **source** when ``SPECMD_PURE_PYTHON=1`` (forced, no warning);
* its **source** when the build made no extension of it (no build at all, or it failed to compile), or
  when its extension is **stale** (the source changed since the build: an edited policy is never shadowed
  by its old compiled copy). One warning names them and the rebuild command;
* its **source** when a module whose C declarations it was built against (the ``from specmd.x cimport``
  lines of its ``.pxd``: the engine's typed calls into the cache manager, the clock and the statistics)
  runs its source: a compiled caller cannot load beside a pure callee. The warning names these too;
* its **source** when a module running its source extends one of its extension types that has private C
  fields (:func:`extends`: the cache manager extends the residency, whose per-key arrays it reads);
* its **source**, silently, when it is a policy file added after the build (a user's own policy is plain
  Python; the compiled engine calls it like any other);
* its **extension** otherwise.

Why Cython and not mypyc (measured on this engine, 2026-11-25): plain Cython compiled all 47 modules in
53 s with their Python semantics unchanged: interpreted subclasses (a user's policy), dynamic attributes,
monkeypatching in tests. mypyc refused the engine: 29 type errors (per-layer counters are set with
``setattr``, Optional attributes narrowed at run time), and type-checking the nine engine modules alone took
3 min 45 s. ``docs/benchmarks.md`` ("History") has the measurements.

This module imports nothing from specmd, and ``setup.py`` runs it (for :func:`sources`) without importing
the package.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
MANIFEST = "_native.json"  # written by the build beside the extensions: {"built": {source: sha256}, "failed": [...]}
ENV = "SPECMD_PURE_PYTHON"

# Compiled modules, by the package-relative path of their source. Built-in policies: every module of a
# policy family's package (a new built-in policy file is compiled without being listed here).
ENGINE = ("engine/cache.py", "engine/call.py", "engine/clock.py", "engine/engine.py", "engine/geometry.py",
          "engine/hooks.py", "engine/link.py", "engine/outcomes.py", "engine/record.py", "engine/residency.py",
          "engine/simclock.py", "engine/stats.py", "engine/store.py", "engine/view.py", "replay/driver.py",
          "replay/future.py", "hook/stack.py", "policies/base.py")
POLICY_DIRS = ("policies/eviction", "policies/miss", "policies/prefetch", "policies/routing")


def sources(package: Path = PACKAGE) -> list[str]:
    """The package-relative ``.py`` paths the build compiles (``__init__`` files stay plain Python)."""
    out = list(ENGINE)
    for d in POLICY_DIRS:
        out += sorted(f"{d}/{p.name}" for p in (package / d).glob("*.py") if p.name != "__init__.py")
    return out


def module_name(source: str) -> str:
    return "specmd." + source[:-3].replace("/", ".")


def digest(path: Path) -> str:
    """The sha256 of a source and of its ``.pxd`` declarations, if it has them (both make the extension)."""
    h = hashlib.sha256(path.read_bytes())
    pxd = path.with_suffix(".pxd")
    if pxd.is_file():
        h.update(b"\0pxd\0" + pxd.read_bytes())
    return h.hexdigest()


_CIMPORT = re.compile(r"^\s*from\s+specmd\.([\w.]+)\s+cimport\b", re.M)


def cimports(source: str, package: Path = PACKAGE) -> list[str]:
    """The package-relative sources whose C declarations ``source`` uses (``from specmd.x cimport`` lines of
    its ``.pxd``): its extension is built against theirs and can only load beside their extensions."""
    return [m.replace(".", "/") + ".py" for m in _CIMPORT.findall(_pxd(source, package))]


def _pxd(source: str, package: Path) -> str:
    """The text of ``source``'s ``.pxd`` declarations ("" without one)."""
    pxd = (package / source).with_suffix(".pxd")
    return pxd.read_text() if pxd.is_file() else ""


_CIMPORTED = re.compile(r"^\s*from\s+specmd\.([\w.]+)\s+cimport\s+([\w, ]+)$", re.M)
_SUBCLASS = re.compile(r"^cdef class \w+\((\w+)\):", re.M)


def extends(source: str, package: Path = PACKAGE) -> list[str]:
    """The sources whose extension types a class of ``source`` extends (``cdef class A(B)`` in its ``.pxd``, ``B``
    cimported) where that type has private C fields (a ``cdef`` field neither public nor readonly): the
    subclass's source reads them, so it runs its source only beside theirs (the cache manager extends the
    residency). An interface without fields (the eviction hooks) is extended from Python like any class."""
    text = _pxd(source, package)
    where = {name.strip(): mod.replace(".", "/") + ".py"
             for mod, names in _CIMPORTED.findall(text) for name in names.split(",")}
    out = []
    for base in _SUBCLASS.findall(text):
        if base in where:
            body = _pxd(where[base], package).split(f"cdef class {base}:", 1)[-1].split("\ncdef ", 1)[0]
            if re.search(r"^\s+cdef (?!public |readonly )[\w\[\]: ]+ _?\w+$", body, re.M):
                out.append(where[base])
    return out


def extension_of(source: str, package: Path = PACKAGE) -> Path | None:
    """The built extension of ``source`` beside it, or None."""
    stem = package / source[:-3]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = stem.with_name(stem.name + suffix)
        if p.is_file():
            return p
    return None


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the listed modules' ``.py`` sources ahead of the path finder (which prefers extensions)."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = paths

    def find_spec(self, name, path=None, target=None):
        p = self.paths.get(name)
        return None if p is None else importlib.util.spec_from_file_location(name, p)


# What :func:`select` decided: module name -> "compiled" | "pure"; and why some run pure.
STATE: dict[str, str] = {}
REASON: str = ""


def select(package: Path = PACKAGE) -> None:
    """Decide, before any of them is imported, which copy of each compiled module this process loads."""
    global REASON
    if STATE:
        return
    forced = os.environ.get(ENV, "").strip() not in ("", "0")
    try:
        manifest = json.loads((package / MANIFEST).read_text())
        built, failed = dict(manifest["built"]), set(manifest["failed"])
    except (OSError, ValueError, KeyError, TypeError):
        manifest, built, failed = None, {}, set()
    missing, stale, pure = [], [], {}
    for src in sources(package):
        name = module_name(src)
        ext = extension_of(src, package) if src in built else None
        if forced or ext is None or built[src] != digest(package / src):
            if forced:
                pass
            elif ext is not None:
                stale.append(src)
            elif manifest is None or src in failed or src in built or src in ENGINE:
                missing.append(src)  # (a policy file the build never saw is a user's plain-Python policy)
            pure[name] = package / src
            STATE[name] = "pure"
        else:
            STATE[name] = "compiled"
    dependent = _built_against(pure, package)
    if pure:  # ahead of the path finder, which would load a stale or unwanted extension
        sys.meta_path.insert(0, _Sources(pure))
    if forced:
        REASON = f"{ENV}=1"
    elif missing or stale:
        parts = []
        if missing:
            parts.append(f"not built: {_names(missing)}" if manifest is not None else "not built")
        if stale:
            parts.append(f"older than their sources: {_names(stale)}")
        if dependent:
            parts.append(f"built against those: {_names(dependent)}")
        REASON = "; ".join(parts)
        n = len(missing) + len(stale) + len(dependent)
        what = "its engine and policies" if n == len(STATE) else f"{n} of its {len(STATE)} compiled modules"
        warnings.warn(f"specmd runs {what} as pure Python, which replays several times slower ({REASON}). "
                      f"Rebuild with: pip install -e . (or set {ENV}=1 to choose pure Python without this "
                      f"warning)", RuntimeWarning, stacklevel=3)


def _built_against(pure: dict, package: Path) -> list:
    """The modules that run their source because another one does (``select``'s fixed point): added to
    ``pure`` and ``STATE``, and returned."""
    # An extension built against another module's C declarations loads only beside that module's extension:
    # when that one runs its source, so does this one (to a fixed point: cache runs pure if clock does). And a
    # source extending another's extension type reads its private fields: when it runs, so does that one.
    # (Nothing to read while every module runs its extension, the usual start.)
    uses = {src: cimports(src, package) for src in sources(package)} if pure else {}
    bases = {src: extends(src, package) for src in uses}
    dependent = []
    changed = True
    while changed:
        changed = False
        for src, deps in uses.items():
            if STATE[module_name(src)] == "compiled" and any(STATE.get(module_name(d)) == "pure" for d in deps):
                _run_source(src, package, pure, dependent)
                changed = True
            elif STATE[module_name(src)] == "pure":
                for b in bases[src]:
                    if STATE.get(module_name(b)) == "compiled":
                        _run_source(b, package, pure, dependent)
                        changed = True
    return dependent


def _run_source(src: str, package: Path, pure: dict, dependent: list) -> None:
    """``src`` runs its source because of another module's copy (``select``'s fixed point)."""
    name = module_name(src)
    STATE[name] = "pure"
    pure[name] = package / src
    dependent.append(src)


def _names(srcs: list[str]) -> str:
    return ", ".join(srcs) if len(srcs) <= 4 else f"{', '.join(srcs[:3])} and {len(srcs) - 3} more"


def summary() -> dict:
    """What ran, for results' provenance: ``engine`` compiled | pure | mixed, and the pure modules."""
    pure = sorted(n for n, v in STATE.items() if v == "pure")
    mode = "pure" if len(pure) == len(STATE) else "mixed" if pure else "compiled"
    out = {"engine": mode}
    if pure and mode == "mixed":
        out["pure_modules"] = pure
    if REASON and pure:
        out["why_pure"] = REASON
    return out


def loaded(name: str) -> str:
    """``compiled`` or ``pure``: which copy of module ``name`` this process actually imported."""
    mod = sys.modules[name]
    return "compiled" if isinstance(getattr(mod, "__loader__", None), importlib.machinery.ExtensionFileLoader) else "pure"
