"""Where a result came from: the ``provenance`` section of ``results.json``.

A number is only comparable with another when both came from the same code, libraries, weights and (for
a replay) trace. Recorded per run: the versions of specmd and the libraries that shape the numbers, the
git commit of the specmd checkout (with a ``dirty`` flag) when it is one, fingerprints of the model's
files and of a replayed trace, and the machine it was timed on (:func:`machine`: threads, cores, load). A fingerprint hashes each file's name, size and its first and last MiB:
cheap for multi-GB checkpoints, and it changes whenever a file is replaced, truncated or re-saved.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from .machine import cgroup_cores, machine, note_start, usable_cores  # noqa: F401 (what was timed on)

LIBRARIES = ("specmd", "torch", "transformers", "lm_eval", "hydra-core", "numpy")
CHUNK = 1 << 20


@functools.lru_cache(maxsize=None)  # fixed for the process: a batched replay sweep asks once, not per run
def _versions() -> tuple:
    out = [("python", sys.version.split()[0])]
    for name in LIBRARIES:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, None))
    return tuple(out)


def versions() -> dict:
    return dict(_versions())


@functools.lru_cache(maxsize=None)  # the code a process runs is the code it imported at its start
def git_state(source: Path = Path(__file__).resolve().parent) -> Optional[dict]:
    """The commit of the checkout holding specmd's source, or None (an installed wheel, no git)."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=source, capture_output=True, text=True,  # noqa: E731
                                         timeout=5, check=True).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def files_fingerprint(path) -> Optional[str]:
    """sha256 (16 hex digits) over a file, or a directory's files in name order: name, size, first and last
    MiB of each. None when ``path`` is not on disk (a hub id not downloaded here)."""
    path = Path(path).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(CHUNK))
            if size > 2 * CHUNK:
                fh.seek(-CHUNK, 2)
                h.update(fh.read(CHUNK))
            elif size > CHUNK:
                h.update(fh.read())
    return h.hexdigest()[:16]


def model_identity(model_cfg) -> dict:
    """What the weights were: a seeded random model, or the files ``model.pretrained`` resolved to."""
    from .models.loader import resolve_pretrained

    if model_cfg.pretrained is None:
        return {"weights": f"seeded random ({model_cfg.family}, seed {model_cfg.seed})"}
    local = resolve_pretrained(model_cfg.pretrained)
    # the family its config.json names (model.family=auto resolves to it before loading)
    return {"pretrained": model_cfg.pretrained, "family": model_cfg.family,
            "revision": getattr(model_cfg, "revision", None), "fingerprint": files_fingerprint(local)}


def provenance(model_cfg=None, trace_path=None) -> dict:
    from . import native

    git = git_state()
    # which copy of the engine ran (compiled | pure | mixed, and why): results are equal, speeds are not
    out = {"versions": versions(), "git": dict(git) if git else None, "engine": native.summary(),
           "machine": machine()}
    if model_cfg is not None:
        out["model"] = model_identity(model_cfg)
    if trace_path is not None:
        out["trace"] = {"path": str(trace_path), "fingerprint": files_fingerprint(trace_path)}
    return out
