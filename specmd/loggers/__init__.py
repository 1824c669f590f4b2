"""Experiment trackers: ``logger=none`` (results.json only) and ``logger=wandb``."""

from __future__ import annotations

import logging
import os
from typing import Optional

from ..errors import ConfigError

MODES = ("auto", "online", "offline", "disabled")
log = logging.getLogger("specmd")


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

    W&B never turns a finished run into a failure: :meth:`log_run` is called after ``results.json`` is
    written, so it never raises (a problem is a WARNING on the ``specmd`` logger) and never blocks past
    ``init_timeout_s + finish_timeout_s`` (plus a process kill). How: every run is first written *offline*
    (local files only, ``<run dir>/wandb/offline-run-*``); ``online`` then uploads it with ``wandb sync`` in
    a child process (own session) that is killed at ``finish_timeout_s``. If the upload fails or times out,
    the warning names the offline directory and the ``wandb sync <dir>`` command that uploads it later.

    Why not ``wandb.init(mode="online", settings=Settings(init_timeout=..., finish_timeout=...))`` with an
    offline fallback: those settings bound only two of wandb's waits. Measured with wandb 0.31 against a
    server that accepts connections and never answers, an online init that timed out after 3 s still held
    the process ~22 s at exit (its analytics exporter probes the server with its own 10 s timeouts from an
    atexit hook), and the defaults (``init_timeout`` 90 s) gave the ~100 s hang then exit 1 of issue 10. A
    child process killed at a deadline is the only bound that holds whatever wandb does inside, and costs
    nothing here: the run is logged in one go after it finished, so a live online run shows nothing more.
    A timed-out upload also marks W&B unreachable for the rest of the process (a Hydra multirun's later
    jobs save offline straight away instead of each waiting ``finish_timeout_s``).
    """

    def __init__(self, project: str = "specmd", entity: Optional[str] = None, mode: str = "auto",
                 group: Optional[str] = None, tags: Optional[list] = None, init_timeout_s: float = 30,
                 finish_timeout_s: float = 60):
        if mode not in MODES:
            raise ConfigError(f"logger.mode={mode!r}; valid choices: {', '.join(MODES)}")
        for key, val in (("init_timeout_s", init_timeout_s), ("finish_timeout_s", finish_timeout_s)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < float("inf"):
                raise ConfigError(f"logger.{key}={val!r}; expected a finite number of seconds > 0")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise ConfigError(f"logger.tags={tags!r}; expected a list of strings (W&B tags)")
        for key, val in (("project", project), ("entity", entity), ("group", group)):
            if val is not None and not (isinstance(val, str) and val):
                raise ConfigError(f"logger.{key}={val!r}; expected a non-empty string" +
                                  (" or null" if key != "project" else ""))
        if group is not None and len(group) > 128:
            raise ConfigError(f"logger.group={group[:40]!r}... is {len(group)} characters; W&B takes at most 128")
        self.project, self.entity, self.mode, self.group = project, entity, mode, group
        self.tags = list(tags or [])
        wandb_rejects(project, self.tags)
        self.init_timeout_s, self.finish_timeout_s = float(init_timeout_s), float(finish_timeout_s)

    def _mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if os.environ.get("WANDB_API_KEY"):
            return "online"
        try:  # the key `wandb login` saved; read locally (wandb.Api() would verify it over the network)
            from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

            if read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"):
                return "online"
        except Exception:
            pass
        return "offline"

    def log_run(self, results: dict, run_dir: str) -> None:
        """Log the run to W&B; never raises (``Exception``) and never waits past the configured bounds."""
        try:
            self._log_run(results, run_dir)
        except Exception as exc:
            log.warning("W&B logging failed (%s: %s); the run itself succeeded (results.json in %s)",
                        type(exc).__name__, exc, run_dir, exc_info=True)

    def _log_run(self, results: dict, run_dir: str) -> None:
        global _UNREACHABLE
        import wandb

        mode = self._mode()
        cfg = results["config"]
        config = flatten(cfg)
        config.update(flatten(results.get("provenance") or {}, "provenance"))
        config["hydra_overrides"] = run_overrides(run_dir)  # what specmd report groups a sweep's runs by
        parent = os.path.dirname(os.path.normpath(run_dir))  # one multirun = one sweep (its dir holds multirun.yaml)
        config["sweep_dir"] = parent if os.path.isfile(os.path.join(parent, "multirun.yaml")) else run_dir
        settings = wandb.Settings(init_timeout=self.init_timeout_s, finish_timeout=self.finish_timeout_s)
        run = wandb.init(project=self.project, entity=self.entity, mode="disabled" if mode == "disabled" else "offline",
                         group=cfg.get("experiment") or self.group, job_type="replay" if "replay" in results else "live",
                         tags=self.tags + run_tags(cfg), config=config, dir=run_dir, reinit="finish_previous",
                         name=run_name(run_dir), settings=settings)
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
        sync_dir = None if mode == "disabled" else run.settings.sync_dir
        run.finish()
        if mode != "online":
            return
        if _UNREACHABLE:
            log.warning("W&B was unreachable earlier in this process (%s); the run is saved offline at %s and "
                        "can be uploaded with `wandb sync %s`", _UNREACHABLE, sync_dir, sync_dir)
            return
        problem = upload(sync_dir, self.finish_timeout_s)
        if problem:
            if "timed out" in problem:
                _UNREACHABLE = problem
            log.warning("W&B upload failed (%s); the run is saved offline at %s and can be uploaded with "
                        "`wandb sync %s`", problem, sync_dir, sync_dir)


_UNREACHABLE: Optional[str] = None  # why an upload timed out earlier in this process (None: none did)


def upload(sync_dir: str, timeout_s: float) -> Optional[str]:
    """``wandb sync <sync_dir>`` in a child process (its own session, output to ``<sync_dir>/sync.log``),
    killed with everything it started after ``timeout_s``; None when it uploaded, else what went wrong."""
    import signal
    import subprocess
    import time

    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}  # the logger decided: upload
    log_path = os.path.join(sync_dir, "sync.log")
    t0 = time.monotonic()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(sync_command(sync_dir), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        return f"timed out after {time.monotonic() - t0:.0f} s"
    if any(f.endswith(".wandb.synced") for f in os.listdir(sync_dir)):
        return None
    return f"`wandb sync` exited with {rc} without marking the run synced; see {log_path}"


def sync_command(sync_dir: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "wandb", "sync", sync_dir]


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def wandb_rejects(project: str, tags: list) -> None:
    """The project name and tags as W&B's own settings validate them (no ``/\\#?%:`` in a project, at most
    128 characters; tags of 1 to 64 characters), at config time: W&B raised them in the middle of a run, as a
    traceback, after the run had succeeded."""
    import wandb

    try:
        wandb.Settings(project=project, run_tags=tuple(tags))
    except Exception as exc:  # noqa: BLE001 -- wandb's UsageError or pydantic's ValidationError, by version
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Tag" in ln or "project" in ln.lower()), lines[-1] if lines else exc)
        why = str(why).split(" [type=")[0].removeprefix("Value error, ")
        raise ConfigError(f"logger: W&B would reject this setting: {why}") from None


TAG_MAX = 64  # W&B's limit on a tag's length


def run_tags(cfg: dict) -> list[str]:
    from ..engine import GROUPS

    tags = [f"{g}={cfg[g]['name']}" for g in (*GROUPS, "quant")
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
    return [t[:TAG_MAX] for t in tags]  # a long model or task name: its tag cut, never the run's upload


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
                         "pass/collision_misses": int(r["collision_misses"]),
                         # (older runs' files have neither; kv_bytes is blank without hardware.memory_gb)
                         "pass/capacity_bytes": int(r["capacity_bytes"]) if r.get("capacity_bytes") else None,
                         "pass/kv_bytes": int(r["kv_bytes"]) if r.get("kv_bytes") else None})
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
