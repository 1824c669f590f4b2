"""specmd report and specmd status on what they cannot trust (issue 38): runs whose resolved configs differ in a
key no override names are kept apart, never averaged as repeats, and a claim that fails on one model does not
hold; a value in results.json that is no finite number is named with its file and key, never drawn or judged;
a job directory that cannot be read is skipped with a warning, never a traceback; an output path that cannot
be a report directory is an error naming it before any work, and every file stays inside it."""

import json

import pytest

from specmd.ending import guarded
import yaml

from specmd.errors import ConfigError
from specmd.commands.report import build, main
from specmd.sweeps import Job, expected_jobs, find_sweeps, load_sweep
from specmd.commands.status import main as status_main
from specmd.commands.report.tables import group_jobs
from specmd.commands.report.verdicts import FAILS, HOLDS, UNMEASURED, parse_spec

SPEC = {"rows": ["eviction.name"], "cols": "hardware.capacity", "repeat": ["eval.seed"],
        "metrics": [{"collision %": "cache.collision_rate"}],
        "checks": [{"claim": "Least-Stale collides less than LRU", "metric": "collision %",
                    "lower": {"eviction.name": "least_stale", "hardware.capacity": 0.05},
                    "than": {"eviction.name": "lru", "hardware.capacity": 0.05}}]}
PARAMS = {"eviction": "lru,least_stale", "hardware.capacity": "0.05", "eval.seed": "1,2"}


def config(model="deep_olmoe", **more):
    """A job's resolved config as results.json carries it (the keys a report reads, and some it must ignore)."""
    return {"experiment": "robust", "model": {"name": model, "num_layers": 16 if model == "deep_olmoe" else 32},
            "eviction": {"name": "lru"}, "hardware": {"capacity": 0.05}, "eval": {"seed": 1, "tasks": ["gsm8k"]},
            "threads": None, "logger": {"name": "none"}, "data": {"mirror": None}, "report": SPEC, **more}


def make_sweep(root, rates, model="deep_olmoe", params=PARAMS, raw=None, spec=SPEC, **more):
    """A sweep of experiment ``robust`` whose model comes from its config, not from an override. ``rates``:
    eviction -> collision rate (absent: the job never ran); ``raw``: (eviction, seed) -> the text of
    results.json's cache section (``NaN`` and ``Infinity`` as Python's json writes and reads them)."""
    root.mkdir(parents=True)
    base = config(model, **more)
    mr = {"hydra": {"sweeper": {"params": params}, "overrides": {"task": ["+experiment=robust"]}},
          **base, "report": spec}
    (root / "multirun.yaml").write_text(yaml.safe_dump(mr, sort_keys=False))
    for num, job in enumerate(expected_jobs(mr)):
        axes = dict(o.lstrip("+").split("=", 1) for o in job)
        if axes["eviction"] not in rates:
            continue
        d = root / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(job))
        cfg = dict(base, eviction={"name": axes["eviction"]}, eval={"seed": int(axes["eval.seed"]), "tasks": ["gsm8k"]},
                   threads=num, logger={"name": ["none", "wandb"][num % 2]})  # keys that change no number vary
        cache = (raw or {}).get((axes["eviction"], axes["eval.seed"]))
        if cache is None:
            cache = json.dumps({"collision_rate": rates[axes["eviction"]], "hit_rate": 0.5})
        (d / "results.json").write_text(f'{{"config": {json.dumps(cfg)}, "cache": {cache}, "config_hash": "{num}"}}')
    return root


def job_dir(root, eviction, seed):
    return next(d for d in sorted(root.iterdir()) if d.is_dir() and (d / ".hydra" / "overrides.yaml").exists()
                and f"eviction={eviction}" in yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
                and f"eval.seed={seed}" in yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()))


def table_lines(md: str) -> list:
    return [line for line in md.splitlines() if line.startswith("|")]


# --- 1. runs of different configs are never pooled ------------------------------------------------------------

