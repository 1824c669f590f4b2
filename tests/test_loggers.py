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
    from wandb_offline import read_offline_run

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
