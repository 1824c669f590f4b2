"""The commands' bodies, one module (or package) each: what ``specmd <command>`` does beyond a run.

The command table (:data:`specmd.cli.COMMANDS`) is the one list and names each command's module here; the
command line (:mod:`specmd.cli`) is the only floor above. A command imports the floors below -- the runs
(:mod:`specmd.app`, :mod:`specmd.pool`, :mod:`specmd.recorder`), the drivers, the domain, the engine -- and ends
through the one error path below it (:mod:`specmd.outcome`), never through the command line
(``tests/system/test_layering.py``).
"""