def test_two_sweeps_on_two_models_are_kept_apart_and_a_claim_failing_on_one_does_not_hold(tmp_path, capsys):
    a = make_sweep(tmp_path / "a", {"lru": 0.10, "least_stale": 0.02})  # holds on deep_olmoe
    b = make_sweep(tmp_path / "b", {"lru": 0.03, "least_stale": 0.08}, model="mixtral")  # fails on mixtral
    # pooled, the means would be lru 6.5 vs least_stale 5.0: "holds", silently wrong
    assert main([str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "robust: 8/8 jobs, kept apart by config key(s) model.name" in out and "0 of 1 claim holds" in out
    md = (tmp_path / "o" / "robust.md").read_text()
    lines = table_lines(md)
    assert lines[0] == "| eviction.name | model.name | collision % @ hardware.capacity=0.05 |"
    assert "| lru | deep_olmoe | 10.0 ± 0.0 (n=2) |" in lines and "| least_stale | mixtral | 8.0 ± 0.0 (n=2) |" in lines
    assert "**does not hold**: Least-Stale collides less than LRU — collision %: holds at 1 of 2 model.name values; " \
           "not at model.name=mixtral" in md
    assert "  - ✓ model.name=deep_olmoe: least_stale 2.0 < lru 10.0" in md
    assert "  - ✗ model.name=mixtral: least_stale 8.0 > lru 3.0" in md
    # the section says what the runs differ in, and that they are kept apart; threads/logger/data/report: nothing
    note = next(line for line in md.splitlines() if "differ in their resolved config" in line)
    assert "model.name (deep_olmoe, mixtral)" in note and "model.num_layers (16, 32)" in note
    assert "kept apart by model.name" in note and "threads" not in note and "logger" not in note
    page = (tmp_path / "o" / "index.html").read_text()
    assert "model.name=mixtral: least_stale 8.0 &gt; lru 3.0" in page and "differ in their resolved config" in page


def test_a_figure_draws_each_model_apart(tmp_path, monkeypatch):
    import matplotlib.axes

    ticks = []
    real = matplotlib.axes.Axes.set_xticklabels
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticklabels",
                        lambda self, labels, *a, **k: ticks.append(list(labels)) or real(self, labels, *a, **k))
    spec = dict(SPEC, figures=[{"kind": "bars", "x": "eviction.name", "y": "cache.collision_rate"}])
    a = make_sweep(tmp_path / "a", {"lru": 0.10, "least_stale": 0.02}, spec=spec)
    b = make_sweep(tmp_path / "b", {"lru": 0.03, "least_stale": 0.08}, model="mixtral", spec=spec)
    build([str(a), str(b)], str(tmp_path / "o"))
    assert ticks == [["lru deep_olmoe", "least_stale deep_olmoe", "lru mixtral", "least_stale mixtral"]]


def test_keys_that_change_no_number_and_the_repeat_axes_still_pool(tmp_path):
    a = make_sweep(tmp_path / "a", {"lru": 0.10, "least_stale": 0.02})
    b = make_sweep(tmp_path / "b", {"lru": 0.12, "least_stale": 0.04}, data={"mirror": "/elsewhere"})
    out, (sec,) = build([str(a), str(b)], str(tmp_path / "o"))
    md = (out / "robust.md").read_text()
    assert "| lru | 11.0 ± 1.2 (n=4) |" in table_lines(md) and not sec.pooling and not sec.split_axes
    assert [v.status for v in sec.verdicts] == [HOLDS]


def test_a_default_changed_between_sweeps_splits_the_runs_by_that_key(tmp_path):
    """Not a group's name: the same model, a config value a default change moved (model.num_layers)."""
    a = make_sweep(tmp_path / "a", {"lru": 0.10, "least_stale": 0.02})
    b = make_sweep(tmp_path / "b", {"lru": 0.03, "least_stale": 0.08})
    cfg_b = tmp_path / "b"
    for f in cfg_b.glob("*/results.json"):
        res = json.loads(f.read_text())
        res["config"]["model"]["num_layers"] = 4
        f.write_text(json.dumps(res))
    _, (sec,) = build([str(a), str(b)], str(tmp_path / "o"))
    assert sec.split_axes == ["model.num_layers"] and [v.status for v in sec.verdicts] == [FAILS]


def test_a_job_that_never_ran_goes_with_its_own_sweeps_config():
    """It wrote no config: its sweep's stands for it, except the keys its overrides set (unknown, never a
    split of their own)."""
    spec = parse_spec(SPEC, "robust")

    def job(ev, seed, model, status="ok", own=True):
        cfg = config(model, eviction={"name": ev if own else "lru", "weights": None if own else "${model.x}"})
        return Job([f"eviction={ev}", "hardware.capacity=0.05", f"eval.seed={seed}"], status,
                   results={"cache": {"collision_rate": 0.1}} if status == "ok" else {}, config=cfg, own_config=own)

    jobs = [job("lru", 1, "deep_olmoe"), job("least_stale", 1, "deep_olmoe"), job("lru", 1, "mixtral"),
            job("least_stale", 1, "mixtral", "missing", own=False), job("least_stale", 2, "mixtral")]
    groups, rows = group_jobs(spec, jobs)
    assert rows == ["eviction.name", "model.name"]
    by = {(g.axes["eviction.name"], g.axes["model.name"]): len(g.jobs) for g in groups}
    assert by == {("lru", "deep_olmoe"): 1, ("least_stale", "deep_olmoe"): 1, ("lru", "mixtral"): 1,
                  ("least_stale", "mixtral"): 2}


# --- 2. values that are no finite number --------------------------------------------------------------------

def test_nan_infinity_strings_and_booleans_are_named_never_drawn_or_judged(tmp_path, capsys):
    raw = {("lru", "2"): '{"collision_rate": NaN, "hit_rate": 0.5}',
           ("least_stale", "1"): '{"collision_rate": Infinity, "hit_rate": 0.5}',
           ("least_stale", "2"): '{"collision_rate": "0.02", "hit_rate": true}'}
    spec = dict(SPEC, metrics=[{"collision %": "cache.collision_rate"}, {"hit %": "cache.hit_rate"}])
    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02}, raw=raw, spec=spec)
    assert main([str(s), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    lru2, ls1, ls2 = (job_dir(s, *k) for k in (("lru", "2"), ("least_stale", "1"), ("least_stale", "2")))
    assert f"specmd report: {lru2}/results.json: cache.collision_rate is NaN" in err.splitlines()
    assert f"specmd report: {ls1}/results.json: cache.collision_rate is Infinity" in err.splitlines()
    assert f"specmd report: {ls2}/results.json: cache.collision_rate is a string ('0.02'), not a number" in err
    assert f"specmd report: {ls2}/results.json: cache.hit_rate is true (a boolean), not a number" in err
    md = (tmp_path / "o" / "robust.md").read_text()
    # lru stands on its one good run (and says so); least_stale has no value at all, never inf
    assert "| lru | 10.0 (1 of 2 runs) | 50.0 ± 0.0 (n=2) |" in table_lines(md)
    assert "| least_stale | - | 50.0 (1 of 2 runs) |" in table_lines(md)
    line = next(x for x in md.splitlines() if x.startswith("- – **not measured**"))
    assert f"Infinity in {ls1}/results.json (cache.collision_rate)" in line
    assert f"NaN in {lru2}/results.json (cache.collision_rate)" in line and "a non-numeric value" in line
    assert "values that are no finite number, left out of every number and figure" in md


def test_a_verdict_on_a_group_with_one_nan_run_is_not_measured_and_says_where(tmp_path):
    raw = {("lru", "2"): '{"collision_rate": NaN}'}
    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02}, raw=raw)
    out, (sec,) = build([str(s)], str(tmp_path / "o"))
    (v,) = sec.verdicts
    assert v.status == UNMEASURED and "NaN in " in v.text and v.text.endswith("/results.json (cache.collision_rate)")
    assert "**not measured**" in (out / "robust.md").read_text()


