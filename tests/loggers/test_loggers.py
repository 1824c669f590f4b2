import json

import pytest

from specmd.errors import ConfigError
from specmd.loggers import NoLogger, WandbLogger, build_logger

RESULTS = {
    "config": {"routing": {"name": "standard"}, "miss": {"name": "fetch"}, "eviction": {"name": "lru"},
               "prefetch": {"name": "topk", "overfetch": 1.0}, "quant": {"name": "none"},
               "hardware": {"capacity": 0.05, "experts_per_layer": None}, "model": {"name": "deep_olmoe"},
               "eval": {"tasks": ["gsm8k"]}},
    "cache": {"hit_rate": 0.5, "requests": 4, "prefetch_precision": 0.75, "cache_lifetime": None,
              "miss_outcomes": {"fetched_int4": 1, "dropped": 1}, "bytes_by_precision": {"int4": 30},
              "per_layer": {"requests": [2, 2], "hits": [1, 1]}},
    "timing": {"ttft_s": 0.1, "tpot_s": None},
    "routing": {"fidelity": 1.0},
    "tasks": {"wikitext": {"word_perplexity": 12.5}},
    "provenance": {"git": {"commit": "abc", "dirty": False}, "versions": {"torch": "2.13.0"}},
}


def test_wandb_offline_run_has_name_tags_group_series_and_per_layer_table(tmp_path, monkeypatch):
    from tests.wandb_offline import read_offline_run

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- eviction=lru\n- hardware.capacity=0.05\n- logger=wandb\n")
    (tmp_path / "passes.csv").write_text("pass,kind,tokens,time_s,stall_s,requests,hits,misses,collision_misses\n"
                                         "1,prefill,10,0.5,0.25,4,0,4,0\n2,decode,1,0.1,0.05,4,3,1,1\n")
    logger = build_logger({"name": "wandb", "project": "t", "entity": None, "mode": "offline", "group": None,
                           "tags": ["mine"]}, group="2026-11-23/04-00-00")
    logger.log_run(RESULTS, str(tmp_path))
    got = read_offline_run(tmp_path)
    assert got["run"]["name"] == "eviction=lru,hardware.capacity=0.05"  # the overrides, the logger's left out
    assert got["run"]["group"] == "2026-11-23/04-00-00" and got["run"]["job_type"] == "live"
    assert got["run"]["tags"] == ["mine", "routing=standard", "miss=fetch", "eviction=lru", "prefetch=topk",
                                  "quant=none", "model=deep_olmoe", "capacity=0.05", "task=gsm8k"]
    assert got["config"]["prefetch.overfetch"] == 1.0 and got["config"]["provenance.git.commit"] == "abc"
    series = [h for h in got["history"] if "pass/hit_rate" in h]
    assert [h["pass/hit_rate"] for h in series] == [0.0, 0.75]
    assert [h["pass/cumulative_hit_rate"] for h in series] == [0.0, 0.375]
    assert [h["pass/decode"] for h in series] == [0, 1] and series[1]["pass/collision_misses"] == 1
    assert got["summary"]["cache/hit_rate"] == 0.5 and got["summary"]["tasks/wikitext/word_perplexity"] == 12.5
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/per_layer_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["layer", "requests", "hits"] and table["data"] == [[0, 2, 1], [1, 2, 1]]
    from specmd.loggers import flat_summary

    summary = flat_summary(RESULTS)
    assert summary["tasks/wikitext/word_perplexity"] == 12.5 and summary["routing/fidelity"] == 1.0
    assert summary["cache/prefetch_precision"] == 0.75 and "cache/cache_lifetime" not in summary
    assert summary["cache/miss_outcomes/fetched_int4"] == 1 and summary["cache/bytes_by_precision/int4"] == 30


def test_logger_choices():
    assert isinstance(build_logger({"name": "none"}), NoLogger)
    with pytest.raises(ConfigError, match="none, wandb"):
        build_logger({"name": "tensorboard"})
    with pytest.raises(ConfigError, match="auto, online, offline, disabled"):
        WandbLogger(mode="sometimes")


def test_replay_runs_say_which_trace_they_read():
    from specmd.loggers import flat_summary

    res = dict(RESULTS, replay={"trace": "/t/trace", "exact": True, "passes": 3, "requests": 24, "notes": []},
               provenance={"trace": {"path": "/t/trace", "fingerprint": "0123456789abcdef"}})
    s = flat_summary(res)
    assert s["replay/trace"] == "/t/trace" and s["replay/exact"] is True
    assert s["replay/trace_fingerprint"] == "0123456789abcdef"


