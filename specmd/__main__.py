"""``python -m specmd ...`` is ``specmd ...``: one dispatcher, :func:`specmd.cli.main`, whose table lists the
commands (``python -m specmd --help``); without a command, a run (``python -m specmd [overrides]``) or, with
``-m``, a Hydra multirun."""

from .cli import main

if __name__ == "__main__":
    main()
