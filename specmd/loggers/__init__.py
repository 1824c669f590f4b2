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
    """One W&B run per specmd run, browsable without specmd:

    * name: the run's Hydra overrides (``eviction=lru,hardware.capacity=0.05``; "defaults" for none), so
      the runs of a sweep are told apart in the UI;
    * config: the resolved config, flattened to dotted keys, plus ``provenance.*``;
    * tags: the policy names, the model, the capacity and the tasks; group: the experiment (``experiment``
      in the config) or the multirun's ``<date>/<time>``; job type: ``live`` or ``replay``;
    * summary: every scalar of ``results.json`` (:func:`flat_summary`), a replay's trace identity included;
    * history: one step per forward pass (``pass/hit_rate``, ``pass/cumulative_hit_rate``,
      ``pass/stall_s``, ``pass/collision_misses``, ``pass/decode``...) from the run's ``passes.csv``;
    * a ``per_layer`` table (and the per-layer lists in the summary, for ``specmd report --wandb``);
    * config ``hydra_overrides`` (the job's overrides) and ``sweep_dir`` (its multirun): how ``specmd report``
      regroups runs read back from W&B into sweeps.

    ``mode: auto`` logs online when the user has a W&B key (``WANDB_API_KEY`` or ``wandb login``) and
    offline otherwise (``wandb sync`` uploads later).
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
        config = flatten(cfg)
        config.update(flatten(results.get("provenance") or {}, "provenance"))
        config["hydra_overrides"] = run_overrides(run_dir)  # what specmd report groups a sweep's runs by
        parent = os.path.dirname(os.path.normpath(run_dir))  # one multirun = one sweep (its dir holds multirun.yaml)
        config["sweep_dir"] = parent if os.path.isfile(os.path.join(parent, "multirun.yaml")) else run_dir
        run = wandb.init(project=self.project, entity=self.entity, mode=self._mode(),
                         group=cfg.get("experiment") or self.group, job_type="replay" if "replay" in results else "live",
                         tags=self.tags + run_tags(cfg), config=config, dir=run_dir, reinit="finish_previous",
                         name=run_name(run_dir))
        series = pass_series(run_dir)
        per_layer = (results.get("cache") or {}).get("per_layer")
        if per_layer:  # logged with the last pass: every history step comes from exactly one log call
            cols = ["layer"] + list(per_layer)
            rows = [[i] + [per_layer[c][i] for c in per_layer] for i in range(len(per_layer["requests"]))]
            table = {"per_layer": wandb.Table(columns=cols, data=rows)}
            if series:
                series[-1].update(table)
            else:
                series = [dict(table, step=0)]
        for row in series:
            run.log(row, step=row.pop("step"))
        run.summary.update(flat_summary(results))
        run.finish()


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def run_tags(cfg: dict) -> list[str]:
    tags = [f"{g}={cfg[g]['name']}" for g in ("routing", "miss", "eviction", "prefetch", "quant")
            if isinstance(cfg.get(g), dict) and "name" in cfg[g]]
    model = cfg.get("model") or {}
    if model.get("name"):
        tags.append(f"model={model['name']}")
    hw = cfg.get("hardware") or {}
    if hw.get("experts_per_layer"):
        tags.append(f"experts_per_layer={hw['experts_per_layer']}")
    elif hw.get("capacity") is not None:
        tags.append(f"capacity={hw['capacity']}")
    tags += [f"task={t}" for t in ((cfg.get("eval") or {}).get("tasks") or [])]
    return tags


def run_overrides(run_dir: str) -> list:
    """The overrides Hydra recorded for this job (``<run dir>/.hydra/overrides.yaml``), logger and hydra
    settings left out; empty when there is no such file (a run started from Python)."""
    path = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.isfile(path):
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path) if not str(o).lstrip("+~").startswith(("logger", "hydra."))]


def run_name(run_dir: str) -> str:
    """The job's overrides joined by commas ("defaults" for none); the run directory's name when Hydra
    recorded none (a run started from Python)."""
    if not os.path.isfile(os.path.join(run_dir, ".hydra", "overrides.yaml")):
        return os.path.basename(os.path.normpath(run_dir))
    return ",".join(run_overrides(run_dir)) or "defaults"


def pass_series(run_dir: str) -> list[dict]:
    """One W&B history step per forward pass, from ``<run dir>/passes.csv`` (empty if the run has none)."""
    import csv

    path = os.path.join(run_dir, "passes.csv")
    if not os.path.isfile(path):
        return []
    rows, hits, requests = [], 0, 0
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            h, q = int(r["hits"]), int(r["requests"])
            hits, requests = hits + h, requests + q
            rows.append({"step": int(r["pass"]), "pass/decode": int(r["kind"] == "decode"),
                         "pass/tokens": int(r["tokens"]), "pass/time_s": float(r["time_s"]),
                         "pass/stall_s": float(r["stall_s"]), "pass/hit_rate": h / q if q else None,
                         "pass/cumulative_hit_rate": hits / requests if requests else None,
                         "pass/collision_misses": int(r["collision_misses"])})
    return [{k: v for k, v in row.items() if v is not None} for row in rows]


def flat_summary(results: dict) -> dict:
    """The scalars of a results.json as W&B summary keys (``cache/hit_rate``, ``cache/miss_outcomes/dropped``,
    ``timing/ttft_s``, ``tasks/wikitext/word_perplexity``...); ``None`` values are left out."""
    summary = {}
    cache = results.get("cache") or {}
    for k, v in cache.items():
        if isinstance(v, (int, float)):
            summary[f"cache/{k}"] = v
        elif isinstance(v, dict):  # miss_outcomes, bytes_by_precision, per_layer (lists: specmd report reads them)
            for kk, vv in v.items():
                summary[f"cache/{k}/{kk}"] = vv
    for k, v in (results.get("timing") or {}).items():
        if isinstance(v, (int, float)):
            summary[f"timing/{k}"] = v
    summary["routing/fidelity"] = (results.get("routing") or {}).get("fidelity")
    for task, metrics in (results.get("tasks") or {}).items():
        for k, v in metrics.items():
            summary[f"tasks/{task}/{k}"] = v
    for name, stats in (results.get("analysis") or {}).items():  # trace statistics (reuse_by_rank)
        for k, v in stats.items():
            summary[f"analysis/{name}/{k}"] = v
    rep = results.get("replay") or {}
    for k in ("trace", "exact", "passes", "requests"):  # which trace a replay read
        if k in rep:
            summary[f"replay/{k}"] = rep[k]
    fp = ((results.get("provenance") or {}).get("trace") or {}).get("fingerprint")
    if fp:
        summary["replay/trace_fingerprint"] = fp
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
