"""Experiment trackers: ``logger=none`` (results.json only) and ``logger=wandb``."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import ConfigError

MODES = ("auto", "online", "offline", "disabled")


class NoLogger:
    def log_run(self, results: dict, run_dir: str) -> None:
        pass


class WandbLogger:
    """One W&B run per specmd run: resolved config, summary metrics, per-layer table.

    ``mode: auto`` logs online when the user has a W&B key (``WANDB_API_KEY`` or ``wandb login``) and
    offline otherwise (``wandb sync`` uploads later). Runs of one Hydra multirun share a group.
    """

    def __init__(self, project: str = "specmd", entity: Optional[str] = None, mode: str = "auto",
                 group: Optional[str] = None, tags: Optional[list] = None):
        if mode not in MODES:
            raise ConfigError(f"logger.mode={mode!r}; valid choices: {', '.join(MODES)}")
        self.project, self.entity, self.mode, self.group = project, entity, mode, group
        self.tags = list(tags or [])

    def _mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if os.environ.get("WANDB_API_KEY"):
            return "online"
        try:
            import wandb

            if wandb.Api().api_key:
                return "online"
        except Exception:
            pass
        return "offline"

    def log_run(self, results: dict, run_dir: str) -> None:
        import wandb

        cfg = results["config"]
        tags = self.tags + [f"{g}={cfg[g]['name']}" for g in ("routing", "miss", "eviction", "prefetch", "quant")
                            if isinstance(cfg.get(g), dict) and "name" in cfg[g]]
        run = wandb.init(project=self.project, entity=self.entity, mode=self._mode(), group=self.group,
                         tags=tags, config=cfg, dir=run_dir, reinit="finish_previous",
                         name=os.path.basename(os.path.normpath(run_dir)))
        summary = flat_summary(results)
        run.summary.update(summary)
        cache = results.get("cache") or {}
        per_layer = cache.get("per_layer")
        if per_layer:
            cols = ["layer"] + list(per_layer)
            rows = [[i] + [per_layer[c][i] for c in per_layer] for i in range(len(per_layer["requests"]))]
            run.log({"per_layer": wandb.Table(columns=cols, data=rows)})
        run.finish()


def flat_summary(results: dict) -> dict:
    """The scalars of a results.json as W&B summary keys (``cache/hit_rate``, ``cache/miss_outcomes/dropped``,
    ``timing/ttft_s``, ``tasks/wikitext/word_perplexity``...); ``None`` values are left out."""
    summary = {}
    cache = results.get("cache") or {}
    for k, v in cache.items():
        if isinstance(v, (int, float)):
            summary[f"cache/{k}"] = v
        elif isinstance(v, dict) and k != "per_layer":  # miss_outcomes, bytes_by_precision
            for kk, vv in v.items():
                summary[f"cache/{k}/{kk}"] = vv
    for k, v in (results.get("timing") or {}).items():
        if isinstance(v, (int, float)):
            summary[f"timing/{k}"] = v
    summary["routing/fidelity"] = (results.get("routing") or {}).get("fidelity")
    for task, metrics in (results.get("tasks") or {}).items():
        for k, v in metrics.items():
            summary[f"tasks/{task}/{k}"] = v
    return {k: v for k, v in summary.items() if v is not None}


def build_logger(cfg: dict, group: Optional[str] = None):
    cfg = dict(cfg or {})
    name = cfg.pop("name", "none")
    if name == "none":
        return NoLogger()
    if name == "wandb":
        try:
            return WandbLogger(group=cfg.pop("group", None) or group, **cfg)
        except TypeError as exc:
            raise ConfigError(f"logger=wandb: {exc}") from None
    raise ConfigError(f"unknown logger {name!r}; valid choices: none, wandb")
