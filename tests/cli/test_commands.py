"""The commands' one home (specmd/cli): ``specmd --help`` prints the table, every command answers ``--help``
with its own help and exit 0, an unknown command names the known ones (exit 2), and a run's command line goes
to the run as before. In-process through :func:`specmd.cli.main` (a subprocess per command would cost a
Python start and a torch import each), plus one subprocess through ``python -m specmd``."""

import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT
from specmd import cli
from specmd.cli import COMMANDS


def call(argv, capsys) -> tuple:
    """(exit code, stdout + stderr) of ``specmd ARGV``."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_help_lists_every_command_of_the_table(capsys):
    code, out = call(["--help"], capsys)
    assert code == 0
    for c in COMMANDS:  # one row per command: its name and its line
        assert re.search(rf"^  {re.escape(c.name)} +{re.escape(c.help)}$", out, re.M), c.name
    assert "specmd run --help" in out  # the run's own (Hydra's) help is one word away


def test_the_table_is_one_line_per_command():
    names = [c.name for c in COMMANDS]
    assert len(names) == len(set(names)) and names[0] == "run"
    for c in COMMANDS:
        assert "\n" not in c.help and len(c.help) <= 100, c.name
        assert not cli.is_override_or_option(c.name), c.name  # a name never reads as an override


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_every_command_prints_its_own_help(name, capsys):
    code, out = call([name, "--help"], capsys)
    assert code == 0, out[-2000:]
    assert f"specmd {name}" in out, out[:2000]  # its usage, not another command's (nor an error)
    assert "Traceback" not in out


def test_unknown_command_names_the_known_ones(capsys):
    code, out = call(["frobnicate"], capsys)
    assert code == 2
    assert "unknown command 'frobnicate'" in out
    for c in COMMANDS:
        assert c.name in out
    code, out = call(["stauts", "outputs"], capsys)
    assert code == 2 and "did you mean 'status'" in out


def test_a_runs_command_line_goes_to_the_run(monkeypatch, capsys):
    """No command: overrides and Hydra options are a run's, as before the table (``specmd -m ...`` a sweep);
    ``specmd sweep ...`` is the run with ``-m``."""
    from specmd.cli import hydra_apps

    seen = []
    monkeypatch.setattr(hydra_apps, "run", lambda argv: seen.append(list(argv)) or 0)
    for argv in ([], ["eviction=lru"], ["+experiment=specmd_fig4"], ["~logger"], ["-m", "eviction=lru,lfu"],
                 ["--cfg", "job"], ["run", "eviction=lru"]):
        assert call(argv, capsys)[0] == 0
    assert call(["sweep", "eviction=lru,lfu"], capsys)[0] == 0
    assert seen == [[], ["eviction=lru"], ["+experiment=specmd_fig4"], ["~logger"], ["-m", "eviction=lru,lfu"],
                    ["--cfg", "job"], ["eviction=lru"], ["-m", "eviction=lru,lfu"]]


def test_the_entry_points_are_the_dispatcher():
    """The console script and ``python -m specmd`` are :func:`specmd.cli.main`; nothing else dispatches."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"specmd": "specmd.cli:main"}
    import specmd.__main__ as entry

    assert entry.main is cli.main
    r = subprocess.run([sys.executable, "-m", "specmd", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and all(c.name in r.stdout for c in COMMANDS), r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "specmd", "frobnicate"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "unknown command" in r.stderr and "train-eviction" in r.stderr


@pytest.mark.parametrize("name", [c.name for c in COMMANDS if c.name not in ("run", "sweep", "train")])
def test_every_command_refuses_an_unknown_option_in_one_line(name, capsys):
    """argparse's own error was a usage block and a line; every command's bad input is one line, exit 2."""
    code, out = call([name, "--no-such-option", "x"], capsys)
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"specmd {name}: error: ") and "Exception" not in out
    assert "--no-such-option" in out or "required" in out  # (train-eviction: its required --out is named first)
