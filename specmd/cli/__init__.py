"""The commands of specmd, in one table, and the one dispatcher behind ``specmd`` and ``python -m specmd``.

    specmd [COMMAND] [ARGS...]         specmd --help: the table below; specmd COMMAND --help: its own help

:data:`COMMANDS` is the only list of commands: ``specmd --help`` prints it, :func:`main` dispatches on it,
``tests/cli/test_commands.py`` runs ``--help`` of every row and ``tests/system/test_layering.py`` reads it for what
the drivers must not import. A row names the module holding the command's logic and the function that takes
its arguments (``main(argv)`` of that module unless ``entry`` says otherwise); the module is imported only
when its command runs, so ``specmd --help`` and an unknown command answer without loading torch.

The command line, first word first:

* no argument, an override (``key=value``, ``+key=value``, ``~key``) or a Hydra option (``-m``, ``--cfg``,
  ``--multirun``, ``-cn`` ...): the run, exactly as before (``specmd eviction=lru`` is ``specmd run
  eviction=lru``; ``specmd -m eviction=lru,lfu`` is ``specmd sweep eviction=lru,lfu``). Every run and sweep
  command line of the docs behaves as it did.
* ``--help`` / ``-h``: the table, not Hydra's help of the run. A new user who types ``specmd --help`` asks
  what specmd can do; Hydra's help (the run's config groups and its whole config, 150 lines) named none of
  the other nine commands. It stays one word away, ``specmd run --help`` (and ``specmd eviction=lru --help``,
  ``specmd --hydra-help`` go to Hydra as before). ``python -m specmd`` is this same dispatcher, so
  ``python -m specmd --help`` prints the table too.
* a command's name: that command, with the rest of the line. ``specmd COMMAND --help`` prints the
  command's own help and exits 0 for every command (each command's module answers ``--help`` itself).
* any other bare word (no ``=``, no leading ``+ ~ -``) is no override Hydra would accept: an unknown
  command, named with the known ones (exit 2).

Every command ends the same way (:mod:`specmd.ending`): bad input is one line and exit 2, a signal
exit 130/143 after the command cleaned up, a bug one line and exit 1 with the traceback in a file. A
command raises :class:`~specmd.errors.ConfigError` / ``DataError`` for bad input and cleans up what it
writes in ``finally``; it prints no error itself.

Adding a command: a module with ``main(argv) -> int`` that answers ``--help`` (argparse does), and one row
here.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Command:
    name: str            # what follows ``specmd``
    module: str          # where the command's logic lives
    help: str            # the one line ``specmd --help`` prints
    entry: str = ""      # "module:function" taking the arguments after the name; default "<module>:main"

    def function(self):
        """The function that runs the command (imports its module)."""
        module, _, func = (self.entry or f"{self.module}:main").partition(":")
        return getattr(importlib.import_module(module), func)


COMMANDS = (
    Command("run", "specmd.app", "one run: a model, or a recorded trace, under a cache stack; Hydra overrides "
            "(the default command)", "specmd.cli.hydra_apps:run"),
    Command("sweep", "specmd.app", "a Hydra multirun: one run per combination of the overrides' values "
            "(= specmd -m ...); resumable", "specmd.cli.hydra_apps:sweep"),
    Command("status", "specmd.commands.status", "which jobs of a sweep are done, failed, running or missing, "
            "and the command that resumes it"),
    Command("report", "specmd.commands.report", "the tables, figures and verdicts of sweeps, in their papers' layout"),
    Command("mrc", "specmd.commands.mrc", "miss-ratio curves: hit and collision rate vs capacity, per eviction policy "
            "and Belady, on one trace"),
    Command("tune", "specmd.commands.tune", "the best policy stack under a quality budget: searched on replay, "
            "finalists measured live"),
    Command("calibrate", "specmd.commands.calibrate", "measure this machine and write a hardware profile for "
            "execution=offload"),
    Command("fidelity", "specmd.commands.calibrate.fidelity", "how far to trust the simulated clock: offload runs "
            "on a grid, wall vs simulated"),
    Command("train", "specmd.commands.train", "train an embedded MoE model (Hydra overrides; config train.yaml)",
            "specmd.cli.hydra_apps:train"),
    Command("train-eviction", "specmd.commands.train_eviction", "train the ml eviction networks (eviction=ml) from "
            "routing traces"),
    Command("card", "specmd.commands.card", "measure what a model card reports: routing statistics and task scores"),
    Command("models", "specmd.commands.models", "every MoE family of the installed transformers: runs (record or "
            "derived) or refused, and why"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    rows = "\n".join(f"  {c.name:<{width}}  {c.help}" for c in COMMANDS)
    return (f"usage: specmd [COMMAND] [ARGS...]   (python -m specmd: the same)\n\ncommands:\n{rows}\n\n"
            "Without a command the arguments are a run's: specmd eviction=lru ... is specmd run eviction=lru ...,\n"
            "specmd -m ... is specmd sweep ....\n"
            "specmd COMMAND --help prints that command's help; specmd run --help: Hydra's help of the run (its\n"
            "config groups and every override).")


def is_override_or_option(word: str) -> bool:
    """What Hydra accepts in a run's command line: ``key=value``, ``+key=value``, ``++key=value``, ``~key``,
    and its options (``-m``, ``--cfg`` ...). A bare word is none of them."""
    return "=" in word or word.startswith(("+", "~", "-"))


def main(argv: Optional[list] = None) -> None:
    """``specmd ARGS`` (the console script) and ``python -m specmd ARGS``: exits with the command's code."""
    from_process = argv is None  # the console script, python -m specmd: this process ends with the command
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0)
    if argv and argv[0] in BY_NAME:
        command, rest = BY_NAME[argv[0]], argv[1:]
    elif not argv or is_override_or_option(argv[0]):
        command, rest = BY_NAME["run"], argv
    else:
        near = difflib.get_close_matches(argv[0], list(BY_NAME), n=1)
        print(f"specmd: unknown command {argv[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
              + f"; commands: {', '.join(BY_NAME)}. A run's overrides look like key=value (specmd run --help); "
              "specmd --help lists what each command does", file=sys.stderr)
        sys.exit(2)
    from ..ending import guarded

    prog = "specmd" if command.module == "specmd.app" else f"specmd {command.name}"  # the run's own voice
    # the console script and python -m specmd end with the command (a test calling main(argv) keeps its handlers)
    sys.exit(guarded(prog, lambda args: command.function()(args), rest, final=from_process))
