"""Loss-free sweeps (specmd/jobs.py): unique run directories, resume, failed.json for every stage, and a
fault-injection test that kills a sweep at random points and re-launches it."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from specmd.shipped import job_dirname
from specmd.jobs import config_hash, finished

FAST = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=128", "logger=none"]


def _env(mirror):
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SPECMD_DATA_MIRROR=str(mirror),
                PYTHONUNBUFFERED="1")


def _launch(args, cwd, mirror, **kw):
    return subprocess.Popen([sys.executable, "-m", "specmd", *args], cwd=cwd, env=_env(mirror),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_for(p: subprocess.Popen, marker: str) -> str:
    """What ``p`` printed on stderr up to the line holding ``marker`` (read as it comes: no sleep, no timeout
    but the process's end); fails when the process ends first."""
    seen = ""
    while marker not in seen:
        chunk = os.read(p.stderr.fileno(), 4096)
        if not chunk:
            pytest.fail(f"the process ended before printing {marker!r}: {seen[-2000:]}")
        seen += chunk.decode(errors="replace")
    return seen


def test_job_dirname_is_stable_readable_and_distinct():
    a = job_dirname("eviction=lru,hardware.capacity=0.05")
    assert a == job_dirname("eviction=lru,hardware.capacity=0.05") and a.startswith("eviction=lru,hardware.capacity=0.05-")
    assert job_dirname("eviction=lru,hardware.capacity=0.05") != job_dirname("eviction=lru,hardware.capacity=0.25")
    long_a, long_b = "x=" + "a" * 100 + "1", "x=" + "a" * 100 + "2"  # equal in the first 80 characters
    assert job_dirname(long_a) != job_dirname(long_b) and len(job_dirname(long_a)) <= 89
    assert "/" not in job_dirname("model.pretrained=/data/ckpt")


def test_finished_matches_config_hash_and_keeps_other_results(tmp_path):
    h = config_hash({"eviction": {"name": "lru"}})
    assert h == config_hash({"eviction": {"name": "lru"}, "logger": {"name": "wandb"}})  # logger: same job
    assert h != config_hash({"eviction": {"name": "fifo"}})
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": h, "cache": {"hits": 3}}))
    assert finished(tmp_path, h)["cache"]["hits"] == 3
    other = config_hash({"eviction": {"name": "fifo"}})
    (tmp_path / "failed.json").write_text("{}")
    assert finished(tmp_path, other) is None
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "failed.json").exists()
    assert json.loads((tmp_path / f"results.{h}.json").read_text())["cache"]["hits"] == 3  # kept, not lost


@pytest.mark.slow  # (13 s: two real runs; the job directory naming stays in the default run)
def test_two_runs_started_in_the_same_second_keep_both(tmp_path, mirror):
    procs = [_launch([*FAST, f"eviction={e}"], tmp_path, mirror) for e in ("lru", "fifo")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    found = sorted((tmp_path / "outputs").glob("*/*/results.json"))
    assert len(found) == 2 and found[0].parent != found[1].parent
    assert sorted(json.loads(p.read_text())["config"]["eviction"]["name"] for p in found) == ["fifo", "lru"]


def _status(sweep, capsys) -> tuple[int, str]:
    """``specmd status <sweep>``'s exit code and output (in this process: the command's own function)."""
    from specmd.commands.status import main

    capsys.readouterr()
    code = main([str(sweep)])
    return code, capsys.readouterr().out


def test_resume_skips_done_jobs_reruns_failed_and_status_lists_them(tmp_path, mirror, capsys):
    """A multirun with a config error in one job: that job writes failed.json (stage config, the error), the
    others run and write one results.json each, the error goes to stderr and the sweep exits 2 at the end;
    status lists the jobs and the resume command; a relaunch skips the done jobs and reruns the failed one."""
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, "hardware.capacity=0.05,0.25,1.5", f"hydra.sweep.dir={sweep}"]
    first = _launch(args, ROOT, mirror)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 2, err[-2000:]
    assert "hardware.capacity=1.5" in err and "2 of 3 jobs done" in err, err[-2000:]
    done = {p: p.stat().st_mtime_ns for p in sweep.glob("*/results.json")}
    assert sorted(json.loads(p.read_text())["config"]["hardware"]["capacity"] for p in done) == [0.05, 0.25]
    (bad,) = sweep.glob("*capacity=1.5*")  # job dirs are named by their overrides
    failed = json.loads((bad / "failed.json").read_text())
    assert failed["stage"] == "config" and "hardware.capacity=1.5" in failed["error"]
    assert not (bad / "results.json").exists()
    code, st = _status(sweep, capsys)
    assert code == 1 and "3 jobs: 2 done, 1 failed, 0 running, 0 missing" in st, st
    assert "resume: python -m specmd -m" in st and "[config]" in st
    # while a launcher lives (it holds .sweep.lock), a job it has not run is pending, not missing, no resume
    # command is offered, and a second launch is refused (it would run the pending jobs twice)
    first_done = next(iter(done))
    first_done.rename(sweep / "aside.json")  # (renamed back below, its mtime kept)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; from specmd.liveness "
                               f"import hold_sweep; hold_sweep(Path({str(sweep)!r})); print('held', flush=True); "
                               "time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        _, st = _status(sweep, capsys)
        assert "3 jobs: 1 done, 1 failed, 0 running, 1 pending, 0 missing; running: launched by pid " \
            f"{holder.pid} on " in st and "resume:" not in st, st
        twice = _launch(args, ROOT, mirror)
        out, err = twice.communicate(timeout=300)
        assert twice.returncode == 2 and f"hydra.sweep.dir={sweep} is being run by pid {holder.pid} on " in err, err
    finally:
        holder.kill()
        holder.wait()
    (sweep / "aside.json").rename(first_done)
    failed_at = (bad / "failed.json").stat().st_mtime_ns
    again = _launch(args, ROOT, mirror)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 2 and "2 of 3 jobs done" in err and out.count("done already") == 2, err[-2000:]
    assert {p: p.stat().st_mtime_ns for p in sweep.glob("*/results.json")} == done  # not redone
    assert (bad / "failed.json").stat().st_mtime_ns != failed_at  # the failed job ran again (and failed again)


