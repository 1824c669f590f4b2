import json

import pytest

from specmd.errors import ConfigError
from specmd.loggers import NoLogger, WandbLogger, build_logger

RESULTS = {
    "config": {"routing": {"name": "standard"}, "miss": {"name": "fetch"}, "eviction": {"name": "lru"},
               "prefetch": {"name": "topk", "overfetch": 1.0}, "quant": {"name": "none"},
               "hardware": {"capacity": 0.05}},
    "cache": {"hit_rate": 0.5, "requests": 4, "prefetch_precision": 0.75, "cache_lifetime": None,
              "miss_outcomes": {"fetched_int4": 1, "dropped": 1}, "bytes_by_precision": {"int4": 30},
              "per_layer": {"requests": [2, 2], "hits": [1, 1]}},
    "timing": {"ttft_s": 0.1, "tpot_s": None},
    "routing": {"fidelity": 1.0},
    "tasks": {"wikitext": {"word_perplexity": 12.5}},
}


def test_wandb_offline_run_has_tags_group_and_per_layer_table(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = {}
    real_init = wandb.init

    def spy(**kwargs):
        seen.update(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", spy)
    logger = build_logger({"name": "wandb", "project": "t", "entity": None, "mode": "offline", "group": None,
                           "tags": ["mine"]}, group="sweep-1")
    logger.log_run(RESULTS, str(tmp_path))
    assert seen["mode"] == "offline" and seen["group"] == "sweep-1"
    assert seen["tags"] == ["mine", "routing=standard", "miss=fetch", "eviction=lru", "prefetch=topk", "quant=none"]
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
