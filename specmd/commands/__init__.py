"""The commands' bodies, one module (or package) each: what ``specmd <command>`` does beyond a run.

The command table (:data:`specmd.cli.COMMANDS`) is the one list and names each command's module here; the
command line (:mod:`specmd.cli`) is the only floor above. A command imports the floors below -- the runs
(:mod:`specmd.app`, :mod:`specmd.pool`, :mod:`specmd.recorder`), the drivers, the domain, the engine -- and ends
through the one error path below it (:mod:`specmd.outcome`), never through the command line
(``tests/test_layering.py``).

* ``status.py`` (``specmd status``), ``report/`` (``specmd report``: collect -> tables -> verdicts, figures)
* ``mrc.py`` (``specmd mrc``), ``tune.py`` (``specmd tune``)
* ``calibrate/`` (``specmd calibrate``), ``fidelity.py`` (``specmd fidelity``)
* ``train.py`` (``specmd train``), ``train_eviction.py`` (``specmd train-eviction``), ``card.py`` (``specmd card``)
"""