def test_a_failure_never_leaves_an_earlier_results_json_saying_done(tmp_path, mirror):
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute
    from specmd.errors import ConfigError

    run = tmp_path / "run"  # a sweep job's directory (a single run is refused one: test_robust.py)
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"config_hash": "old", "cache": {"hits": 1}}))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FAST, "hardware.capacity=1.5"])
    with pytest.raises(ConfigError):
        execute(cfg, run_dir=str(run))
    assert not (run / "results.json").exists() and (run / "failed.json").exists()
    (stale,) = run.glob("results.stale-*.json")  # kept, not lost
    assert json.loads(stale.read_text())["cache"]["hits"] == 1
    assert json.loads((run / "failed.json").read_text())["kind"] == "config"


def test_bad_threads_is_a_config_error_of_its_job(tmp_path, mirror):
    # threads is not part of a job's identity (its directory, its hash), so it is not swept here
    r = subprocess.run([sys.executable, "-m", "specmd", "-m", *FAST, "threads=0", "hardware.capacity=0.05,0.25",
                        f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, env=_env(mirror), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "threads=0 must be >= 1" in r.stderr and "0 of 2 jobs done" in r.stderr, r.stderr[-2000:]
    assert [json.loads(p.read_text())["stage"] for p in tmp_path.glob("*/failed.json")] == ["config", "config"]


def test_failed_json_names_the_load_stage(tmp_path, mirror):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "olmoe", "num_hidden_layers": 1}))
    r = subprocess.run([sys.executable, "-m", "specmd", *FAST, f"model.pretrained={ckpt}", "model.family=olmoe",
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, env=_env(mirror), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    failed = json.loads((tmp_path / "run" / "failed.json").read_text())
    assert failed["stage"] == "load" and str(ckpt) in failed["error"], failed
    assert not (tmp_path / "run" / "results.json").exists()


def test_sigterm_writes_failed_json_with_stage_and_signal(tmp_path, mirror):
    # token_by_token WikiText: a job long enough to be stopped while it evaluates
    # stopped once its weights are loaded (transformers' progress line: a state, not a time, so a loaded machine
    # passes too), in a job far longer than that (20 documents scored token by token)
    p = _launch([*FAST, "eval.token_by_token=true", "eval.max_length=512", "eval.limit=20",
                 f"hydra.run.dir={tmp_path}/run"], ROOT, mirror)
    err = wait_for(p, "Loading weights: 100%")
    p.send_signal(signal.SIGTERM)
    out, rest = p.communicate(timeout=1200)
    err += rest
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    failed = json.loads((tmp_path / "run" / "failed.json").read_text())
    assert failed["signal"] == "SIGTERM" and failed["stage"] in ("load", "stack", "evaluate"), failed
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.slow  # (38 s: random kills and relaunches; resume, SIGTERM and failed.json stay in the default run)
def test_random_kills_and_relaunches_lose_and_redo_nothing(tmp_path, mirror):
    """A 6-job sweep killed (SIGTERM, SIGKILL) at random points 4 times, re-launched after each kill: every
    results.json written before a kill is still there, unchanged (same inode and mtime: not redone), and the
    final launch completes the sweep."""
    rng = random.Random(1)
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, "hardware.capacity=0.02,0.05,0.1,0.25,0.5,1.0", f"hydra.sweep.dir={sweep}"]

    def snapshot():
        return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sweep.glob("*/results.json")}

    seen: dict = {}
    kills = 0
    for attempt in range(4):
        p = _launch(args, ROOT, mirror)
        # a random point of the sweep's progress, not of the clock (the jobs are fast: a whole sweep can
        # finish inside any fixed delay, and then nothing is killed): after 0-2 more jobs have written their
        # results, plus up to half a second
        want = len(snapshot()) + rng.randint(0, 2)
        deadline = time.monotonic() + 120
        while p.poll() is None and len(snapshot()) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        if p.poll() is None:
            p.send_signal(sig)
            kills += 1
        p.communicate(timeout=120)
        now = snapshot()
        assert {k: now.get(k) for k in seen} == seen, "a finished job was lost or redone"
        seen = now
    p = _launch(args, ROOT, mirror)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    final = snapshot()
    assert {k: final.get(k) for k in seen} == seen and len(final) == 6
    assert kills >= 2
    caps = sorted(json.loads(Path(k).read_text())["config"]["hardware"]["capacity"] for k in final)
    assert caps == [0.02, 0.05, 0.1, 0.25, 0.5, 1.0]
    assert not list(sweep.glob("*/failed.json"))  # interrupted jobs ran again and succeeded
