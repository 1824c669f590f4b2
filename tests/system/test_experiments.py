"""Every experiment config composes, every job of its sweep is a valid run, and its report spec is well formed."""

import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specmd import CONF_DIR
from specmd import shipped
from specmd.app import Run
from specmd.sweeps import expected_jobs
from specmd.commands.report.figures import KEYS, KINDS
from specmd.commands.report.verdicts import parse_spec

CONF = Path(CONF_DIR)
EXPERIMENTS = shipped.experiments()


@functools.lru_cache(maxsize=None)
def sweep_of(name: str):
    """(the sweep directory, [(job overrides, composed job config)]) as ``python -m specmd -m`` expands it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"], return_hydra_config=True)
        params = OmegaConf.to_container(cfg.hydra.sweeper.params) or {}
        mr = {"hydra": {"sweeper": {"params": params}, "overrides": {"task": [f"+experiment={name}"]}}}
        return str(cfg.hydra.sweep.dir), [(job, compose(config_name="config", overrides=job))
                                          for job in expected_jobs(mr)]


def jobs_of(name: str) -> list:
    return sweep_of(name)[1]


def test_the_papers_headline_figures_all_have_an_experiment():
    want = {"specmd_fig4", "specmd_fig5", "specmd_fig6_topk", "specmd_fig6_score", "specmd_fig7", "specmd_table1",
            "specmd_table2", "cce_fig2_prune", "cce_fig2_replace", "cce_fig4_prune", "cce_fig4_max_rank", "cce_fig4_cumsum",
            "cce_fig4_cache_prior", "cce_table2", "cce_fig9", "cce_fig10", "cce_fig10_prior", "flashmoe_fig6",
            "zhu_table4", "zhu_fig6"}
    assert want <= set(EXPERIMENTS)
    assert not (CONF.parent.parent / "experiments" / "directions.py").exists()  # one home: specmd/conf/experiment


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_every_job_is_a_valid_run(name):
    sweep_dir, jobs = sweep_of(name)
    assert len(jobs) >= 1 and sweep_dir.startswith(f"outputs/experiments/{name}/")
    for overrides, cfg in jobs:
        assert cfg.experiment == name
        Run(cfg)  # raises ConfigError naming the bad value
        spec = parse_spec(OmegaConf.to_container(cfg.report), name)
        assert spec.metrics, name
        for fig in spec.figures:
            assert fig["kind"] in KINDS and set(fig) <= KEYS, (name, fig)


def test_specmd_table2_swaps_only_the_eviction():
    evictions = {}
    for overrides, cfg in jobs_of("specmd_table2"):
        ax = dict(o.lstrip("+").split("=", 1) for o in overrides)
        evictions[ax["system"], ax["drop_in"]] = cfg.eviction.name
        if ax["drop_in"] == "least_stale":
            assert cfg.prefetch.name in ("topk", "score", "none")  # the system's own prefetch stays
    assert evictions == {("eliseev23", "none"): "lru", ("eliseev23", "least_stale"): "least_stale",
                         ("zhu25", "none"): "score", ("zhu25", "least_stale"): "least_stale",
                         ("hobbit24", "none"): "lhu", ("hobbit24", "least_stale"): "least_stale",
                         ("mixturecache25", "none"): "lru", ("mixturecache25", "least_stale"): "least_stale"}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_replay_experiments_record_once_and_live_ones_do_not(name):
    """Every job of an experiment that says ``replay.trace: record`` (itself or through the experiment it
    extends) replays the one recording; every job of the others runs live (the sweep overrides neither)."""
    want = "record" if name in shipped.replayed_experiments() else None
    assert {cfg.replay.trace for _, cfg in jobs_of(name)} == {want}
