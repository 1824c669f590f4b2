"""Builds the compiled engine; everything else about the package is in pyproject.toml.

The engine, the replay driver's loop and the built-in policies (the list: ``specmd/native.py``) are
compiled by Cython from their own ``.py`` sources (pure-Python mode). ``pip install -e .`` builds them in
place, beside the sources, and a wheel carries them. A module that fails to compile is left out with a
warning (the package runs its source instead); without Cython or a C compiler nothing is compiled and the
package runs pure Python. The build writes ``specmd/_native.json``: each compiled source's sha256, so an
edited source is never shadowed by its old extension at run time.
"""

import json
import os
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
native = runpy.run_path(str(HERE / "specmd" / "native.py"))

DIRECTIVES = {
    "language_level": "3",
    "binding": True,  # functions keep their Python signatures, docstrings and introspection
    "embedsignature": True,
    "boundscheck": False,  # only typed memoryviews and arrays are affected: the sources index them in range
    "wraparound": True,
    "cdivision": False,  # Python's division and modulo semantics (the pure source is the reference)
    "initializedcheck": True,  # an unset memoryview field (a subclass that skipped __init__) raises
    "nonecheck": True,  # a typed reference still None (a subclass that skipped __init__) raises, never crashes
    # every C type is declared in the module's .pxd (Cython's own style: plain Python in the .py, C only in
    # the augmenting .pxd); an annotation in a .py is documentation, never a C type (``x: int`` would
    # otherwise reject a numpy integer, ``x: float`` become a C double)
    "annotation_typing": False,
}


def _warn(msg: str) -> None:
    print(f"WARNING (specmd): {msg}; the package will run its engine as pure Python (slower)", file=sys.stderr)


def extensions() -> list:
    if os.environ.get("SPECMD_NO_COMPILE", "").strip() not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as e:
        _warn(f"Cython is not installed ({e})")
        return []
    exts = [Extension(native["module_name"](src), [f"specmd/{src}"], optional=True)
            for src in native["sources"](HERE / "specmd")]
    def translate(modules: list, threads: int = 0) -> list:
        return cythonize(modules, compiler_directives=DIRECTIVES, build_dir="build/cython", quiet=True,
                         nthreads=threads)

    try:  # every module at once, translated on every core (Cython's own worker pool)
        return translate(exts, os.cpu_count() or 1)
    except Exception:  # one of them cannot be translated: one at a time, each failure left out
        pass
    out = []
    for ext in exts:  # a module Cython cannot translate runs its source, the others compiled
        try:
            out += translate([ext])
        except Exception as e:
            UNTRANSLATED.append(ext.sources[0][len("specmd/"):])
            _warn(f"Cython could not translate {ext.sources[0]} ({type(e).__name__}: {e})")
    return out


UNTRANSLATED: list = []  # sources Cython could not translate (listed as failed in the manifest)


class BuildExt(build_ext):
    """Compiles in parallel, skips what fails (optional extensions), and writes the manifest."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        if self.compiler.compiler_type == "unix":  # gcc, clang
            # a * b + c stays two roundings, never one fused multiply-add (which CFLAGS=-march=native would
            # allow): the compiled float arithmetic (the clock, score's window, ml's network) keeps the bits
            # of its pure-Python source
            # -g0 -O2 after Python's own "-g -O3" (measured 2026-11-30, this 2-core VM, 55 modules from scratch:
            # -g -O3 1 min 46 s and 59 MB of extensions, -g0 -O3 1 min 17 s and 11 MB, -g0 -O2 1 min 03 s;
            # benchmarks/replay.py at 3M requests, 5 repeats alternated, -O2 over -O3: lru 1.02, least_stale
            # 1.00, lfu 0.99, fifo 1.01 -- the same speed). A traceback still names the .py line.
            for ext in self.extensions:
                ext.extra_compile_args = [*ext.extra_compile_args, "-ffp-contract=off", "-g0", "-O2"]
        super().build_extensions()

    def run(self):
        super().run()
        built, failed = {}, list(UNTRANSLATED)
        for ext in self.extensions:
            source = ext.name.split(".", 1)[1].replace(".", "/") + ".py"  # specmd.engine.cache: engine/cache.py
            if Path(self.get_ext_fullpath(ext.name)).is_file():
                built[source] = native["digest"](HERE / "specmd" / source)
            else:
                failed.append(source)
        pkg_dir = Path(self.get_ext_fullpath("specmd._")).parent
        pkg_dir.mkdir(parents=True, exist_ok=True)
        manifest = {"built": built, "failed": sorted(failed)}
        (pkg_dir / native["MANIFEST"]).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if failed:
            _warn(f"{len(failed)} of {len(failed) + len(built)} modules did not compile ({', '.join(failed)})")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
