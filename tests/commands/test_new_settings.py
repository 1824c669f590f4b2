"""The newest commands' settings refused before any work, with the value and the valid range (issue 57): thread
counts (torch crashes creating 100,000 threads, before any failed.json), fidelity's model list, and the
settings a model bounds, checked from its config before any weight loads (tests/test_bad_inputs.py's battery
has the run's)."""

import pytest

from specmd.errors import ConfigError


@pytest.mark.parametrize("value", [0, -1, 100_000, True, "many", 2.5])
def test_calibrate_threads_outside_the_range_are_refused(value):
    from specmd.commands.calibrate.command import check_threads

    with pytest.raises(ConfigError, match=r"--threads=.*valid choices are auto or whole numbers in 1\.\.1024"):
        check_threads(value, False)


@pytest.mark.parametrize("value", ["auto", 1, 3, 1024])
def test_calibrate_threads_in_range_pass_oversubscribed_too(value):
    from specmd.commands.calibrate.command import check_threads

    check_threads(value, False)


def test_fidelity_refuses_a_model_listed_twice_before_any_work(monkeypatch):
    import specmd.commands.calibrate.fidelity as fid

    monkeypatch.setattr(fid, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(ConfigError, match="--models lists tiny more than once"):
        fid.fidelity(None, models=["tiny", "deep_olmoe", "tiny"], quick=True, log=lambda m: None)


def test_a_model_bounded_setting_is_refused_from_the_config_before_the_weights(monkeypatch):
    from hydra import compose, initialize_config_dir

    import specmd.models.loader as loader
    from specmd import CONF_DIR
    from specmd.app import Run

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=deep_olmoe", "routing=piggyback", "routing.k0=9"])
        with pytest.raises(ConfigError, match="k0=9 exceeds the model's top-k 8"):
            Run(cfg)
        Run(compose(config_name="config", overrides=["model=deep_olmoe", "routing=piggyback", "routing.k0=8"]))