def test_status_names_non_finite_values_of_done_jobs(tmp_path, capsys):
    raw = {("lru", "1"): '{"collision_rate": NaN, "per_layer": {"hit_rate": [0.1, -Infinity]}}'}
    s = make_sweep(tmp_path / "s", {"lru": 0.1, "least_stale": 0.02}, raw=raw)
    assert status_main([str(s)]) == 0
    err = capsys.readouterr().err
    assert "results.json: cache.collision_rate is NaN" in err and "cache.per_layer.hit_rate.1 is -Infinity" in err


# --- 3. directories that cannot be read ------------------------------------------------------------------------

def broken_sweep(tmp_path):
    """Four jobs: one fine, one whose overrides.yaml is binary, one whose overrides.yaml is a mapping, one whose
    results.json is not JSON; plus a directory holding only a results.json, and one whose results.json is a list."""
    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02})
    dirs = sorted(d for d in s.iterdir() if d.is_dir())
    (dirs[1] / ".hydra" / "overrides.yaml").write_bytes(bytes(range(256)) * 2)
    (dirs[2] / ".hydra" / "overrides.yaml").write_text("eviction: lru\n")
    (dirs[3] / "results.json").write_text("{not json")
    (s / "stray").mkdir()
    (s / "stray" / "results.json").write_text("{}")
    return s, dirs


