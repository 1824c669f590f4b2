"""How every command ends: the one error path behind ``specmd COMMAND`` (:func:`guarded`).

=========================================  ====  ==========================================================
what ended the command                      exit  what the user sees
=========================================  ====  ==========================================================
success                                     0     the command's own output (a command may return 1 itself:
                                                  ``tune`` without a winner, ``status`` with failed jobs)
bad input: :class:`~specmd.errors.          2     ``specmd CMD: error: <message>``, one line naming the value
ConfigError`, ``DataError``, a Hydra              and what is valid (a Hydra composition error is flattened
composition error, a path it cannot use           to one line: ``Could not find 'model/nope'; available
(exists, not a directory, read-only, name         options in 'model': ...``)
too long)
the disk or quota full                      1     one line naming the path
a signal: INT, TERM, HUP, QUIT, USR1/2     128+  ``specmd CMD: stopped by SIGTERM``; the command has removed
(:data:`specmd.signals.ENDING`)             n     (or marked) what it had half-written on its way out; 130
                                                  Ctrl-C, 143 SIGTERM, 129 SIGHUP: the *first* signal's
anything else: a bug                        1     one line, and the traceback in a file it names
=========================================  ====  ==========================================================

The main run has the same shape (``failed.json`` is its file). ``HYDRA_FULL_ERROR=1``, Hydra's switch for
the whole trace, raises instead of printing one line, for every command.

Signals are armed (:func:`specmd.signals.signals_raise`) around the whole command, so a command only needs
``try/finally`` (or ``except BaseException: clean up; raise``) around what it writes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path



def one_line(text: str) -> str:
    """A multi-line message (Hydra's, OmegaConf's) as one line: the indented lines under a header ending in
    ``:`` become its comma-separated list; other lines follow each other after ``;`` (or a space after a full
    stop). Hydra's config search path and OmegaConf's object type (where to look inside Hydra, not what the
    user typed) are left out."""
    parts: list = []
    items: list = []  # the indented lines under parts[-1], when it ends with ":"
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("object_type=", "provider=")):
            continue
        if raw[:1] in ("\t", " ") and parts and (items or parts[-1].endswith(":")):
            items.append(line)
            continue
        if items:
            parts[-1] += " " + ", ".join(items)
            items = []
        parts.append(line)
    if items:
        parts[-1] += " " + ", ".join(items)
    out = ""
    for p in parts:
        out += p if not out else (" " if out.endswith(".") else "; ") + p
    return out or text.strip()


def classify(exc: BaseException) -> tuple:
    """``(exit code, message, is a bug)`` for an exception that ended a command."""
    from .errors import ConfigError, DataError, file_error

    if isinstance(exc, (ConfigError, DataError)):
        return 2, one_line(str(exc)), False
    if _is_composition_error(exc):
        cause = exc.__cause__
        text = str(exc) + (f"\n{cause}" if cause is not None and str(cause) not in str(exc) else "")
        return 2, one_line(text), False
    known = file_error(exc)
    if known is not None:
        return (*known, False)
    return 1, one_line(f"{type(exc).__name__}: {exc}"), True


def _is_composition_error(exc: BaseException) -> bool:
    """Hydra's and OmegaConf's errors about a config or an override (never a bug of the command's own)."""
    try:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:  # pragma: no cover - both are dependencies
        return False
    return isinstance(exc, (HydraException, OmegaConfBaseException))


def traceback_file(prog: str, exc: BaseException) -> Path:
    """Write ``exc``'s traceback to ``<tmp>/specmd-errors/<command>-<time>-<pid>.txt`` and return the path
    (stderr's own last resort when even that cannot be written)."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    path = Path(tempfile.gettempdir()) / "specmd-errors" / \
        f"{prog.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{' '.join(sys.argv)}\n\n{text}")
    except OSError:
        sys.stderr.write(text)
        return Path("<stderr>")
    return path


def guarded(prog: str, fn, argv: list, final: bool = False) -> int:
    """``fn(argv)`` (a command's ``main``) with signals armed, every way it can end turned into one line and
    an exit code (the table above). From the instant the command ends, the signals it armed are ignored while
    it reports how: a second signal -- of any kind, during the first one's report or an error's -- neither
    cuts the line short nor changes the exit code (the first signal's). ``final`` (the CLI's own process, which
    exits next): they stay ignored, so a signal while the interpreter joins its threads cannot turn the exit
    code into its own (a SIGTERM's run then died of the Ctrl-C after it, 130); otherwise they are restored."""
    from .signals import ENDING, signals_raise

    saved = {s: signal.getsignal(s) for s in ENDING}
    try:
        with signals_raise(after=signal.SIG_IGN):
            code = fn(argv) or 0
    except BaseException as exc:  # noqa: BLE001 -- the one place every command's error ends
        code = report(prog, exc)
    finally:
        if not final:
            for s, h in saved.items():
                signal.signal(s, h)
    return code


def kept_note(exc: BaseException) -> str:
    """`` (its record is kept in PATH: ...)`` when the job's record (``failed.json``) went to the rescue root
    (:func:`specmd.jobs.rescue`: its directory could not take it), else ``""``: the line the user reads names
    it, whatever the first failure was."""
    where = getattr(exc, "specmd_failed", None)
    if not where or "specmd-rescue" not in Path(str(where)).parts:
        return ""
    return f" (its record is kept in {where}: the run directory could not take it)"


def _close_progress_bars() -> None:
    """Close the progress bars a stopped command left open (lm-eval's, the quantizer's) before its last line:
    a bar closed later -- by its finaliser, at exit -- redrew itself after "stopped by SIGINT"."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 -- a bar that cannot close still must not hide the line
            pass


def _signal_within(exc: BaseException) -> BaseException:
    """The :class:`~specmd.signals.Interrupted` a library wrapped ``exc`` around (``raise X from e``, or raised
    while handling it: a lazy import's ``ModuleNotFoundError``), else ``exc``: a signal is reported as itself
    (its exit code, one line), wherever it landed."""
    from .signals import Interrupted

    seen, e = 0, exc
    while e is not None and seen < 16:
        if isinstance(e, Interrupted):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return exc


def report(prog: str, exc: BaseException) -> int:
    """One line for ``exc`` on stderr (a bug's traceback in a file it names); the exit code."""
    from .signals import Interrupted

    if isinstance(exc, KeyboardInterrupt):  # a handler not specmd's raised it: a Ctrl-C all the same
        exc = Interrupted(signal.SIGINT)
    exc = _signal_within(exc)
    if isinstance(exc, Interrupted):
        _close_progress_bars()
        print(f"{prog}: {exc}{kept_note(exc)}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, SystemExit):  # a command's own exit (argparse's usage error, --help)
        raise exc
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or not isinstance(exc, Exception):
        raise exc
    from .errors import say

    code, message, bug = classify(exc)
    if bug:
        path = traceback_file(prog, exc)
        say(prog, f"{message} (a bug: the traceback is in {path}; please report it)")
    elif isinstance(exc, OSError):  # the user's path, most likely; where it came from, in case it was not
        say(prog, f"{message} (where: {traceback_file(prog, exc)})")
    else:
        say(prog, message + kept_note(exc))
    return code