# --- W&B never turns a finished run into a failure (issue 10) -------------------------------------------------

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def blackhole():
    """A W&B server that accepts connections (the kernel's backlog does) and never answers."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture
def no_network(monkeypatch):
    import specmd.loggers as loggers

    monkeypatch.setattr(loggers, "_UNREACHABLE", None)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")  # as in the test env: the logger's own mode must decide


def _wandb_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "specmd" and r.levelname == "WARNING"]


@pytest.mark.parametrize("server", ["refused", "blackhole"])
def test_unreachable_wandb_saves_offline_warns_and_returns_within_the_bound(server, blackhole, no_network,
                                                                           monkeypatch, tmp_path, caplog):
    import time

    from tests.wandb_offline import read_offline_run

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9" if server == "refused" else blackhole)
    logger = build_logger({"name": "wandb", "project": "t", "mode": "online", "init_timeout_s": 10,
                           "finish_timeout_s": 3})
    caplog.set_level("WARNING", logger="specmd")
    t0 = time.monotonic()
    logger.log_run(RESULTS, str(tmp_path / "a"))  # no exception
    took = time.monotonic() - t0
    assert took < 3 + 12, took  # the upload bound + offline init / process start on a loaded 2-core box
    (warning,) = _wandb_warnings(caplog)
    (run,) = (tmp_path / "a" / "wandb").glob("offline-run-*")
    assert f"saved offline at {run}" in warning and f"`wandb sync {run}`" in warning and "timed out" in warning
    assert read_offline_run(tmp_path / "a")["summary"]["cache/hit_rate"] == 0.5  # the whole run is on disk

    caplog.clear()  # a multirun's next job: saved offline at once, not another finish_timeout_s
    t0 = time.monotonic()
    logger.log_run(RESULTS, str(tmp_path / "b"))
    assert time.monotonic() - t0 < 3, "W&B unreachable earlier: no second upload attempt"
    (warning,) = _wandb_warnings(caplog)
    (run,) = (tmp_path / "b" / "wandb").glob("offline-run-*")
    assert "unreachable earlier" in warning and f"`wandb sync {run}`" in warning


@pytest.mark.slow  # (15 s: a process against a silent server; the in-process bound stays in the default run)
def test_finished_process_exits_0_promptly_when_wandb_never_answers(blackhole, tmp_path):
    """The whole process, atexit hooks included (the trial's hang was ~100 s then exit 1)."""
    import os
    import subprocess
    import sys
    import time

    script = ("import logging, sys; logging.basicConfig()\n"
              "from tests.loggers.test_loggers import RESULTS\nfrom specmd.loggers import build_logger\n"
              "build_logger({'name': 'wandb', 'project': 't', 'mode': 'auto', 'init_timeout_s': 10, "
              "'finish_timeout_s': 3}).log_run(RESULTS, sys.argv[1])\n")
    env = dict(os.environ, WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=blackhole, WANDB_SILENT="true")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=__import__("pathlib").Path(__file__).resolve().parents[2])
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "saved offline at" in proc.stderr and "wandb sync" in proc.stderr
    assert took < 3 + 20, took  # python + torch-free imports + the 3 s bound; was 90 s + 22 s at exit


def test_log_run_never_raises(tmp_path, monkeypatch, caplog):
    import wandb

    def broken(*a, **k):
        raise wandb.errors.CommError("network is unreachable")

    monkeypatch.setattr(wandb, "init", broken)
    caplog.set_level("WARNING", logger="specmd")
    WandbLogger(mode="online").log_run(RESULTS, str(tmp_path))
    (warning,) = _wandb_warnings(caplog)
    assert "CommError: network is unreachable" in warning and "the run itself succeeded" in warning


def test_a_successful_upload_warns_nothing(tmp_path, no_network, monkeypatch, caplog):
    import sys

    import specmd.loggers as loggers

    touch = "import pathlib, sys; [p.with_suffix('.wandb.synced').touch() for p in pathlib.Path(sys.argv[1]).glob('*.wandb')]"
    monkeypatch.setattr(loggers, "sync_command", lambda d: [sys.executable, "-c", touch, d])
    caplog.set_level("WARNING", logger="specmd")
    WandbLogger(mode="online", finish_timeout_s=20).log_run(RESULTS, str(tmp_path))
    assert _wandb_warnings(caplog) == []
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb.synced"))


def test_timeouts_are_configured_and_validated():
    from pathlib import Path

    from omegaconf import OmegaConf

    import specmd

    yaml = Path(specmd.__file__).parent / "conf" / "logger" / "wandb.yaml"
    logger = build_logger(OmegaConf.to_container(OmegaConf.load(yaml)))
    assert (logger.init_timeout_s, logger.finish_timeout_s) == (30, 60)
    for bad in (0, -1, "soon", True):
        with pytest.raises(ConfigError, match="finish_timeout_s"):
            WandbLogger(finish_timeout_s=bad)
    with pytest.raises(ConfigError, match="init_timeout_s"):
        build_logger({"name": "wandb", "init_timeout_s": 0})