def test_unreadable_job_directories_are_skipped_with_a_warning_naming_them(tmp_path, capsys):
    s, dirs = broken_sweep(tmp_path)
    sweep = load_sweep(s)
    w = "\n".join(sweep.warnings)
    assert f"{dirs[1]}: skipped: its .hydra/overrides.yaml is not readable as YAML" in w
    assert f"{dirs[2]}: skipped: its .hydra/overrides.yaml is not a list of overrides" in w
    assert f"{dirs[3] / 'results.json'}: not readable as JSON" in w
    assert f"{s / 'stray'}: skipped: it holds results.json but no .hydra/overrides.yaml" in w
    assert [j.status for j in sweep.jobs].count("ok") == 1
    assert main([str(s), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert f"specmd report: {dirs[1]}: skipped" in err and "Traceback" not in err
    md = (tmp_path / "o" / "report.md").read_text()
    assert f"{s / 'stray'}: skipped" in md and "results.json not readable as JSON" in md  # the missing job says why
    assert status_main([str(s)]) == 1
    err = capsys.readouterr().err
    assert f"specmd status: {dirs[2]}: skipped" in err


def test_a_results_json_that_is_no_object_and_a_run_without_overrides(tmp_path, capsys):
    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02})
    d = sorted(x for x in s.iterdir() if x.is_dir())[0]
    (d / "results.json").write_text("[1, 2]")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config()))
    (run / "results.json").write_text(json.dumps({"config": config(), "cache": {"collision_rate": 0.1},
                                                  "config_hash": "0"}))
    assert main([str(s), str(run), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert f"{d / 'results.json'}: not a JSON object (a list)" in err
    assert f"{run}: no .hydra/overrides.yaml: read as a run without overrides" in err
    assert status_main([str(run)]) == 0
    (run / "results.json").write_text(json.dumps({"config": config(), "cache": {"collision_rate": 0.1}}))
    assert status_main([str(run)]) == 1  # no config_hash: a re-launch would run it again, so it is not done
    assert "its results.json has no config_hash" in capsys.readouterr().out


def test_a_parent_of_single_runs_is_read_like_a_parent_of_sweeps(tmp_path, capsys):
    s = make_sweep(tmp_path / "out" / "multirun" / "s", {"lru": 0.10, "least_stale": 0.02})
    run = tmp_path / "out" / "day" / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config()))
    (run / ".hydra" / "overrides.yaml").write_text("[]")
    (run / "results.json").write_text(json.dumps({"config": config(), "cache": {"collision_rate": 0.1},
                                                  "config_hash": "0"}))
    from specmd.sweeps import sweeps_below

    assert sweeps_below(tmp_path / "out") == [s, run]  # a sweep's own job directories are not runs of their own
    assert status_main([str(tmp_path / "out")]) == 0
    assert str(run) in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["empty", "jobs_without_multirun", "file"])
def test_a_directory_that_holds_no_sweep_is_one_line_naming_it(tmp_path, capsys, layout):
    p = tmp_path / "x"
    if layout == "file":
        p.write_text("hello")
    else:
        p.mkdir()
    if layout == "jobs_without_multirun":
        (p / "0" / ".hydra").mkdir(parents=True)
        (p / "0" / ".hydra" / "overrides.yaml").write_text("- eviction=lru\n")
        (p / "0" / "results.json").write_text("{}")
    assert guarded("specmd report", main, [str(p), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"specmd report: error: {p}: no sweep (multirun.yaml) or run directory "
                                       "(.hydra/config.yaml) below it\n")
    assert guarded("specmd status", status_main, [str(p)]) == 2
    assert capsys.readouterr().err.startswith(f"specmd status: error: {p}: no sweep")


def test_a_garbled_sweep_below_a_parent_is_skipped_the_others_reported(tmp_path, capsys):
    make_sweep(tmp_path / "runs" / "good", {"lru": 0.10, "least_stale": 0.02})
    (tmp_path / "runs" / "bad").mkdir()
    (tmp_path / "runs" / "bad" / "multirun.yaml").write_bytes(bytes(range(256)) * 2)
    sweeps, notes = find_sweeps([str(tmp_path / "runs")])
    assert [s.experiment for s in sweeps] == ["robust"]
    assert notes == [f"skipped: {tmp_path / 'runs' / 'bad'}: its multirun.yaml or .hydra files cannot be read "
                     f"as a Hydra sweep (UnicodeDecodeError: " + notes[0].split("(UnicodeDecodeError: ")[1]]
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "o")]) == 0
    assert f"specmd report: skipped: {tmp_path / 'runs' / 'bad'}" in capsys.readouterr().err
    assert status_main([str(tmp_path / "runs")]) == 1  # not every sweep could be read: not all done
    assert f"specmd status: skipped: {tmp_path / 'runs' / 'bad'}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot be read as a Hydra sweep"):  # named itself: an error
        find_sweeps([str(tmp_path / "runs" / "bad")])


