"""The configs specmd ships (``specmd/conf``), read as data without Hydra: one home for every list and default
that ``conf/`` holds. Code and tests derive theirs from here rather than repeat them:

* :func:`defaults` -- each group's default option, the ``defaults`` list of ``conf/config.yaml`` (the stack's
  families, the hardware profile, quantization, execution...);
* :func:`options` / :func:`option` -- a group's options (its ``<name>.yaml`` files) and one option's fields;
* :func:`experiments` / :func:`experiment` -- the experiments (``conf/experiment/*.yaml``) and one
  experiment's fields, merged over the experiments it extends (``specmd_fig5`` extends ``specmd_fig4``);
* :func:`register_resolvers` -- the resolvers the configs' directories use (registered on ``import specmd``).

A value read here is the file's own: interpolations (``${model.pretrained}``) stay strings, and what a Hydra
composition adds on top (``override /group`` entries, ``/system`` presets, the command line) is Hydra's.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"


def load(*parts: str) -> dict:
    """The mapping in ``conf/<parts...>.yaml``: ``load("config")``, ``load("routing", "prune")``."""
    import yaml

    path = CONF.joinpath(*parts[:-1], f"{parts[-1]}.yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def defaults() -> dict:
    """``{group: option}``: the option ``conf/config.yaml`` composes for each group when the user names none."""
    out = {}
    for entry in load("config").get("defaults") or ():
        if isinstance(entry, dict):
            out.update(entry)
    return out


def top_keys() -> set:
    """Every top-level key a composed run config can have: ``config.yaml``'s own, its config groups (the
    directories of ``conf/``) and what an experiment adds (``experiment``, ``report``)."""
    own = set(load("config")) - {"defaults", "hydra"}
    return own | {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"} | {"experiment", "report"}


def options(group: str) -> list[str]:
    """The options of config group ``group``: the stems of ``conf/<group>/*.yaml``, sorted."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def option(group: str, name: str) -> dict:
    """The fields of ``conf/<group>/<name>.yaml`` (``name`` and, for a registered class, its ``Params``)."""
    return load(group, name)


def experiments() -> list[str]:
    """Every shipped experiment (``+experiment=<name>``), sorted."""
    return options("experiment")


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def experiment(name: str) -> dict:
    """The fields of experiment ``name`` (``experiment``, ``replay``, ``eval``, ``hydra.sweeper.params``,
    ``report``...), its own over those of the experiments its ``defaults`` list extends (a bare entry names
    another experiment), without the ``defaults`` list itself."""
    raw = load("experiment", name)
    out: dict = {}
    for entry in raw.get("defaults") or ():
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("/"):
            out = _merge(out, experiment(entry))
    return _merge(out, {k: v for k, v in raw.items() if k != "defaults"})


def experiment_field(name: str, dotted: str, default=None):
    """One field of experiment ``name`` by its dotted key, e.g. ``experiment_field("specmd_fig5",
    "replay.trace") == "record"``; ``default`` when the experiment does not set it."""
    node = experiment(name)
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def replayed_experiments() -> list[str]:
    """The experiments that record their model's routing once and replay every job on it
    (``replay.trace: record``); the others run the model live in every job."""
    return [n for n in experiments() if experiment_field(n, "replay.trace") == "record"]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9=,._+-]+")


def job_dirname(override_dirname: str) -> str:
    """A sweep job's directory name: its overrides, readable and capped at 80 characters, plus 8 hex digits
    of their hash (so two jobs that differ only past the cap, or only in characters replaced here, still get
    their own directory)."""
    digest = hashlib.sha256(override_dirname.encode()).hexdigest()[:8]
    readable = _NAME_CHARS.sub("_", override_dirname)[:80] or "job"
    return f"{readable}-{digest}"


def register_resolvers() -> None:
    """The configs' own resolvers, registered when the package is imported (every composition of these configs,
    the Hydra apps', a notebook's ``hydra.compose``, finds them): ``${specmd_unique:}`` (a single run's
    directory: :func:`specmd.results.unique_suffix`) and ``${specmd_job:...}`` (a sweep job's: :func:`job_dirname`)."""
    from omegaconf import OmegaConf

    from .results import unique_suffix

    # use_cache: one value per config, copied with Hydra's resolver cache into each job's config
    OmegaConf.register_new_resolver("specmd_unique", unique_suffix, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("specmd_job", job_dirname, replace=True)
