"""A run's outputs: :func:`assemble` builds ``results.json``'s dict for both drivers (the live hook and trace
replay), and the writers put it (and ``passes.csv``) on disk atomically: a reader never sees a half-written
file."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path


def assemble(config: dict, tasks: dict, wall_s: float, provenance: dict, engine=None, executor=None,
             **sections) -> dict:
    """``results.json``'s dict, the one builder for both drivers: the run's ``config``, its ``tasks`` scores,
    ``wall_s`` and ``provenance``; then the engine's sections (``cache``, ``timing``, ``routing``: an
    unhooked run, ``engine=None``, has no cache and routes as the model does), the executor's (``wall``,
    ``memory``: an offloaded run) and the driver's own (a replay's ``replay`` and ``analysis``)."""
    results = {"config": config, "tasks": tasks, "wall_s": wall_s, "provenance": provenance}
    if engine is None:
        results.update(cache=None, timing=None, routing={"fidelity": 1.0})
    else:
        results.update(engine.results())
    if executor is not None:  # the wall clock beside the simulated one, and what the run held in memory
        results.update(executor.results())
    results.update(sections)
    return results


def _clean(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique temporary name, created with mode 0666 less the umask like any file the user writes (mkstemp
    # would make it 0600)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_clean(data), f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_passes_csv(path: Path, passes) -> None:
    """Per-forward-pass accounting (one row per prefill or decode pass)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("pass,kind,tokens,time_s,stall_s,requests,hits,misses,collision_misses\n")
            for p in passes:
                f.write(f"{p.index},{p.kind},{p.tokens},{p.time_s:.9g},{p.stall_s:.9g},"
                        f"{p.requests},{p.hits},{p.misses},{p.collision_misses}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
