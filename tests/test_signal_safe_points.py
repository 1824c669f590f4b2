"""A signal ends a command at a safe point (issue 57): inside an import (a lazy module turned it into
ModuleNotFoundError: exit 1, "a bug"), a finaliser or the collector's callbacks the handler only records it,
and the next safe point -- a stage, a pass, a cell, a calibrate stage -- raises it: one line, the signal's exit
code. A signal a library wrapped is still reported as itself."""

import importlib
import os
import signal
import sys

import pytest

from specmd.ending import guarded
from specmd.signals import Interrupted, _GC, check_interrupt, signals_raise


def test_a_signal_inside_an_import_is_raised_at_the_next_safe_point(tmp_path, monkeypatch, capsys):
    (tmp_path / "slow_module.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                                            "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = {}

    def main(argv):
        mod = importlib.import_module("slow_module")  # the Ctrl-C lands in its body: recorded, not raised
        seen["finished"] = mod.FINISHED
        check_interrupt()  # the safe point
        seen["after"] = True

    assert guarded("specmd x", main, []) == 130
    assert seen == {"finished": True}
    err = capsys.readouterr().err
    assert err.strip() == "specmd x: stopped by SIGINT" and "ModuleNotFoundError" not in err
    sys.modules.pop("slow_module", None)


def test_a_signal_a_library_wrapped_is_reported_as_itself(capsys):
    def main(argv):
        try:
            raise Interrupted(signal.SIGTERM)
        except BaseException as e:  # (what a lazy module does with an import's failure)
            raise ModuleNotFoundError("Could not import module 'OlmoeForCausalLM'") from e

    assert guarded("specmd x", main, []) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "specmd x: stopped by SIGTERM"


def test_a_signal_while_the_collector_runs_is_only_recorded():
    reached = []
    with pytest.raises(Interrupted):
        with signals_raise():
            _GC[0] = True
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # (a gc callback's frame: Python would print and drop it)
                for _ in range(1000):
                    pass
                reached.append(True)
            finally:
                _GC[0] = False
            check_interrupt()
    assert reached == [True]


def test_calibrate_stages_and_passes_are_safe_points(monkeypatch, tmp_path):
    import specmd.commands.calibrate.measure as meas
    from specmd.signals import SIGNALS

    monkeypatch.setattr(meas, "disk_probe_path", lambda: tmp_path / "probe")
    ms = meas.Measurements({"k": 1}, remeasure=False)
    ms.stage("link", lambda: {"bw": 1.0, "lat": 0.0, "report": {}})
    with signals_raise():
        SIGNALS.pending = signal.SIGTERM  # (recorded inside an import during the stage before)
        with pytest.raises(Interrupted):
            ms.stage("disk", lambda: pytest.fail("measured after the signal"))
        SIGNALS.pending = 0
    assert meas.Measurements({"k": 1}, remeasure=False).data["link"]["bw"] == 1.0  # what was measured is kept


def test_the_stop_line_is_the_last_line_after_an_open_progress_bar(capsys):
    """(lm-eval's bar redrew itself after "stopped by SIGINT" when it was closed later, at exit.)"""
    from tqdm import tqdm

    def main(argv):
        bar = tqdm(total=10, desc="evaluating")
        bar.update(3)
        raise Interrupted(signal.SIGINT)

    assert guarded("specmd", main, []) == 130
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1] == "specmd: stopped by SIGINT" and "evaluating" in err
