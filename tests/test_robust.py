"""Every command as hard to break as the main run (issue 38): one error path (specmd/ending.py), signals
that are never lost (specmd/jobs.py), one run per run directory, checks at config time for what W&B, submitit
and SLURM would reject, tune's quality measure, outputs that are whole or absent, and what a full disk would
lose kept elsewhere. Each case here is a user's input or an accident, with the one outcome a correct program
has; the commands' own cases are beside their tests (test_calibrate, test_report*, test_imports)."""

import errno
import gc
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from specmd.ending import classify, guarded, one_line
from specmd.errors import ConfigError, DataError
from specmd.jobs import claim_run_dir
from specmd.signals import ENDING, SIGNALS, Interrupted, check_interrupt, signals_held, signals_raise

FAST = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=128", "logger=none"]

HYDRA_MISSING = """In 'config': Could not find 'model/nope'

Available options in 'model':
\tolmoe
\ttiny
Config search path:
\tprovider=hydra, path=pkg://hydra.conf
"""
OMEGA_STRUCT = """Could not override 'eviction.nokey'.
To append to your config use +eviction.nokey=3
Key 'nokey' is not in struct
    full_key: eviction.nokey
    object_type=dict"""


# ---- one error path --------------------------------------------------------------------------------------
def test_one_line_flattens_hydra_and_omegaconf_messages():
    assert one_line(HYDRA_MISSING) == "In 'config': Could not find 'model/nope'; Available options in 'model': olmoe, tiny"
    assert one_line(OMEGA_STRUCT) == ("Could not override 'eviction.nokey'. To append to your config use "
                                      "+eviction.nokey=3; Key 'nokey' is not in struct; full_key: eviction.nokey")


@pytest.mark.parametrize("exc, code, words", [
    (ConfigError("x=3 must be >= 4"), 2, "x=3 must be >= 4"),
    (DataError("no mirror"), 2, "no mirror"),
    (FileExistsError(errno.EEXIST, "File exists", "/out/a"), 2, "/out/a: File exists"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/f/x"), 2, "/f/x: Not a directory"),
    (OSError(errno.ENOSPC, "No space left on device", "/out/b"), 1, "/out/b: No space left on device"),
])
def test_bad_input_and_path_errors_are_one_line_with_their_exit_code(exc, code, words, capsys):
    def fn(argv):
        raise exc

    assert guarded("specmd x", fn, []) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specmd x: error: ") and words in err, err
    assert "Traceback" not in err


def test_a_hydra_composition_error_is_bad_input():
    from hydra.errors import MissingConfigException

    code, message, bug = classify(MissingConfigException(HYDRA_MISSING, "model/nope"))
    assert (code, bug) == (2, False) and message.startswith("In 'config': Could not find 'model/nope'; Available")


def test_a_bug_is_one_line_exit_1_with_the_traceback_in_a_file(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def fn(argv):
        raise KeyError("deep inside")

    assert guarded("specmd x", fn, []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KeyError: 'deep inside'" in err and "a bug" in err, err
    path = Path(err.split("the traceback is in ")[1].split(";")[0])
    assert "Traceback (most recent call last)" in path.read_text() and "raise KeyError" in path.read_text()
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra's switch for the whole trace: raised, not one line
    with pytest.raises(KeyError):
        guarded("specmd x", fn, [])


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129),
                                       (signal.SIGQUIT, 131), (signal.SIGUSR1, 138), (signal.SIGUSR2, 140)])