# --- 4. output paths ---------------------------------------------------------------------------------------------

def test_out_that_cannot_be_a_report_directory_is_an_error_before_any_work(tmp_path, capsys, monkeypatch):
    from specmd.commands import report

    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02})
    (tmp_path / "file").write_text("x")
    read = []
    monkeypatch.setattr(report, "find_sweeps", lambda paths: read.append(paths) or find_sweeps(paths))
    assert guarded("specmd report", main, [str(s), "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (f"specmd report: error: --out {tmp_path / 'file'}: {tmp_path / 'file'} is a "
                                       "file, not a directory\n")
    assert guarded("specmd report", main, [str(s), "--out", str(tmp_path / "file" / "sub" / "dir")]) == 2
    assert f"--out {tmp_path / 'file' / 'sub' / 'dir'}: {tmp_path / 'file'} is a file" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    import tempfile

    real = tempfile.mkstemp  # a read-only directory (root writes anywhere a chmod forbids)
    monkeypatch.setattr(tempfile, "mkstemp", lambda dir=None, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if str(dir) == str(locked) else real(dir=dir, **k))
    assert guarded("specmd report", main, [str(s), "--out", str(locked / "new")]) == 2
    assert f"--out {locked / 'new'}: {locked} is not writable (Permission denied)" in capsys.readouterr().err
    assert read == [] and not (locked / "new").exists()  # no sweep was read, nothing was made
    assert main([str(s), "--out", str(tmp_path / "fresh" / "deep")]) == 0 and read  # created when absent
    assert (tmp_path / "fresh" / "deep" / "index.html").exists()


def test_a_section_id_that_is_no_file_name_is_an_error_and_a_directory_name_is_made_one(tmp_path):
    s = make_sweep(tmp_path / "s", {"lru": 0.10, "least_stale": 0.02}, spec=dict(SPEC, id="../../escaped"))
    with pytest.raises(ConfigError, match=r"report id '\.\./\.\./escaped' .* must be a plain name"):
        build([str(s)], str(tmp_path / "o"))
    s2 = make_sweep(tmp_path / "s2", {"lru": 0.10, "least_stale": 0.02}, spec=dict(SPEC, id="a=b,c"))
    with pytest.raises(ConfigError, match="no path separator, no override syntax"):
        build([str(s2)], str(tmp_path / "o"))
    assert not (tmp_path / "escaped.md").exists() and not (tmp_path / "o").exists()
    # an ad-hoc sweep's id is its directory's name: one with spaces is made a file name, inside --out
    from tests.commands.test_report_adhoc import make_adhoc

    out, (sec,) = build([str(make_adhoc(tmp_path / "my sweep"))], str(tmp_path / "o2"))
    assert sec.spec.id == "my_sweep" and (out / "my_sweep.md").exists()
    assert all(p.parent == out for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("argv, words", [(["--publish"], "--publish saves a W&B Report: it needs --wandb"),
                                         (["--group", "g"], "--group g selects the W&B runs to read when no paths")])
def test_options_that_would_be_ignored_are_errors(tmp_path, argv, words):
    s = make_sweep(tmp_path / "s", {"lru": 0.10})
    with pytest.raises(ConfigError, match=words):
        main([str(s), *argv, "--out", str(tmp_path / "o")])


def test_a_single_run_of_an_experiment_never_hides_its_sweep_below_a_parent(tmp_path):
    from specmd.sweeps import find_sweeps

    s = make_sweep(tmp_path / "out" / "multirun" / "s", {"lru": 0.10, "least_stale": 0.02})
    run = tmp_path / "out" / "day" / "run"  # a later debugging run of the same experiment
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**config(), "experiment": "robust"}))
    (run / ".hydra" / "overrides.yaml").write_text("[]")
    (run / "results.json").write_text(json.dumps({"config": config(), "cache": {"collision_rate": 0.1}}))
    sweeps, notes = find_sweeps([str(tmp_path / "out")])
    assert [x.dir for x in sweeps] == [str(s)]
    assert any(n.startswith(f"{run}: a single run of robust") for n in notes), notes
