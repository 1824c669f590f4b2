"""The signals that end a job or a command: :func:`signals_raise` turns each into :class:`Interrupted` in the
main thread, so a job writes its ``failed.json`` and a command removes what it had half-written before the
process exits (exit 128 + the *first* signal's number: :mod:`specmd.ending`). Its own module, below
everything that writes files (:mod:`specmd.results`, :mod:`specmd.jobs`, the evaluation's safe points),
importing only the standard library.

:data:`ENDING` is every signal a terminal or a scheduler sends to end a process: SIGINT (Ctrl-C), SIGTERM
(``kill``, a scheduler's cancel, SLURM's time limit and pre-emption), SIGHUP (a closed terminal, a dropped ssh
session), SIGQUIT (Ctrl-\\) and SIGUSR1/SIGUSR2 (what ``sbatch --signal=USR1@90`` sends ahead of the limit;
their default action ends the process without a word). Each is handled only while its handler is the default:
a launcher's own (submitit's SIGUSR2 for its checkpoints) is left alone. A second signal, of any of them, while
the first is being handled is recorded, never raised where it would tear down what the first one's clean-up is
doing (:func:`signals_held`); the exit code stays the first one's."""

from __future__ import annotations

import contextlib
import signal


ENDING = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
               if hasattr(signal, n))  # (Windows has only the first two)


class Interrupted(BaseException):
    """A signal stopped the job (one of :data:`ENDING`: SIGTERM from a scheduler or ``kill``, SIGINT from Ctrl-C,
    SIGHUP from a closed terminal ...); ``exit_code`` is the shell's convention, 128 + its number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Signals:
    """The signal state of this process: ``pending``, the first signal of :data:`ENDING` received (0: none);
    ``depth``, how many :func:`signals_raise` blocks are open; ``held``, while ``failed.json`` is written
    (:func:`signals_held`): a signal is recorded, not raised."""

    pending = 0
    depth = 0
    held = False


SIGNALS = _Signals()


def check_interrupt() -> None:
    """A safe point: raise :class:`Interrupted` when a signal arrived whose exception never reached the job
    (raised inside a finalizer, ``__del__``, where Python prints and discards it). Called between stages, per
    model call of an evaluation and before ``results.json`` is written; a plain attribute read otherwise."""
    if SIGNALS.pending and SIGNALS.depth and not SIGNALS.held:
        raise Interrupted(SIGNALS.pending)


def unsafe(frame) -> bool:
    """Whether the main thread is where an exception would not reach the command as itself: inside an import
    (importlib's frames: a lazy module -- transformers' model classes -- turned it into ``ModuleNotFoundError``,
    exit 1 "a bug", for a Ctrl-C), a finaliser (``__del__``) or the garbage collector's callbacks (Python prints
    "Exception ignored" with a traceback and drops it). There the handler only records the signal; the next safe
    point raises it. One walk up the stack per signal (never on a hot path)."""
    if _GC[0]:
        return True
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_GC = [False]  # the collector is running (gc.callbacks, registered once)


def _gc_phase(phase, info) -> None:
    _GC[0] = phase == "start"


def _watch_gc() -> None:
    import gc

    if _gc_phase not in gc.callbacks:
        gc.callbacks.append(_gc_phase)


@contextlib.contextmanager
def signals_held():
    """While ``failed.json`` (or any record of the failure) is written: a signal is recorded but raises
    nothing, so a second Ctrl-C cannot cut the record short; the handler stays armed."""
    held, SIGNALS.held = SIGNALS.held, True
    try:
        yield
    finally:
        SIGNALS.held = held


@contextlib.contextmanager
def signals_raise(after=None):
    """While a job or a command runs, every signal of :data:`ENDING` raises :class:`Interrupted` in the main
    thread, so it writes its ``failed.json`` (with the stage it was in) or removes what it had half-written before
    the process exits; in the CLI's process and in a launcher's worker (joblib, submitit, Ray) alike. Only default
    handlers are replaced (a launcher's own handlers, e.g. submitit's, are left alone), and they are restored
    when the outermost block ends.

    The handler never disarms itself. It records the signal (:data:`SIGNALS`) and raises; if that exception
    is lost -- raised inside a finalizer, which Python discards -- the record stays, the next safe point
    (:func:`check_interrupt`) raises it, and the block's end raises it at the latest. (The handler used to set
    both signals to ignored and then raise: a signal landing in a ``__del__`` was lost, and with it every later
    one until SIGKILL.) While ``failed.json`` is written (:func:`signals_held`) a signal is only recorded.

    ``after``: the handler the outermost block leaves on the signals it armed, instead of the ones it found --
    :func:`specmd.ending.guarded` passes ``SIG_IGN``, so from the instant the command ends until it has
    reported how (and, in the CLI's process, until the process exits) a second signal changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = (signal.SIG_DFL, signal.default_int_handler)
    saved = {s: signal.getsignal(s) for s in ENDING}

    def handler(signum, frame):
        SIGNALS.pending = SIGNALS.pending or signum
        if not SIGNALS.held and not unsafe(frame):
            raise Interrupted(SIGNALS.pending)
        # (recorded: the next safe point -- check_interrupt -- raises it, the block's end at the latest)

    handler.specmd = True  # (what a forked replay worker recognises as the parent's: specmd.pool)

    if SIGNALS.depth == 0:
        SIGNALS.pending = 0  # a signal of an earlier block (landed as it ended) is not this one's
        _watch_gc()
    SIGNALS.depth += 1
    for s, h in saved.items():
        if h in defaults:
            signal.signal(s, handler)
    try:
        yield
        check_interrupt()  # a signal whose exception was lost, and no safe point since
    finally:
        SIGNALS.depth -= 1
        for s, h in saved.items():
            signal.signal(s, after if after is not None and SIGNALS.depth == 0 and h in defaults else h)
        if SIGNALS.depth == 0:
            SIGNALS.pending = 0  # reported (raised), or the process goes on without the handler: forgotten