def test_a_signal_stops_a_command_with_128_plus_its_number_after_its_cleanup(sig, code, tmp_path, capsys):
    """Every signal a terminal or a scheduler ends a process with (a closed terminal's SIGHUP ended a run with
    exit 129, no line and no failed.json; SLURM's --signal=USR1 ended it without a word)."""
    half = tmp_path / "half.txt"

    def fn(argv):
        try:
            half.write_text("half")
            os.kill(os.getpid(), sig)
            pytest.fail("the signal did not stop the command")
        finally:
            half.unlink()

    assert guarded("specmd x", fn, []) == code
    assert capsys.readouterr().err == f"specmd x: stopped by {signal.Signals(sig).name}\n"
    assert not half.exists() and signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_a_second_signal_during_the_cleanup_keeps_the_first_ones_exit_code(second, tmp_path, capsys):
    """SIGTERM then Ctrl-C recorded SIGTERM but exited 130: the exit code is the first signal's."""
    def fn(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            os.kill(os.getpid(), second)  # lands in the clean-up of the first

    assert guarded("specmd x", fn, []) == 143
    assert capsys.readouterr().err == "specmd x: stopped by SIGTERM\n"


def test_a_signal_while_the_process_exits_keeps_the_first_signals_exit_code():
    """SIGTERM then Ctrl-C: the run recorded SIGTERM and printed its line, then the Ctrl-C landed while the
    interpreter joined its threads (a second, measured) and the process died of SIGINT (exit 130). The console
    entry ignores ending signals once the command has its exit code."""
    import subprocess

    script = ("import atexit, os, signal, sys, time\n"
              "import specmd.cli as cli\n"
              "def stop(argv):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "atexit.register(time.sleep, 1)\n"  # a slow exit, as joining a worker thread is
              "cli.BY_NAME['stop'] = cli.Command('stop', '__main__', '', '__main__:stop')\n"
              "sys.argv = ['specmd', 'stop']\n"
              "cli.main()\n")
    p = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    assert p.stderr.readline() == "specmd stop: stopped by SIGTERM\n"
    p.send_signal(signal.SIGINT)  # (the line is printed: the process is exiting)
    assert p.wait(timeout=60) == 143 and p.stderr.read() == ""


def test_a_signal_while_an_error_is_reported_is_held(monkeypatch, capsys):
    import specmd.ending as ending

    classify = ending.classify

    def slow_classify(exc):
        os.kill(os.getpid(), signal.SIGHUP)  # a dropped ssh session as the error line is being written
        return classify(exc)

    monkeypatch.setattr(ending, "classify", slow_classify)

    def fn(argv):
        raise ConfigError("x=1 is bad; valid: 2")

    assert guarded("specmd x", fn, []) == 2
    assert capsys.readouterr().err == "specmd x: error: x=1 is bad; valid: 2\n"


def test_a_run_stopped_before_it_could_record_its_end_still_writes_failed_json(tmp_path, monkeypatch, capsys):
    """A Ctrl-C one second after start (Hydra saving its config, the run importing torch) left a run directory
    with no failed.json: from the moment the directory exists, failed.json says how the run ended."""
    import specmd.app
    from specmd.cli import main

    def interrupted(*a, **k):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(specmd.app, "execute", interrupted)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main([*FAST, f"hydra.run.dir={run}"])
    assert e.value.code == 130 and capsys.readouterr().err.endswith("specmd: stopped by SIGINT\n")
    failed = json.loads((run / "failed.json").read_text())
    assert (failed["stage"], failed["kind"], failed["signal"]) == ("config", "signal", "SIGINT")


def test_a_second_signal_while_the_stop_is_reported_cannot_cut_it_short(monkeypatch):
    class Stderr:  # the second Ctrl-C (a process group's, timeout's) lands as the line is written
        text = ""

        def write(self, text):
            os.kill(os.getpid(), signal.SIGINT)
            Stderr.text += text

        def flush(self):
            pass

    def fn(argv):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(sys, "stderr", Stderr())
    assert guarded("specmd x", fn, []) == 130
    assert Stderr.text == "specmd x: stopped by SIGINT\n"


def test_composition_errors_and_a_used_run_dir_through_the_cli_are_one_line_exit_2(tmp_path, capsys, mirror):
    from specmd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["model=nope"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("specmd: error: In 'config': Could not find 'model/nope'"), err
    assert err.count("\n") == 1
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text("{}")  # an earlier run's
    with pytest.raises(SystemExit) as e:
        main([*FAST, f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already holds a run (results.json)" in err, err
    assert sorted(p.name for p in run.iterdir()) == ["results.json"]  # nothing written beside it


# ---- signals: never lost ---------------------------------------------------------------------------------
class _SignalInFinalizer:
    """An object whose finalizer is running when SIGTERM arrives: the handler's exception is raised inside
    ``__del__``, where Python prints and discards it."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)


LOST = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost exception itself


@LOST
def test_a_signal_lost_in_a_finalizer_stops_the_job_at_the_next_safe_point():
    with pytest.raises(Interrupted) as e:
        with signals_raise():
            obj = _SignalInFinalizer()
            del obj
            gc.collect()
            assert SIGNALS.pending == signal.SIGTERM  # recorded, its exception discarded
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # still armed
            check_interrupt()  # a safe point
            pytest.fail("the safe point did not raise")
    assert e.value.signum == signal.SIGTERM and SIGNALS.pending == 0


@LOST
def test_a_signal_lost_in_a_finalizer_is_raised_at_the_end_of_the_block_at_the_latest():
    with pytest.raises(Interrupted):
        with signals_raise():
            obj = _SignalInFinalizer()
            del obj
            gc.collect()
    # and a later signal is not ignored (the old handler set both to SIG_IGN before raising)
    with pytest.raises(Interrupted):
        with signals_raise():
            os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_while_the_failure_is_written_is_recorded_not_raised():
    written = []
    with pytest.raises(Interrupted) as e:
        with signals_raise():
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while failed.json is written
                written.append("failed.json")
            assert SIGNALS.pending == signal.SIGINT
    assert e.value.signum == signal.SIGINT and written == ["failed.json"]
    check_interrupt()  # outside any block: nothing pending, nothing raised


@LOST
def test_a_run_stopped_by_a_signal_its_finalizer_swallowed_writes_failed_json(tmp_path, monkeypatch, mirror):
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR, app

    def _execute(run, digest, run_dir, group, progress):
        progress.stage = "load"
        obj = _SignalInFinalizer()
        del obj
        gc.collect()
        progress.stage = "evaluate"  # a safe point: the lost signal stops the job here, in stage load
        pytest.fail("the stage change did not raise")

    monkeypatch.setattr(app, "_execute", _execute)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=FAST)
    with pytest.raises(Interrupted):
        app.execute(cfg, run_dir=str(tmp_path))
    failed = json.loads((tmp_path / "failed.json").read_text())
    assert (failed["kind"], failed["signal"], failed["stage"]) == ("signal", "SIGTERM", "load")


def test_a_top_level_key_specmd_reads_nowhere_is_a_config_error(mirror):
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import Run

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        with pytest.raises(ConfigError, match="foo: no such setting \\(added with \\+key=...\\); a run's settings: "
                                              "data, device, "):
            Run(compose(config_name="config", overrides=[*FAST, "+foo=bar"]))
        Run(compose(config_name="config", overrides=[*FAST, "+experiment=specmd_fig4"]))  # adds experiment, report


def test_a_rerun_that_succeeds_leaves_no_earlier_failed_json(tmp_path):
    from specmd import app

    (tmp_path / "failed.json").write_text("{}")  # an interrupted attempt in the trace cache's directory
    logger = type("L", (), {"log_run": lambda *a: None})()
    progress = type("P", (), {"wrote_results": False, "stage": "write"})()
    app._finish({"cache": {"hits": 1}}, None, "abc", tmp_path, logger, progress)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_signal_of_an_earlier_block_does_not_stop_the_next():
    SIGNALS.pending = signal.SIGTERM  # landed as an earlier block ended (depth back at 0)
    with signals_raise():
        check_interrupt()  # not this block's signal: nothing raised
    assert SIGNALS.pending == 0


def test_a_second_signal_during_cleanup_cannot_leave_a_temporary_file(tmp_path, monkeypatch):
    from specmd.results import write_file

    unlink = Path.unlink

    def interrupted_unlink(self, missing_ok=False):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, as the temporary file is removed
        unlink(self, missing_ok=missing_ok)

    def half(tmp):
        tmp.write_text("half")
        monkeypatch.setattr(Path, "unlink", interrupted_unlink)
        os.kill(os.getpid(), signal.SIGINT)  # the first
        for _ in range(1000):  # (the handler runs between bytecodes, here)
            pass

    with pytest.raises(Interrupted):
        with signals_raise():
            write_file(tmp_path / "out.csv", half)
    assert list(tmp_path.iterdir()) == []


def test_hydra_lets_a_file_it_cannot_write_reach_the_one_error_path():
    from specmd.cli.hydra_apps import _composition_errors_raise

    def printing(func):  # Hydra's run_and_report: prints a traceback and exits 1 for whatever reaches it
        try:
            return func()
        except Exception:
            raise SystemExit(1)

    def full():
        raise OSError(errno.ENOSPC, "No space left on device", "run/.hydra/config.yaml")

    with pytest.raises(OSError) as e:
        _composition_errors_raise(printing)(full)
    assert classify(e.value)[:2] == (1, "run/.hydra/config.yaml: No space left on device")


def test_python_m_specmd_report_has_the_one_error_path(tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["specmd.commands.report", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("specmd.commands.report", run_name="__main__")
    assert e.value.code == 2 and capsys.readouterr().err == f"specmd report: error: {tmp_path / 'nowhere'}: no such directory\n"


def test_default_output_directories_are_a_processs_own():
    from specmd.results import unique_suffix
    from specmd.commands.mrc import parse as mrc_parse
    from specmd.commands.tune import parse as tune_parse

    assert tune_parse([])[0].out.endswith(unique_suffix())
    assert mrc_parse(["replay.trace=x"])[2].endswith(unique_suffix())


def test_mrc_writes_its_csv_last(tmp_path, monkeypatch):
    from specmd.commands import mrc

    monkeypatch.setattr(mrc, "compute", lambda *a: [{"policy": "lru", "capacity": 0.1, "hit_rate": 0.5,
                                                      "collision_rate": 0.0}])
    monkeypatch.setattr(mrc, "plot", lambda rows, path: (_ for _ in ()).throw(Interrupted(signal.SIGINT)))
    with pytest.raises(Interrupted):
        mrc.main(["replay.trace=x", f"mrc.out={tmp_path / 'm'}"])
    assert not (tmp_path / "m" / "mrc.csv").exists()  # so the same mrc.out is not refused as done


# ---- one run per run directory -----------------------------------------------------------------------------
@pytest.mark.parametrize("held", [".hydra", "results.json", "failed.json"])
def test_a_run_directory_holds_one_run(tmp_path, held):
    run = tmp_path / "run"
    claim_run_dir(run, ".hydra")
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(run, ".hydra")  # the second of two runs given one hydra.run.dir
    other = tmp_path / "other"
    other.mkdir()
    (other / held).mkdir() if held == ".hydra" else (other / held).write_text("{}")
    with pytest.raises(ConfigError, match=rf"hydra.run.dir={other} already holds a run \({held}"):
        claim_run_dir(other, ".hydra")
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_run_dir(empty, ".hydra")  # a directory the user made for it: fine


def test_of_two_runs_claiming_one_directory_at_once_one_gets_it(tmp_path, monkeypatch):
    claim_run_dir(tmp_path, ".hydra")
    monkeypatch.setattr(Path, "exists", lambda self: False)  # both looked before either claimed
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(tmp_path, ".hydra")


@pytest.mark.parametrize("where, why", [("file/x", "{tmp}/file is a file, not a directory ({tmp}/file/x cannot be "
                                                   "created under it)"),
                                        ("a" * 300, "the name aaaaaaaaaaaaaaaaaaaaaaaa... is 300 bytes long; this file "
                                                    "system takes at most 255")])
def test_a_run_directory_that_cannot_be_made_is_named(tmp_path, where, why):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as e:
        claim_run_dir(tmp_path / where, ".hydra")
    assert str(e.value) == f"hydra.run.dir={tmp_path / where}: " + why.format(tmp=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created


# ---- launchers and W&B: rejected at config time -------------------------------------------------------------
def _multirun_start(launcher: dict, sweep_dir="sweep"):
    from omegaconf import OmegaConf

    from specmd.cli.launch import SweepEnd
    from specmd.jobs import OPENED
    from specmd.liveness import release_sweep

    try:
        SweepEnd().on_multirun_start(OmegaConf.create({"hydra": {"launcher": launcher, "sweep": {"dir": sweep_dir}}}))
    finally:  # (what a sweep's end releases: the launcher's lock)
        release_sweep()
        OPENED.pop("sweep", None)


@pytest.mark.parametrize("launcher, words", [
    ({"_target_": "hydra_plugins.x.JoblibLauncher", "n_jobs": 0}, "hydra.launcher.n_jobs=0 runs no job"),
    ({"_target_": "x.LocalSubmititLauncher", "timeout_min": 0}, "hydra.launcher.timeout_min=0 must be >= 1"),
    ({"_target_": "x.LocalSubmititLauncher", "mem_gb": 0}, "hydra.launcher.mem_gb=0 must be > 0"),
    ({"_target_": "x.LocalSubmititLauncher", "gpus_per_node": -1}, "hydra.launcher.gpus_per_node=-1 must be >= 0"),
    ({"_target_": "x.SlurmLauncher"}, "SLURM's srun is not on this machine's PATH"),
])
def test_launcher_settings_the_launcher_would_fail_on_are_one_line_exit_2(launcher, words, capsys, monkeypatch,
                                                                          tmp_path):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        _multirun_start(launcher)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("specmd: error: ") and words in err and err.count("\n") == 1, err
    _multirun_start({"_target_": "x.LocalSubmititLauncher", "mem_gb": 4, "timeout_min": 60, "gpus_per_node": 0},
                    str(tmp_path / "sweep"))


def test_a_sweep_directory_it_cannot_write_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        _multirun_start({"_target_": "x.JoblibLauncher", "n_jobs": 1}, str(tmp_path / "file"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"specmd: error: hydra.sweep.dir={tmp_path / 'file'}: {tmp_path / 'file'} is "
                                         "a file, not a directory\n")


@pytest.mark.parametrize("kw, words", [({"project": "team/specmd"}, "Invalid project name 'team/specmd'"),
                                       ({"tags": ["t" * 65]}, "is 65 characters"),
                                       ({"group": "g" * 129}, "W&B takes at most 128")])
def test_wandb_settings_wandb_would_reject_are_config_errors(kw, words):
    from specmd.loggers import WandbLogger

    with pytest.raises(ConfigError, match=words):
        WandbLogger(**kw)
    WandbLogger(project="specmd", tags=["t" * 64], group="g" * 128)  # the limits themselves are fine


def test_automatic_wandb_tags_are_cut_to_wandb_length():
    from specmd.loggers import run_tags

    tags = run_tags({"model": {"name": "m" * 100}, "eval": {"tasks": ["wikitext"]}})
    assert tags == ["model=" + "m" * 58, "task=wikitext"]


# ---- tune: a quality it knows how to judge ----------------------------------------------------------------
def test_tune_judges_each_task_by_its_papers_metric_and_direction():
    from specmd.commands.tune import quality_loss, quality_measure

    assert quality_measure("wikitext", "", None) == ("word_perplexity", False)
    assert quality_measure("gsm8k", "", None) == ("exact_match/strict-match", True)
    assert quality_measure("hellaswag", "acc_norm", True) == ("acc_norm", True)
    assert quality_measure("lambada_openai", "perplexity", None) == ("perplexity", False)
    assert quality_measure("hellaswag", "acc_norm", None) == ("acc_norm", True)  # an accuracy: known
    assert quality_loss(11.0, 10.0, higher=False) == pytest.approx(0.1)   # perplexity up 10%: 10% lost
    assert quality_loss(0.45, 0.5, higher=True) == pytest.approx(0.1)     # accuracy down 10%: 10% lost
    assert quality_loss(0.55, 0.5, higher=True) == pytest.approx(-0.1)    # better: no loss


@pytest.mark.parametrize("argv, words", [
    (["tune.quality_task=hellaswag"], "tune.quality_task=hellaswag: tune knows the quality metric of"),
    (["tune.quality_task=hellaswag", "tune.quality_metric=brier_score"],
     "tune.quality_metric=brier_score: whether higher or lower is better is unknown"),
    (["tune.quality_higher=maybe"], "'maybe' is not a valid value for tune.quality_higher"),
    # a direction against the metric's known one: every lossy stack would "gain" quality and fit any budget
    (["tune.quality_higher=true"], "tune.quality_higher=true contradicts word_perplexity of wikitext, whose lower"),
    (["tune.quality_task=gsm8k", "tune.quality_higher=false"], "tune.quality_higher=false contradicts exact_match/"),
    (["tune.quality_task=hellaswag", "tune.quality_metric=acc_norm", "tune.quality_higher=false"],
     "tune.quality_higher=false contradicts acc_norm of hellaswag, whose higher"),
])
def test_tune_refuses_a_quality_it_cannot_judge_before_any_work(argv, words):
    from specmd.commands.tune import parse

    with pytest.raises(ConfigError, match=words):
        parse(argv)


@pytest.mark.parametrize("task, words", [
    ({"exact_match/strict-match": float("nan")}, "tasks.gsm8k.exact_match/strict-match is nan, not a finite"),
    ({"exact_match/strict-match": "n/a"}, "tasks.gsm8k.exact_match/strict-match is 'n/a', not a finite"),
    ({"sample_len": 1.0}, "tasks.gsm8k has no 'exact_match/strict-match' \\(it has sample_len\\)"),
])
def test_tune_names_the_file_and_key_of_a_score_it_cannot_judge(tmp_path, task, words):
    from specmd.commands.tune import parse, quality_value

    opts, _ = parse(["tune.quality_task=gsm8k"])
    with pytest.raises(DataError, match=f"{tmp_path / 'results.json'}: {words}"):
        quality_value({"tasks": {"gsm8k": task}}, opts, tmp_path / "results.json")


def test_tune_takes_a_single_value_as_a_one_element_list_and_says_so():
    from specmd.commands.tune import parse

    opts, _ = parse(["tune.capacities=0.05", "tune.eviction=lru", "tune.prefetch=[none]"])
    assert opts.capacities == [0.05] and opts.choices["eviction"] == ["lru"]
    assert opts.notes == ["tune.capacities=0.05: one value, taken as the list capacities=[0.05]",
                          "tune.eviction=lru: one value, taken as the list eviction=[lru]"]


def test_mrc_takes_a_single_value_as_a_one_element_list_and_says_so(capsys):
    from specmd.commands.mrc import parse

    policies, caps, *_ = parse(["replay.trace=/x", "mrc.capacities=0.05", "eviction=lru"])
    assert caps == [0.05] and policies == ["lru"]
    assert capsys.readouterr().err.splitlines() == [
        "specmd mrc: note: mrc.capacities=0.05: one value, taken as the list capacities=[0.05]",
        "specmd mrc: note: eviction=lru: one value, taken as the list eviction=[lru]"]


def test_tune_replays_a_repeated_capacity_once():
    from specmd.commands.tune import candidates, parse

    opts, _ = parse(["tune.capacities=[0.05,0.05,0.1,0.050]", "tune.eviction=[lru]", "tune.routing=[standard]",
                     "tune.miss=[fetch]", "tune.prefetch=[none]"])
    assert opts.capacities == [0.05, 0.1]
    stacks = candidates(opts, 0.2)
    assert len(stacks) == len(set(stacks)) == 2


@pytest.mark.parametrize("command", ["tune", "mrc"])
def test_an_output_directory_it_cannot_write_is_refused_before_any_work(tmp_path, command, monkeypatch, capsys):
    from specmd.commands import mrc, tune
    from specmd.cli import main

    def no_work(*a, **k):
        pytest.fail("work started before the output directory was checked")

    monkeypatch.setattr(mrc, "compute", no_work)
    monkeypatch.setattr("specmd.app.recorded_trace", no_work)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    argv = {"tune": ["tune", "model=tiny", f"tune.out={out}"],
            "mrc": ["mrc", f"replay.trace={tmp_path}", f"mrc.out={out}"]}[command]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{command}.out={out}: {tmp_path / 'file'} is a file, not a directory" in err, err
    assert tune  # (imported for the patch target's module)


@pytest.mark.parametrize("recorded", [{"name": "deep_olmoe"}, "deep_olmoe"])  # a live run's mapping, a bare name
def test_tune_refuses_a_trace_of_another_model_than_its_live_runs(tmp_path, recorded):
    import shutil

    from rich.console import Console

    from specmd.commands.tune import parse, tune

    trace = tmp_path / "trace"
    shutil.copytree(Path(__file__).with_name("data") / "embedded_trace", trace)
    meta = json.loads((trace / "meta.json").read_text())
    meta["source"] = {"model": recorded}  # however the trace spells it, the check reads it
    (trace / "meta.json").write_text(json.dumps(meta))
    opts, base = parse(["model=tiny", f"replay.trace={trace}", f"tune.out={tmp_path / 'tune'}"])
    with pytest.raises(ConfigError, match=f"replay.trace={trace} was recorded on specmd:deep-olmoe, but the live "
                                          r"runs of the finalists would run model=tiny \(specmd:tiny-olmoe\): add "
                                          "model=deep_olmoe"):
        tune(opts, base, Console())
    assert not (tmp_path / "tune").exists()  # nothing written, no empty directory


@pytest.mark.parametrize("argv, words", [
    (["tune.out="], "tune.out= is empty"),
    (["tune.trials=abc"], "'tune.trials=abc': tune.trials is a whole number >= 1"),
])
def test_tune_options_bad_values(argv, words):
    import re

    from specmd.commands.tune import parse

    with pytest.raises(ConfigError, match=re.escape(words)):
        parse(argv)


def test_an_output_option_reads_quotes_as_hydra_does(tmp_path):
    from specmd.commands import plain_value
    from specmd.commands.tune import parse

    assert plain_value("mrc.out", f"'{tmp_path}/a b,c=d'") == f"{tmp_path}/a b,c=d"
    assert parse([f'tune.out="{tmp_path}/t 1,x"'])[0].out == f"{tmp_path}/t 1,x"
    assert plain_value("mrc.out", "plain/path") == "plain/path"


@pytest.mark.parametrize("argv, words", [
    (["--bogus"], "'--bogus': specmd mrc takes overrides (key=value), not options"),
    (["mrc.capacitys=[0.1]"], "mrc.capacitys: unknown option; valid: mrc.capacities, mrc.out, mrc.jobs"),
    (["mrc.out=", "replay.trace=x"], "mrc.out= is empty"),
])
def test_mrc_options_bad_values(argv, words):
    import re

    from specmd.commands.mrc import parse

    with pytest.raises(ConfigError, match=re.escape(words)):
        parse(argv)


@pytest.mark.parametrize("holds, option", [("mrc.csv", "mrc.out"), ("tune.json", "tune.out")])
def test_an_output_directory_holding_an_earlier_result_is_refused(tmp_path, holds, option):
    from specmd.results import output_dir

    (tmp_path / holds).write_text("earlier")
    with pytest.raises(ConfigError, match=f"{option}={tmp_path} already holds {holds} of an earlier run"):
        output_dir(tmp_path, option, holds)
    assert output_dir(tmp_path / "new", option, holds) == tmp_path / "new" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("option, value", [("--steps", "0"), ("--cap", "-3"), ("--batch", "-1"), ("--tokens", "0"),
                                           ("--window", "1")])
def test_train_eviction_refuses_degenerate_numbers_before_any_work(tmp_path, option, value):
    from specmd.commands.train_eviction import main

    with pytest.raises(ConfigError, match=f"{option}={value} must be >= "):
        main(["--traces", str(tmp_path), "--out", str(tmp_path / "w.safetensors"), option, value])


# ---- outputs whole or absent; nothing computed lost -----------------------------------------------------------
def test_an_output_interrupted_while_written_leaves_nothing(tmp_path):
    from specmd.results import write_csv, write_file

    def half(tmp):
        tmp.write_text("half a ta")
        raise Interrupted(signal.SIGINT)

    with pytest.raises(Interrupted):
        write_file(tmp_path / "mrc.csv", half)
    assert list(tmp_path.iterdir()) == []
    write_csv(tmp_path / "a.csv", [{"x": 1}, {"x": 2}])
    assert (tmp_path / "a.csv").read_text().split() == ["x", "1", "2"] and len(list(tmp_path.iterdir())) == 1


def test_a_failure_record_the_run_directory_cannot_take_is_kept_elsewhere(tmp_path):
    from specmd.jobs import write_failed

    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"  # cannot be written (as a full disk or a read-only mount)
    where = write_failed(run_dir, "evaluate", RuntimeError("boom"), {"model": "tiny"}, {"cache": {"hits": 7}})
    kept = json.loads(Path(where).read_text())
    assert kept["cache"] == {"hits": 7} and kept["stage"] == "evaluate" and kept["run_dir"] == str(run_dir)
    assert "not_written" in kept and str(run_dir / "failed.json") in kept["not_written"]


def test_results_the_run_directory_cannot_take_are_kept_and_named(tmp_path):
    from specmd import app

    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"  # cannot take results.json (as a full disk or a read-only mount)

    class Progress:
        wrote_results = False
        stage = "write"

    logger = type("L", (), {"log_run": lambda *a: None})()
    with pytest.raises(OSError, match="the run's results are kept in ") as e:
        app._finish({"cache": {"hits": 3}}, None, "abc", run_dir, logger, Progress())
    kept = json.loads(Path(str(e.value).split("kept in ")[1].split(":")[0]).read_text())
    assert kept["cache"] == {"hits": 3} and kept["config_hash"] == "abc" and kept["run_dir"] == str(run_dir)
    assert e.value.errno == errno.ENOTDIR  # one line naming the path, exit 2 (specmd.ending)


@pytest.fixture
def rescue_here(tmp_path, monkeypatch):
    """``<tmp>`` (where specmd keeps what a directory could not take) inside the test's own directory."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp" / "specmd-rescue"


def _full_under(monkeypatch, directory: Path):
    """``os.fsync`` of a file under ``directory`` fails as a full disk does (no file name in the error)."""
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("writer", ["json", "text", "csv"])
def test_a_failed_write_names_the_file_and_keeps_what_it_held(tmp_path, rescue_here, writer, monkeypatch):
    from specmd.results import write_csv, write_json_atomic, write_text_atomic

    path = tmp_path / "out" / "x.out"
    real = os.replace

    def replace(a, b):  # the user's directory is full (the error names no file, as f.write's does)
        if Path(b).parent == path.parent:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    write = {"json": lambda: write_json_atomic(path, {"a": 1}), "text": lambda: write_text_atomic(path, "a 1\n"),
             "csv": lambda: write_csv(path, [{"a": 1}])}[writer]
    with pytest.raises(OSError) as e:
        write()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    kept = Path(e.value.strerror.split("what it held is kept in ")[1])
    assert kept.parent.parent == rescue_here and kept.parent.name.startswith(f"out-{os.getpid()}-")
    assert kept.name == "x.out" and "1" in kept.read_text()
    assert list(path.parent.iterdir()) == []  # no temporary left, no half file
    assert classify(e.value)[:2] == (1, f"{path}: No space left on device; what it held is kept in {kept}")


def test_a_run_on_a_full_disk_is_one_line_naming_the_file_with_its_results_kept(tmp_path, rescue_here, monkeypatch,
                                                                                 capsys, mirror):
    from specmd.cli import main

    run = tmp_path / "run"
    _full_under(monkeypatch, run)
    with pytest.raises(SystemExit) as e:
        main([*FAST, f"hydra.run.dir={run}"])
    from specmd.results import rescue_dir

    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = rescue_dir(run)
    assert kept.parent == rescue_here
    assert e.value.code == 1 and err == (f"specmd: error in stage write: {run}/results.json: No space left on device; "
                                         f"what it held is kept in {kept}/results.json (failed.json: "
                                         f"{kept}/failed.json)"), err
    assert json.loads((kept / "results.json").read_text())["tasks"]["wikitext"]
    assert json.loads((kept / "failed.json").read_text())["stage"] == "write"
    assert not (run / "results.json").exists()


def test_hydra_writing_its_record_on_a_full_disk_names_the_directory(tmp_path, monkeypatch):
    """Hydra's ``.hydra/config.yaml`` on a full disk fails as the file closes, naming no file: the error names the
    run's directory (then failed.json is kept, and the line is the full disk's, exit 1)."""
    from specmd.cli.hydra_apps import hydra_write_error
    from specmd.jobs import OPENED

    monkeypatch.setitem(OPENED, "dir", tmp_path / "run")
    exc = hydra_write_error(OSError(errno.ENOSPC, "No space left on device"))
    assert exc.filename == str(tmp_path / "run") and classify(exc)[:2] == (
        1, f"{tmp_path / 'run'}: No space left on device (Hydra writing its record of the run there)")
    named = OSError(errno.EACCES, "Permission denied", "/x/.hydra")
    assert hydra_write_error(named) is named


def test_a_sweep_whose_directory_is_full_is_one_line_not_a_warning(tmp_path, monkeypatch, capsys):
    """Hydra turns a callback's exception into a warning and goes on: the sweep's own record on a full disk was
    lost that way, and the sweep then failed naming no file."""
    import specmd.cli.launch as launch

    def full(sweep_dir):
        raise OSError(errno.ENOSPC, "No space left on device", str(sweep_dir / ".sweep.json"))

    monkeypatch.setattr(launch, "hold_sweep", full)
    with pytest.raises(SystemExit) as e:
        _multirun_start({"_target_": "x.BasicLauncher"}, str(tmp_path / "sweep"))
    assert e.value.code == 1
    assert capsys.readouterr().err == f"specmd: error: {tmp_path / 'sweep' / '.sweep.json'}: No space left on device\n"


def test_a_trace_recorded_onto_a_full_disk_names_its_file(tmp_path):
    from specmd.replay.trace import TraceWriter

    class Full:
        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")  # (the last buffer, flushed as it closes)

    writer = TraceWriter.__new__(TraceWriter)
    writer.path, writer.files = tmp_path / "trace", {"index": Full(), "passes": Full()}
    with pytest.raises(OSError) as e:
        writer.close()
    assert e.value.filename == str(tmp_path / "trace" / "index.bin") and e.value.errno == errno.ENOSPC


def test_calibrate_keeps_the_profile_a_full_disk_refused(tmp_path, rescue_here, monkeypatch):
    from specmd import results

    written = results._write_fd
    calls = []

    def full(fd, data):  # the profiles' disk is full; the temporary directory's is not
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        written(fd, data)

    monkeypatch.setattr(results, "_write_fd", full)
    a, b = tmp_path / "hw" / "a.yaml", tmp_path / "hw" / "b.yaml"
    with pytest.raises(OSError) as e:
        results.write_files([(a, results.content_fill("a: 1\n")), (b, results.content_fill("b: 2\n"))],
                            what="what calibrate measured")
    from specmd.results import rescue_dir

    kept = rescue_dir(a.parent)
    assert kept.parent == rescue_here and e.value.filename == str(a) and e.value.strerror.endswith(f"what calibrate measured is kept in {kept}/ "
                                                                "(a.yaml, b.yaml)")
    assert (kept / "a.yaml").read_text() == "a: 1\n" and (kept / "b.yaml").read_text() == "b: 2\n"
    assert list(a.parent.iterdir()) == []


def test_results_nowhere_to_be_kept_are_printed_not_lost(tmp_path, monkeypatch, capsys):
    """The run directory and the temporary directory both full (often one file system): the results go to
    stderr, the last resort, and the error says so."""
    from specmd import app, results

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(results, "rescue_dir", lambda d: tmp_path / "file" / "rescue")  # cannot be made either
    real = os.replace

    def replace(a, b):
        if Path(b).parent == tmp_path / "run":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)

    class Progress:
        wrote_results = False
        stage = "write"

    logger = type("L", (), {"log_run": lambda *a: None})()
    with pytest.raises(OSError, match=r"the run's results are kept in stderr \(above\)"):
        app._finish({"cache": {"hits": 5}}, None, "abc", tmp_path / "run", logger, Progress())
    assert '"cache": {"hits": 5}' in capsys.readouterr().err


def test_replay_pool_workers_die_quietly_on_a_signal():
    from specmd import pool

    saved = {s: signal.getsignal(s) for s in ENDING}
    try:
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # as a parent that ignores one (nohup's SIGHUP) passes it on
        with signals_raise():
            pool._worker_init()  # what a forked worker runs first
            assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            # the parent acts on a closed terminal's SIGHUP (the group gets it): a worker ignores it, and keeps
            # ignoring what the parent ignored -- a worker dead of SIGHUP left Pool.map waiting forever
            assert signal.getsignal(signal.SIGHUP) == signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert sys.modules["torch"].get_num_threads() == 1
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
