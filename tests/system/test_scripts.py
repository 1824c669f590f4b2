"""The scripts a user runs beside the commands (``benchmarks/*.py``) end as a command does
(:mod:`specmd.cli.script`): bad arguments are one line and exit 2 before any work, a failed section exit 1."""

import importlib.util
import re

import pytest

from tests.conftest import ROOT
from specmd.ending import guarded

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_script_ends_as_a_command(name):
    text = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert f'script.run("benchmarks/{name}.py", main)' in text or f'run("benchmarks/{name}.py", main)' in text
    assert "argparse.ArgumentParser(" not in text and re.search(r"def main\(argv: list\) -> int:", text)
    assert "sys.exit(" not in text.split("def main(argv: list) -> int:")[1]  # (its code is main's return value)


@pytest.fixture(scope="module")
def gpu_check():
    return load("gpu_check")


@pytest.mark.parametrize("argv, words", [
    (["--device", "tpu"], "argument --device: --device 'tpu' is not a torch device"),
    (["--device", "meta"], "argument --device: --device meta: specmd runs on cpu, cuda, mps, not meta"),
    (["--skip", "lossless", "nope"], "argument --skip: 'nope' is not one of --skip's choices: lossless, policies"),
    (["--out", "{tmp}"], "argument --out: {tmp} is a directory; name a file, e.g. {tmp}/out.json"),
    (["--out", "{tmp}/file/x.json"], "argument --out: {tmp}/file is a file, not a directory"),
    (["--quick", "--colour"], "unrecognized arguments: --colour (usage: "),
])
def test_gpu_check_refuses_bad_arguments_before_any_work(gpu_check, monkeypatch, capsys, tmp_path, argv, words):
    """``--device tpu`` printed a traceback in every section and exited 0; an unknown ``--skip`` was ignored (the
    whole check ran); ``--out`` a directory failed only at the end."""
    for name in gpu_check.SECTIONS[:-1]:
        monkeypatch.setattr(gpu_check, {"calibrate": "calibrate_section", "fidelity": "fidelity_section"}.get(
            name, name), lambda *a: pytest.fail("a section ran"))
    monkeypatch.setattr(gpu_check, "decode_sections", lambda *a: pytest.fail("a section ran"))
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert guarded("benchmarks/gpu_check.py", gpu_check.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"benchmarks/gpu_check.py: error: {words.replace('{tmp}', str(tmp_path))}" in err


def test_a_failed_section_makes_the_exit_code_1(gpu_check, monkeypatch, capsys, tmp_path):
    def broken(device, quick):
        raise RuntimeError("no link here")

    monkeypatch.setattr(gpu_check, "link", broken)
    out = tmp_path / "gpu.json"
    skip = [s for s in gpu_check.SECTIONS if s != "link"]
    assert guarded("benchmarks/gpu_check.py", gpu_check.main, ["--device", "cpu", "--out", str(out), "--skip",
                                                                *skip]) == 1
    import json

    r = json.loads(out.read_text())
    assert r["failed"] == ["link"] and ["link", "FAILED", "RuntimeError: no link here", ""] in r["rows"]
    assert "failed sections: link" in capsys.readouterr().err


def test_counting_refuses_an_unknown_model_in_one_line(capsys):
    counting = load("counting")
    assert guarded("benchmarks/counting.py", counting.main, ["--models", "olmoe", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --models: 'nope' is not one of --models's choices: olmoe" in err
