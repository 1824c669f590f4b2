"""specmd tune: the search space, the Pareto front, the options' errors, and a whole run whose winner meets
its quality budget when re-run live."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specmd import CONF_DIR
from specmd.engine import GROUPS
from specmd.errors import ConfigError
from specmd.commands.tune import SPACE, Options, candidates, draw, lossless, parse, pareto


def test_pareto_front_hand_worked():
    rows = [{"objective": 1.0, "loss": 0.00}, {"objective": 0.8, "loss": 0.02}, {"objective": 0.9, "loss": 0.03},
            {"objective": 0.8, "loss": 0.02}, {"objective": 0.7, "loss": 0.10}, {"objective": 1.1, "loss": 0.0}]
    # lower objective is better (TPOT): (0.9, 0.03) is beaten by (0.8, 0.02); (1.1, 0) by (1.0, 0)
    front = pareto(rows, min)
    assert [(r["objective"], r["loss"]) for r in front] == [(1.0, 0.0), (0.8, 0.02), (0.8, 0.02), (0.7, 0.10)]
    # higher is better (hit rate): (1.1, 0) beats everything with loss >= 0
    assert [(r["objective"], r["loss"]) for r in pareto(rows, max)] == [(1.1, 0.0)]


def test_space_restrictions_and_draws_are_deterministic():
    opts = Options(choices={"eviction": ["lru", "least_stale"], "routing": ["standard"], "miss": ["fetch", "drop"],
                            "prefetch": ["none"]}, capacities=[0.05, 0.1])
    space = candidates(opts, 0.25)
    assert len(space) == 2 * 1 * 3 * 1 * 2  # eviction x routing x miss (fetch, drop J=1, drop J=2) x prefetch x caps
    assert all(s[-1] in ("hardware.capacity=0.05", "hardware.capacity=0.1") for s in space)
    assert sum(lossless(s) for s in space) == 2 * 2
    a, b = draw(Options(trials=5), space, ("own",)), draw(Options(trials=5), space, ("own",))
    assert a == b and a[0] == ("own",) and len(set(a)) == 5
    assert len(candidates(Options(), 0.05)) == 9 * 9 * 7 * 7  # the whole default space at one capacity
    # hybrid and cpu_compute run every expert exactly: lossless with standard routing, as fetch is
    hybrid = candidates(Options(choices={"eviction": ["lru"], "routing": ["standard", "cache_prior"],
                                         "miss": ["hybrid", "cpu_compute"], "prefetch": ["none"]}), 0.05)
    assert sum(lossless(s) for s in hybrid) == 2 and all(lossless(s) == ("routing=standard" in s) for s in hybrid)
    # a base configuration with hybrid's low-precision option keeps it, and is lossy
    from specmd.commands.tune import own_stack

    raw = {"routing": {"name": "standard"}, "miss": {"name": "hybrid", "low": "int4", "percentile": 60.0},
           "eviction": {"name": "lru"}, "prefetch": {"name": "none"}, "hardware": {"capacity": 0.05}}
    assert "miss.low=int4" in own_stack(raw) and not lossless(own_stack(raw))
    raw["miss"]["low"] = None
    assert lossless(own_stack(raw))


@pytest.mark.parametrize("argv,match", [
    (["tune.objective=speed"], "tune.objective='speed'; valid choices: tpot, hit_rate"),
    (["tune.budget=nan"], r"tune.budget=nan must be a finite number >= 0"),
    (["tune.budget=-0.1"], r"tune.budget=-0.1 must be a finite number >= 0"),
    (["tune.trials=0"], r"tune.trials=0 must be >= 1"),
    (["tune.capacities=[0.05,2]"], r"tune.capacities: 2.0 must be a fraction in \(0, 1\]"),
    (["tune.eviction=[lru,belady]"], r"tune.eviction=\['lru', 'belady'\]: \['belady'\]; valid choices: lru, lfu"),
    (["tune.lambda=0.3"], "tune.lambda: unknown option; valid: objective, budget"),
    (["tune.trials=many"], "'tune.trials=many': tune.trials is a whole number >= 1"),
    (["eviction=lru"], r"tune searches eviction; restrict it with tune.eviction=\[...\] instead"),
])
def test_bad_options_are_named(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(argv)


def test_parse_keeps_the_base_overrides():
    opts, rest = parse(["model=tiny", "tune.objective=hit_rate", "tune.eviction=[lru,fld]", "hardware.capacity=0.1"])
    assert rest == ["model=tiny", "hardware.capacity=0.1"]
    assert opts.objective == "hit_rate" and opts.choices == {"eviction": ["lru", "fld"]}
    assert set(SPACE) == set(GROUPS)


def test_tune_on_the_tiny_model_finds_a_stack_within_budget_that_reruns_live(tmp_path, mirror):
    from hydra import compose, initialize_config_dir
    from rich.console import Console

    from specmd import CONF_DIR
    from specmd.app import execute
    from specmd.commands.tune import tune

    opts, base = parse(["model=tiny", "threads=1", f"replay.cache={tmp_path / 'traces'}", "tune.trials=8",
                        "tune.finalists=2", "tune.budget=0.01", f"tune.out={tmp_path / 'tune'}",
                        "tune.token_by_token=false"])
    s = tune(opts, base, Console(width=200))
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["trials"] + saved["skipped"] == 8 and (tmp_path / "tune" / "trials.csv").is_file()
    objectives = [r["objective"] for r in saved["finalists"]]
    assert objectives == sorted(objectives)  # measured live in order of TPOT, the search stopping at the winner
    for r in saved["finalists"]:
        if r["lossless"]:
            assert r["loss"] == 0.0  # bit-identical to the unhooked model
    w = s["winner"]
    assert w is not None and w["loss"] <= 0.01
    assert w["stack"] in [p["stack"] for p in s["pareto"]]  # the best within budget is never dominated
    # re-run the winner live, as the printed quality command does: the same perplexity, within the budget
    over = s["quality_command"].split()[3:]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        res = execute(compose(config_name="config", overrides=over), run_dir=str(tmp_path / "rerun"))
    ppl = res["tasks"]["wikitext"]["word_perplexity"]
    assert ppl == pytest.approx(w["quality"], rel=1e-9)
    assert ppl / s["unhooked_quality"] - 1 <= 0.01


def test_tune_refuses_a_fixed_slot_count_before_recording(tmp_path):
    from rich.console import Console

    from specmd.commands.tune import tune

    opts, base = parse(["model=tiny", "hardware.experts_per_layer=4", f"replay.cache={tmp_path / 'traces'}",
                        f"tune.out={tmp_path / 'tune'}"])
    with pytest.raises(ConfigError, match="specmd tune varies hardware.capacity; drop hardware.experts_per_layer=4"):
        tune(opts, base, Console())
    assert not (tmp_path / "traces").exists()  # nothing recorded


def test_finalists_search_prunes_lossier_settings_and_stops_within_budget():
    from specmd.commands.tune import at_least_as_lossy, lossiness, select_finalists

    def t(obj, *stack, cap=0.05):
        s = (*stack, f"hardware.capacity={cap}")
        return {"stack": s, "objective": obj, "lossless": lossless(s)}

    prior = lambda lam, j: ("routing=cache_prior", f"routing.lambda={lam}", f"routing.J={j}")
    ranked = [t(1.0, *prior(0.5, 1), "miss=drop", "miss.J=1"),     # measured: over budget
              t(1.1, *prior(0.5, 1), "miss=drop", "miss.J=1", cap=0.04),  # lossier in every way: skipped
              t(1.2, *prior(0.3, 2), "miss=drop", "miss.J=1"),     # gentler lambda and J: measured, over
              t(1.3, *prior(0.5, 2), "miss=drop", "miss.J=1"),     # >= (0.3, 2): skipped
              t(1.4, *prior(0.1, 2), "miss=fetch"),                # another miss policy: measured, within
              t(1.5, "routing=standard", "miss=fetch", "eviction=lru")]
    losses = {0: 0.5, 1: 0.2, 2: 0.004}
    seen = []

    def loss_of(trial, i):
        seen.append(trial["objective"])
        return losses[i]

    rows = select_finalists(ranked, loss_of, Options(budget=0.01, finalists=6))
    assert seen == [1.0, 1.2, 1.4] and [r["loss"] for r in rows] == [0.5, 0.2, 0.004]
    assert at_least_as_lossy(lossiness(ranked[1]["stack"]), lossiness(ranked[0]["stack"]))
    assert not at_least_as_lossy(lossiness(ranked[2]["stack"]), lossiness(ranked[0]["stack"]))
    # out of live runs before any success: the best lossless stack is measured last, as the fallback
    seen.clear()
    rows = select_finalists(ranked, lambda tr, i: seen.append(tr["objective"]) or 1.0, Options(finalists=2))
    assert seen == [1.0, 1.2, 1.5] and rows[-1]["lossless"]


TRACE = Path(__file__).resolve().parents[1] / "data" / "embedded_trace"  # recorded on specmd:tiny-olmoe


@pytest.mark.parametrize("model,ok", [("tiny", True), ("tiny_olmoe", False), ("deep_olmoe", False)])
def test_a_given_trace_is_checked_by_its_checkpoint_not_its_name(tmp_path, model, ok):
    """One identity of a model (issue 57): the project's own trace names its checkpoint (specmd:tiny-olmoe), the
    config its name (tiny); they are one model, and the advice for another names a valid override."""
    from specmd.commands.tune import _record
    from specmd.models.loader import checkpoint_of

    assert checkpoint_of("tiny") == checkpoint_of({"name": "tiny", "pretrained": "specmd:tiny-olmoe"}) \
        == checkpoint_of("specmd:tiny-olmoe") == "specmd:tiny-olmoe"
    base = [f"model={model}", f"replay.trace={TRACE}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=base), resolve=True)
        if ok:
            assert _record(base, raw)[0] == str(TRACE)
        else:
            want = {"deep_olmoe": "specmd:deep-olmoe", "tiny_olmoe": "seeded random"}[model]
            with pytest.raises(ConfigError, match=f"recorded on specmd:tiny-olmoe, .*model={model} "
                                                  rf"\({want}\): add model=tiny$"):
                _record(base, raw)
