"""Errors specmd raises for bad user input. The CLI prints them without a traceback."""

import argparse
import errno

# OSErrors that say the user's path cannot be used (exit 2) and those that say the machine ran out (exit 1):
# specmd.ending's table, and what specmd.results.write_file keeps elsewhere
PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.ENOTDIR, errno.EISDIR,
                         errno.ENAMETOOLONG, errno.ENOENT, errno.ELOOP, errno.EINVAL})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def file_error(exc: BaseException):
    """``(exit code, one line naming the path)`` of an ``OSError`` that says the user's path cannot be used (2)
    or the machine ran out (1); None for any other exception."""
    if not isinstance(exc, OSError) or exc.errno not in PATH_ERRNOS | FULL_ERRNOS:
        return None
    detail = f"{exc.filename}: {exc.strerror}" if exc.filename is not None else str(exc)
    if exc.filename2 is not None:
        detail += f" (-> {exc.filename2})"
    return (1 if exc.errno in FULL_ERRNOS else 2), detail


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the valid choices."""


class DamagedFile(ConfigError):
    """A file specmd wrote and reads back is not what it wrote (damaged, hand-edited, or from another version):
    the message names the file, the key and what was expected (:mod:`specmd.readers`). A ConfigError: exit 2."""

    def __init__(self, path, why: str, what: str = ""):
        self.path, self.why = str(path), why
        super().__init__(f"{path}: {why}" + (f" (read as {what})" if what else ""))


class DataError(RuntimeError):
    """Evaluation data cannot be found (no mirror, hub unreachable, dataset missing from the mirror)."""


def say(prog: str, message: str, label: str = "error") -> None:
    """One line on stderr, as every command prints bad input: ``specmd CMD: error: message`` (rich markup
    escaped, never wrapped)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]{prog}: {label}:[/] {escape(message)}", highlight=False, soft_wrap=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown option, a missing or bad value, a ``type`` check) are a
    :class:`ConfigError` naming the argument, with the usage on the same line: every command and script prints
    bad input as one line and exit 2 (:mod:`specmd.ending`), argparse's own is two to five. ``--help`` is
    argparse's."""

    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise ConfigError(f"{message} (usage: {usage})")
