"""The scripts a user runs beside the commands (``benchmarks/*.py``: the GPU check we ask users to run, the
counting proxy, the speed benchmarks) end the way a command does (:mod:`specmd.ending`): bad arguments
are one line and exit 2 *before any work*, a bug one line with the traceback in a file, a signal 128 + its
number, and a section that failed makes the exit code 1.

    from specmd.cli.script import ArgumentParser, Sections, run

    def main(argv) -> int:
        ap = ArgumentParser(description=...)          # its errors are ConfigError: one line, exit 2
        ap.add_argument("--device", type=device, ...)  # checked as a run's device= is
        ap.add_argument("--out", type=out_file)        # a file that can be written, checked now
        ap.add_argument("--skip", nargs="*", type=choice_of(SECTIONS, "--skip"))
        a = ap.parse_args(argv)
        sections = Sections()
        with sections.run("lossless"): ...           # a failure is recorded, the next one runs
        return sections.exit_code()

    if __name__ == "__main__":
        run("benchmarks/x.py", main)

``gpu_check.py --device tpu`` printed a traceback in every section and exited 0; an unknown ``--skip`` name was
ignored and the whole six-minute check ran; ``--out`` naming a directory failed only at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path

from ..errors import ArgumentParser, ConfigError  # noqa: F401 (the scripts')


def device(value: str) -> str:
    """``--device``: a torch device specmd runs on that this machine has (what a run's ``device=`` accepts)."""
    from ..checks import check_device

    try:
        check_device(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("device=", "--device ", 1)) from None
    return value


def out_file(value: str) -> Path:
    """``--out``: a file this process can create or replace -- not a directory, in a directory that is or can be
    made writable -- checked before the work whose result it keeps."""
    from ..results import writable_dir

    path = Path(value).expanduser()
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; name a file, e.g. {path / 'out.json'}")
    try:
        writable_dir(path.parent if str(path.parent) else Path("."), f"--out {value}")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--out {value}: ")) from None
    return path


def choice_of(valid, option: str):
    """An argparse ``type`` taking only the names in ``valid`` (an unknown name is refused with the valid ones)."""
    valid = list(valid)

    def check(value: str) -> str:
        if value not in valid:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {option}'s choices: {', '.join(valid)}")
        return value

    return check


def whole(minimum: int):
    """An argparse ``type``: a whole number >= ``minimum``."""
    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} must be >= {minimum}")
        return n

    return check


class Sections:
    """The sections of a script that go on after one fails (each failure printed with its traceback and kept
    in ``failed``); :meth:`exit_code` is 1 when any failed."""

    def __init__(self):
        self.failed: list = []

    @contextlib.contextmanager
    def run(self, name: str, on_failure=None):
        """The block is section ``name``: an ``Exception`` ends it, is printed and recorded (``on_failure(exc)``
        too: a row of the script's table), and the script goes on. A signal ends the script."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 -- the next section runs; the failure is in the exit code
            traceback.print_exc()
            self.failed.append(name)
            if on_failure is not None:
                on_failure(exc)

    def exit_code(self) -> int:
        if self.failed:
            print(f"failed sections: {', '.join(self.failed)}", file=sys.stderr)
        return 1 if self.failed else 0


def run(prog: str, main) -> None:
    """``main(argv) -> int`` as a command runs (:func:`specmd.ending.guarded`), then exit with its code."""
    from ..ending import guarded

    sys.exit(guarded(prog, main, sys.argv[1:], final=True))
