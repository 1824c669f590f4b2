"""A run's outputs: :func:`assemble` builds ``results.json``'s dict for both drivers (the live hook and trace
replay), and the writers put it (and ``passes.csv``) on disk atomically: a reader never sees a half-written
file."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Optional


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


def non_finite(tree, where: str = "") -> dict:
    """Dotted path (``cache.per_layer.hit_rate.1``) -> value of every float in ``tree`` (dicts, lists, tuples)
    that is NaN or infinite, in the tree's order: what a run checks before writing results.json
    (:func:`specmd.checks.check_numbers`) and what report and status name when they read one."""
    out: dict = {}

    def walk(v, at):
        if isinstance(v, float) and not math.isfinite(v):
            out[at] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{at}.{k}" if at else str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{at}.{i}")

    walk(tree, where)
    return out


def _clean(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def writable_dir(path, what: str) -> Path:
    """``path`` is, or can be created as, a directory this process can write in -- checked before any work,
    creating nothing: the nearest existing path at or above it is a directory (not a file, not a broken link),
    no component to create is longer than that file system takes, and a temporary file can be made and
    removed there (a read-only mount shows as one, root included). A :class:`~specmd.errors.ConfigError`
    starting with ``what`` (the option and its value) otherwise. Every command's output directory and a run's
    directory are checked here."""
    import tempfile

    from .errors import ConfigError

    path = Path(os.path.expanduser(path))
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    if os.path.islink(probe) and not os.path.exists(probe):
        raise ConfigError(f"{what}: {probe} is a broken symbolic link")
    if not probe.is_dir():
        raise ConfigError(f"{what}: {probe} is a file, not a directory"
                          + (f" ({path} cannot be created under it)" if probe != path else ""))
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    long = [p for p in path.relative_to(probe).parts if len(os.fsencode(p)) > name_max]
    if long:
        raise ConfigError(f"{what}: the name {long[0][:24]}... is {len(os.fsencode(long[0]))} bytes long; this file "
                          f"system takes at most {name_max}")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".specmd-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{what}: {probe} is not writable ({exc.strerror or exc})") from None
    return path


def unique_suffix() -> str:
    """``<host>-<pid>``: no two processes running at the same time share it, on one machine or several."""
    import socket

    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def output_dir(path, option: str, holds: str) -> Path:
    """A command's output directory ``option=path``, checked before any work (:func:`writable_dir`) and not
    created until something is written there (an error later leaves no empty directory). One holding
    ``holds`` (the command's main output) is refused: like a run directory, an output directory holds one
    command's results, which a second one would silently overwrite."""
    from .errors import ConfigError

    path = writable_dir(path, f"{option}={path}")
    if (path / holds).exists():
        raise ConfigError(f"{option}={path} already holds {holds} of an earlier run; choose another directory (the "
                          f"default is a new one per run) or remove that one")
    return path


def write_files(files: list, keep: bool = True, what: str = "what it held") -> None:
    """The one way specmd writes files the user keeps, one or several: each ``(path, fill)``'s ``fill(tmp)``
    writes the content to a temporary name beside ``path`` (hidden, unique: no config group option, no half
    file under the real name; created by ``fill`` with mode 0666 less the umask, like any file the user
    writes); when every one is complete they are renamed into place together, with signals held. A failure --
    an error, a full disk, SIGINT/SIGTERM (:class:`~specmd.signals.Interrupted`) -- at any point removes the
    temporaries and leaves every path as it was (or, once renamed, complete): a reader never sees a half-written
    file, and an interrupted command leaves nothing where the next one would look.

    When a write fails for want of room or of permission -- a full disk, a quota, a directory made read-only
    (the errnos of :data:`specmd.errors.FULL_ERRNOS` and ``PATH_ERRNOS``) -- the error is an ``OSError`` naming
    the path (an ``f.write`` error names no file) and, with ``keep``, every content not yet in place is
    written again under ``<tmp>/specmd-rescue/`` (:func:`keep_elsewhere`) and named in the message (several
    files of one directory: ``<what> is kept in DIR/ (a, b)``); ``exc.kept``: where the first went, or None.
    Nothing computed is lost, and the command's one line says where it went. Other errors pass unchanged."""
    from .errors import FULL_ERRNOS, PATH_ERRNOS
    from .signals import check_interrupt, signals_held

    temps: list = []  # [temporary name, or None once renamed; path]
    path = Path(files[0][0]) if files else Path(".")
    try:
        for path, fill in files:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            # recorded before ``fill`` creates it: however the fill ends, the cleanup below knows its name
            temps.append([path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}", path])
            check_interrupt()
            fill(temps[-1][0])
        with signals_held():  # all renamed, or (an error) the rest removed as temporaries
            for t in temps:
                path = t[1]
                os.replace(t[0], path)
                t[0] = None
    except BaseException as exc:
        mine = {None} | {str(name) for t in temps for name in t if name is not None}
        with signals_held():  # a second Ctrl-C cannot leave a temporary file behind
            for tmp, _ in temps:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
        if not isinstance(exc, OSError) or (None if exc.filename is None else str(exc.filename)) not in mine:
            raise  # (not a file the user asked for: an interrupt, another error, another file)
        unwritten = [f for i, f in enumerate(files) if i >= len(temps) or temps[i][0] is not None]
        if keep and exc.errno in FULL_ERRNOS | PATH_ERRNOS and unwritten:
            raise _kept_elsewhere(exc, unwritten, path, what) from exc
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    check_interrupt()  # a signal that arrived while held: raised now, the files complete


def _kept_elsewhere(exc: OSError, files: list, path: Path, what: str) -> OSError:
    """A write of ``files`` that failed at ``path``: the error naming it, each file's content kept under
    :func:`rescue_dir` and named."""
    kept = [keep_elsewhere(p, fill) for p, fill in files]
    phrases = [k[1] for k in kept]
    if len(kept) > 1 and all(k[0] is not None for k in kept) and len({Path(p).parent for p, _ in files}) == 1:
        phrases = [f"{what} is kept in {rescue_dir(path.parent)}/ ({', '.join(Path(p).name for p, _ in files)})"]
    error = OSError(exc.errno, f"{exc.strerror or exc}; " + "; ".join(phrases), str(path))
    error.kept = kept[0][0]
    return error


def write_file(path: Path, fill, keep: bool = True) -> None:
    """One file, written as :func:`write_files` writes several."""
    write_files([(path, fill)], keep)


def _write_fd(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, then fsync."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def content_fill(content):
    """A ``fill(tmp)`` writing ``content`` (text: UTF-8; or bytes) and syncing it to the disk."""
    data = content.encode() if isinstance(content, str) else content

    def fill(tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_fd(fd, data)
        finally:
            os.close(fd)

    return fill


_RESCUE: dict = {}  # directory -> its rescue directory in this process (one per directory and process)


def rescue_dir(directory: Path) -> Path:
    """Where what ``directory`` could not take is kept: ``<tmp>/specmd-rescue/<its name>-<pid>-<token>``, one per
    directory and process (a run's passes.csv, results.json and failed.json land together; the token: a later
    process with the same pid, as in a container, never writes over it)."""
    import tempfile

    key = str(Path(directory).absolute())
    if key not in _RESCUE:
        _RESCUE[key] = Path(tempfile.gettempdir()) / "specmd-rescue" / \
            f"{Path(directory).name or 'cwd'}-{os.getpid()}-{secrets.token_hex(3)}"
    return _RESCUE[key]


def rescued(directory: Path, name: str) -> Optional[Path]:
    """The newest record ``name`` (``failed.json``, ``results.json``) kept for ``directory`` under the rescue
    root (:func:`rescue_dir`, by any process: :func:`specmd.jobs.rescue` writes the run directory into it), or
    None. ``specmd status`` and ``report`` read a job's record there when its directory could not take it."""
    import tempfile

    directory = Path(directory).absolute()
    root = Path(tempfile.gettempdir()) / "specmd-rescue"
    found = []
    for path in root.glob(f"{glob_escape(directory.name or 'cwd')}-*/{name}"):
        try:
            held = json.loads(path.read_text()).get("run_dir")
        except (OSError, ValueError, AttributeError):
            continue
        if held is not None and Path(held).absolute() == directory:
            found.append((path.stat().st_mtime, str(path)))
    return Path(max(found)[1]) if found else None


def glob_escape(text: str) -> str:
    import glob

    return glob.escape(text)


def keep_elsewhere(path: Path, fill) -> tuple:
    """``fill`` (what would have been ``path``) written to ``<rescue_dir(its directory)>/<its name>`` instead:
    ``(where, the phrase naming it)``, where None when that failed too (the phrase says so)."""
    path = Path(path)
    kept = rescue_dir(path.parent) / path.name
    try:
        write_files([(kept, fill)], keep=False)
    except OSError as exc:
        return None, f"it could not be kept elsewhere either ({kept.parent}: {exc.strerror or exc})"
    return kept, f"what it held is kept in {kept}"


def write_json_atomic(path: Path, data: dict, keep: bool = True) -> None:
    def fill(tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_clean(data), f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())

    write_file(path, fill, keep)


def write_passes_csv(path: Path, passes) -> None:
    """Per-forward-pass accounting (one row per prefill or decode pass): its cache's capacity in bytes (per pass
    with ``hardware.memory_gb``) and its sequences' KV cache beside the counts."""
    def fill(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("pass,kind,tokens,time_s,stall_s,requests,hits,misses,collision_misses,capacity_bytes,kv_bytes,bytes_moved\n")
            for p in passes:  # (kv_bytes blank: not modelled, a fixed capacity)
                f.write(f"{p.index},{p.kind},{p.tokens},{p.time_s:.9g},{p.stall_s:.9g},"
                        f"{p.requests},{p.hits},{p.misses},{p.collision_misses},{p.capacity_bytes},"
                        f"{p.kv_bytes if p.kv_bytes >= 0 else ''},{p.bytes_moved}\n")

    write_file(path, fill)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path``, atomically (:func:`write_file`)."""
    write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_csv(path: Path, rows: list) -> None:
    """``rows`` (dicts; the columns: every key, in order of appearance) as a CSV file, atomically
    (:func:`write_file`)."""
    write_file(path, csv_fill(rows))


def csv_fill(rows: list):
    """What :func:`write_csv` writes, as a ``fill(tmp)`` for :func:`write_file` and :func:`keep_elsewhere`."""
    import csv

    def fill(tmp):
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)

    return fill
