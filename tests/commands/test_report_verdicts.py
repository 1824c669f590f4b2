"""Computed verdicts of specmd report (``report.checks``, specmd/commands/report/verdicts.py): a check holds, does not hold,
or is not measured (a group missing, failed, or a selector that picks several); checks are validated when the
spec is parsed; every shipped experiment's checks name its own metrics and axes and pick exactly one group of
its real sweep; on experiments/README.md's numbers they give the README's verdicts; the markdown and index.html
show them (marks, words, values), and an ad-hoc sweep shows none."""

import functools
import json

import pytest

from specmd.ending import guarded
import yaml
from tests.commands.test_report_adhoc import make_adhoc

from specmd.errors import ConfigError
from specmd.commands.report import build, main
from specmd.sweeps import Job, expected_jobs
from specmd.commands.report.tables import Spec, group_jobs
from specmd.shipped import experiments, load as load_conf
from specmd.commands.report.verdicts import FAILS, HOLDS, UNMEASURED, parse_spec, summary, verdicts

BASE = {"rows": ["eviction.name"], "cols": "hardware.capacity", "repeat": ["eval.seed"],
        "metrics": [{"collision %": "cache.collision_rate"}, {"TTFT (ms)": "timing.ttft_s * 1000"},
                    {"first-half %": "mean_first_half:cache.per_layer.collision_rate"},
                    {"second-half %": "mean_second_half:cache.per_layer.collision_rate"}]}


def check(claim="c", metric="collision %", **kw):
    return {"claim": claim, "metric": metric, **kw}


def at(ev, cap=0.05, **more):
    return {"eviction.name": ev, "hardware.capacity": cap, **more}


def job(ev, cap, seed, coll=None, status="ok", ttft=None, layers=None):
    results = {"cache": {"collision_rate": coll, "per_layer": {"collision_rate": layers}},
               "timing": {"ttft_s": ttft}} if status == "ok" else {}
    return Job([f"eviction={ev}", f"hardware.capacity={cap}", f"eval.seed={seed}"], status, results=results)


def judged(jobs, checks, **spec):
    s = parse_spec(dict(BASE, checks=checks, **spec), "hand")
    groups, _ = group_jobs(s, jobs)
    return verdicts(s, groups)


JOBS = [job("lru", "0.05", 1, 0.090), job("lru", "0.05", 2, 0.112),  # mean 10.1 over the repeat axis
        job("least_stale", "0.05", 1, 0.023), job("score", "0.05", 1, 0.025), job("fld", "0.05", 1, 0.074),
        job("lru", "0.25", 1, status="failed"), job("least_stale", "0.25", 1, 0.026),
        job("fld", "0.25", 1, status="missing")]


def test_holds_does_not_hold_and_not_measured_with_the_reason():
    vs = judged(JOBS, [
        check("LS below LRU", lower=at("least_stale"), than=at("lru")),
        check("score highest", higher=at("score"), than=[at("lru"), at("fld"), at("least_stale")]),
        check("LS below LRU at 25%", lower=at("least_stale", 0.25), than=at("lru", 0.25)),  # LRU failed
        check("FLD below LS at 25%", lower=at("fld", 0.25), than=at("least_stale", 0.25)),  # FLD never ran
        check("LS below Belady", lower=at("least_stale"), than=at("belady")),  # not in the sweep
        check("ambiguous", lower={"eviction.name": "least_stale"}, than={"eviction": "lru"}),
    ])
    got = [(v.status, v.text) for v in vs]
    assert got[0] == (HOLDS, "least_stale 2.3 < lru 10.1")
    assert got[1] == (FAILS, "score 2.5 < lru 10.1, < fld 7.4, > least_stale 2.3")
    assert got[2] == (UNMEASURED, "eviction.name=lru, hardware.capacity=0.25: failed")
    assert got[3] == (UNMEASURED, "eviction.name=fld, hardware.capacity=0.25: not run")
    assert got[4] == (UNMEASURED, "no group has eviction.name=belady, hardware.capacity=0.05")
    assert got[5][0] == UNMEASURED and got[5][1].startswith(
        "eviction.name=least_stale matches 2 groups, which differ in hardware.capacity")
    assert [v.mark for v in vs] == ["✓", "✗", "–", "–", "–", "–"]
    assert vs[0].values == "collision %: least_stale 2.3 < lru 10.1" and vs[2].values == got[2][1]
    assert summary(vs) == "1 of 6 claims hold; 1 does not hold; 4 not measured"
    assert summary(vs[:1]) == "1 of 1 claim holds" and summary(vs[1:2]) == "0 of 1 claim holds; 1 does not hold"


def test_each_than_metric_ties_and_selector_values():
    hits = {"lru": (0.001, 0.5, 0.90), "ml": (0.006, 0.6, 0.45)}  # ml below lru at 0.25: fails there
    jobs = [job(ev, cap, 1, c, layers=[0.0, 0.0, c, c]) for ev, cs in hits.items()
            for cap, c in zip(("0.01", "0.05", "0.25"), cs)]
    jobs += [job("lfu", "0.01", 1, 0.001), job("lfu", "0.05", 1, status="failed")]
    jobs += [job("a", "0.05", 1, ttft=2.5398), job("b", "0.05", 1, ttft=2.5403)]  # both show as 2540
    vs = judged(jobs, [
        check("ml above lru everywhere", higher={"eviction.name": "ml"}, than={"eviction.name": "lru"},
              each="hardware.capacity"),
        check("ml above lfu everywhere", higher={"eviction": "ml"}, than={"eviction": "lfu"}, each="hardware.capacity"),
        check("deeper layers collide more", metric="second-half %", higher={"eviction.name": "lru"},
              than_metric="first-half %", each="hardware.capacity"),
        check("a faster than b", metric="TTFT (ms)", lower=at("a"), than=at("b")),
        check("0.050 is 0.05", lower=at("ml", "0.050"), than=at("lru", 0.05)),
    ])
    v = vs[0]
    assert (v.status, v.text) == (FAILS, "holds at 2 of 3 hardware.capacity values; not at 0.25")
    assert [(p.at, p.status, p.text) for p in v.points] == [
        ("0.01", HOLDS, "ml 0.6 > lru 0.1"), ("0.05", HOLDS, "ml 60.0 > lru 50.0"),
        ("0.25", FAILS, "ml 45.0 < lru 90.0")]
    # measured where it holds, failed where lfu's job failed, and lfu never ran at 0.25: not measured, never "holds"
    assert (vs[1].status, vs[1].text) == (UNMEASURED, "holds at 1 of 3 hardware.capacity values; not measured at "
                                                      "0.05, 0.25")
    assert "lfu, hardware.capacity=0.05: failed" in vs[1].points[1].text
    # one group, two metrics: each value names its metric
    assert vs[2].status == HOLDS and vs[2].points[1].text == "second-half % 50.0 > first-half % 0.0"
    assert vs[2].values.startswith("holds at every hardware.capacity value (3 of 3)")
    # a difference the table cannot show is no difference: 2539.8 vs 2540.3 ms both read 2540
    assert (vs[3].status, vs[3].text) == (FAILS, "a 2540 = b 2540")
    assert vs[4].status == FAILS and vs[4].text == "ml 60.0 > lru 50.0"  # "0.050" selects the 0.05 groups


@pytest.mark.parametrize("bad, message", [
    (check(lowr=at("lru")), r"report.checks\[0\] of hand \('c'\): unknown key\(s\) \['lowr'\]"),
    (check(metric="colision %", lower=at("lru"), than=at("fld")),
     r"metric 'colision %' is neither a label of report.metrics \(collision %, TTFT \(ms\), .*\) nor an expression"),
    (check(metric="cache.misses ** 2", lower=at("lru"), than=at("fld")), "neither a label"),
    (check(lower=at("lru"), higher=at("fld"), than=at("score")),
     "exactly one of lower: or higher:.*got lower and higher"),
    (check(than=at("lru")), "exactly one of lower: or higher:.*got neither"),
    (check(lower=at("lru")), "needs than:"),
    (check(lower={"policy": "lru"}, than=at("fld")), "lower names 'policy', not a row or column axis of the spec "
                                                     r"\(eviction.name, hardware.capacity\)"),
    (check(lower=at("lru"), than=[at("fld"), "score"]), r"than\[1\] must map axes to values"),
    (check(lower=at("lru"), than=at("fld"), each="model"), "each: 'model' is not a row or column axis"),
    (check(lower=at("lru"), than={"eviction.name": "fld"}, each="hardware.capacity"),
     "names 'hardware.capacity', the each: axis"),
    ({"metric": "collision %", "lower": at("lru"), "than": at("fld")}, r"report.checks\[0\] of hand: needs claim:"),
])
def test_spec_validation_names_the_experiment_and_the_check(bad, message):
    with pytest.raises(ConfigError, match=message):
        parse_spec(dict(BASE, checks=[bad]), "hand")


def test_a_bad_check_stops_the_report_with_its_name(tmp_path, capsys):
    from tests.commands.test_report import SPEC, make_sweep

    spec = dict(SPEC, checks=[{"claim": "LS wins", "metric": "hit", "higher": {"eviction": "least_stale"},
                               "than": {"eviction": "lru"}}])
    assert guarded("specmd report", main, [str(make_sweep(tmp_path / "s", spec=spec)), "--out", str(tmp_path / "o")]) == 2
    assert "report.checks[0] of hand ('LS wins'): metric 'hit' is neither a label" in capsys.readouterr().err


# --- the shipped experiments ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def raw_yaml(name: str) -> dict:  # read-only: the experiment's own file
    return load_conf("experiment", name)


@functools.lru_cache(maxsize=None)
def base_config(name: str) -> dict:  # read-only
    """The config values a job of ``name`` does not override, as far as checks read them: each policy group's
    name from the yaml's defaults list (``override /routing: standard``), an experiment's defaults it extends."""
    cfg: dict = {}
    for d in raw_yaml(name).get("defaults") or []:
        if isinstance(d, str) and d != "_self_":
            cfg.update(base_config(d))
        elif isinstance(d, dict):
            (key, value), = d.items()
            cfg[key.replace("override", "").strip(" /")] = {"name": value}
    return cfg


def fake_results(spec: Spec, axes: dict, numbers=None) -> dict:
    """A number for every path the spec's metrics read (per-layer lists for mean_*_half:); ``numbers(axes)``
    gives real ones."""
    if numbers is not None:
        return numbers(axes)
    value = 1.0 + (hash(tuple(sorted(axes.items()))) % 1000) / 10.0
    res: dict = {}
    for _, expr in spec.metrics:
        for tok in expr.split(":")[-1].split():
            if "." not in tok or tok.replace(".", "").replace("e", "").isdigit():
                continue
            node, parts = res, tok.split(".")
            for i, p in enumerate(parts[:-1]):
                if parts[i + 1].lstrip("-").isdigit():
                    node[p] = [value] * 5
                    break
                node = node.setdefault(p, {})
            else:
                node[parts[-1]] = [value] * 4 if expr.startswith("mean_") else value
    return res


def shipped_section(report_id: str, numbers=None):
    """(spec, groups) of a report section as the shipped sweeps lay it out: every job each experiment with this
    report id (and its ``also``) expands to, with made-up results or ``numbers(axes)``."""
    names = [n for n in experiments() if (raw_yaml(n)["report"].get("id") or n) == report_id]
    spec = parse_spec(raw_yaml(names[0])["report"], names[0])
    jobs = []
    for name in dict.fromkeys(names + spec.also):
        params = raw_yaml(name)["hydra"]["sweeper"]["params"]
        mr = {"hydra": {"sweeper": {"params": params}, "overrides": {"task": [f"+experiment={name}"]}}}
        for overrides in expected_jobs(mr):
            axes = dict(o.lstrip("+").split("=", 1) for o in overrides)
            jobs.append(Job(overrides, "ok", results=fake_results(spec, axes, numbers), config=base_config(name)))
    groups, _ = group_jobs(spec, jobs)
    return spec, groups


def shipped() -> dict:
    """report id -> [(experiment, its report block)]."""
    out: dict = {}
    for name in experiments():
        rep = raw_yaml(name)["report"]
        out.setdefault(rep.get("id") or name, []).append((name, rep))
    return out


def test_every_shipped_check_names_its_own_metrics_and_axes_and_picks_one_group_of_its_sweep():
    sections = shipped()
    with_checks = {rid: blocks for rid, blocks in sections.items() if blocks[0][1].get("checks")}
    assert len(with_checks) >= 5 and sum(len(b[0][1]["checks"]) for b in with_checks.values()) >= 8
    for rid, blocks in sections.items():
        # experiments drawn into one section carry the same checks (either one's spec may be the section's)
        assert len({json.dumps(rep.get("checks"), sort_keys=True) for _, rep in blocks}) == 1, rid
    for rid in with_checks:
        spec, groups = shipped_section(rid)
        labels, axes = dict(spec.metrics), spec.rows + [spec.cols]
        for c in spec.checks:
            assert c.label in labels and c.than_label in labels, (rid, c.claim)  # the table's own numbers
            assert all(k in axes for sel in [c.subject] + c.than for k in sel), (rid, c.claim)
        for v in verdicts(spec, groups):
            assert v.status != UNMEASURED, (rid, v.check.claim, v.text)


def test_shipped_checks_on_the_readmes_numbers_give_its_verdicts():
    """experiments/README.md's tables (deep_olmoe) -> its summary's "holds" column."""
    flash = {"lru": (0.0, 0.0, 0.0, 0.0, 41.2, 71.4), "lfu": (0.7, 4.5, 9.9, 20.2, 45.6, 76.1),
             "arc": (0.0, 0.0, 0.0, 0.0, 44.0, 71.3), "lecar": (0.0, 0.0, 0.0, 0.0, 42.3, 72.7),
             "ml": (0.6, 4.6, 10.5, 20.7, 45.4, 75.1), "belady": (2.3, 14.5, 28.1, 45.5, 71.7, 90.6)}
    caps = ["0.01", "0.025", "0.05", "0.1", "0.25", "0.5"]
    spec, groups = shipped_section("flashmoe_fig6", lambda a: {"cache": {
        "hit_rate": flash[a["eviction"]][caps.index(a["hardware.capacity"])] / 100}})
    vs = verdicts(spec, groups)
    assert [v.status for v in vs] == [HOLDS, FAILS, HOLDS, HOLDS, HOLDS]  # "partly": ML >= LFU at 3 of 6 sizes
    assert vs[1].text == "holds at 3 of 6 hardware.capacity values; not at 0.01, 0.25, 0.5"

    table1 = {"eliseev23": (2.5403, 2.755), "zhu25": (2.530, 2.758), "hobbit24": (1.149, 6.535),
              "mixturecache25": (2.535, 3.081), "specmd": (2.5398, 2.759), "unhooked": (None, None)}
    spec, groups = shipped_section("specmd_table1", lambda a: {"timing": dict(zip(
        ("ttft_s", "decode_tokens_per_s"), table1[a["system"]]))})
    vs = verdicts(spec, groups)
    assert [v.status for v in vs] == [HOLDS, FAILS, FAILS]
    assert vs[0].text == "hobbit24 1149 < eliseev23 2540, < zhu25 2530, < mixturecache25 2535, < specmd 2540"
    assert vs[2].text == "specmd 2540 = eliseev23 2540"  # "2,540 vs 2,540 ms": no

    halves = {"score": ((0.0, 3.0), (0.9, 4.2), (0.8, 2.6)), "lru": ((0.0, 4.0), (0.0, 20.2), (6.2, 13.0)),
              "least_stale": ((0.0, 2.8), (1.5, 3.0), (0.9, 4.3)), "belady": ((0.1, 2.6), (0.9, 0.9), (0.0, 1.0))}

    def per_layer(a):
        first, second = halves[a["eviction"]][["0.01", "0.05", "0.25"].index(a["hardware.capacity"])]
        layers = [first / 100] * 2 + [second / 100] * 2  # mean of the first half, of the second
        return {"cache": {"collision_rate": 0.0, "per_layer": {"collision_rate": layers}}}

    spec, groups = shipped_section("specmd_fig5", per_layer)
    vs = verdicts(spec, groups)
    assert [v.status for v in vs] == [HOLDS, HOLDS]
    assert vs[0].points[1].text == "second-half layers collision % 20.2 > first-half layers collision % 0.0"

    fig7 = {("fetch", "0.0"): (2.758, 5604), ("fetch", "0.3"): (2.758, 5608), ("drop", "0.0"): (3.488, 5613),
            ("drop", "0.3"): (2.999, 5692), ("substitute", "0.0"): (2.758, 5604), ("substitute", "0.3"): (2.758, 5608),
            ("fetch_lowest_bit", "0.0"): (21.02, 5715), ("fetch_lowest_bit", "0.3"): (23.59, 5715),
            ("fetch_priority", "0.0"): (5.54, 5602), ("fetch_priority", "0.3"): (5.218, 5600),
            ("drop_priority_cascade", "0.0"): (5.637, 5615), ("drop_priority_cascade", "0.3"): (5.229, 5607)}

    def speed_quality(a):
        tps, ppl = fig7[a["miss"], a["routing.lambda"]]
        return {"timing": {"decode_tokens_per_s": tps}, "tasks": {"wikitext": {"word_perplexity": ppl}}}

    spec, groups = shipped_section("specmd_fig7", speed_quality)
    vs = verdicts(spec, groups)
    assert [v.status for v in vs] == [HOLDS, FAILS, HOLDS, FAILS]
    assert vs[3].text == "holds at 1 of 6 miss.name values; not at fetch, drop, substitute, fetch_priority, " \
                         "drop_priority_cascade"  # "cache-aware routing adds 10-20 %": no

    ttft = {("eliseev23", "none"): 2608, ("eliseev23", "least_stale"): 2597, ("zhu25", "none"): 2602,
            ("zhu25", "least_stale"): 2603, ("hobbit24", "none"): 1143, ("hobbit24", "least_stale"): 1145,
            ("mixturecache25", "none"): 2594, ("mixturecache25", "least_stale"): 2579}
    spec, groups = shipped_section("specmd_table2", lambda a: {"timing": {
        "ttft_s": ttft[a["system"], a["drop_in"]] / 1000}})
    (v,) = verdicts(spec, groups)
    assert (v.status, v.text) == (FAILS, "holds at 2 of 4 system values; not at zhu25, hobbit24")


# --- the report: markdown and index.html ---------------------------------------------------------------

# experiments/README.md's specmd_fig4 collision rates (%) at 1, 5 and 25 %
FIG4 = {"fld": (2.0, 7.4, 10.7), "score": (1.5, 2.5, 1.7), "lru": (2.0, 10.1, 9.6), "least_stale": (1.4, 2.3, 2.6),
        "belady": (1.4, 0.9, 0.5)}


def make_fig4(root, failed=({"eviction": "lru", "hardware.capacity": "0.25"},)):
    """A specmd_fig4 sweep as ``python -m specmd -m +experiment=specmd_fig4`` leaves it, with the README's
    collision rates (the report reads the installed yaml's spec and checks); the jobs in ``failed`` failed."""
    params = {"eviction": "fld,score,lru,least_stale,belady", "hardware.capacity": "0.01,0.05,0.25"}
    mr = {"hydra": {"sweeper": {"params": params}, "overrides": {"task": ["+experiment=specmd_fig4"]}},
          "experiment": "specmd_fig4"}
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text(yaml.safe_dump(mr, sort_keys=False))
    for num, overrides in enumerate(expected_jobs(mr)):
        axes = dict(o.lstrip("+").split("=", 1) for o in overrides)
        d = root / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        if {k: axes[k] for k in params} in list(failed):
            (d / "failed.json").write_text(json.dumps({"error": "RuntimeError: out of memory"}))
            continue
        rate = FIG4[axes["eviction"]][["0.01", "0.05", "0.25"].index(axes["hardware.capacity"])] / 100
        (d / "results.json").write_text(json.dumps({
            "config": {"experiment": "specmd_fig4", "eviction": {"name": axes["eviction"]}},
            "cache": {"collision_rate": rate, "requests": 50000, "misses": 40000,
                      "collision_misses": round(rate * 50000)}}))
    return root


def test_markdown_and_html_show_each_check_with_its_mark_words_and_values(tmp_path):
    out, sections = build([str(make_fig4(tmp_path / "fig4")), str(make_adhoc(tmp_path / "adhoc"))],
                          str(tmp_path / "report"))
    fig4 = next(s for s in sections if s.spec.id == "specmd_fig4")
    assert [v.status for v in fig4.verdicts] == [HOLDS, FAILS, HOLDS, UNMEASURED]  # README: yes, no, yes, (yes)
    md = (out / "specmd_fig4.md").read_text()
    assert "**Verdict:** 2 of 4 claims hold; 1 does not hold; 1 not measured" in md
    assert ("- ✓ **holds**: Least-Stale has far fewer collisions than LRU at 5% (paper: 1.6–1.9% vs 4.5–12.6%) "
            "— collision %: least_stale 2.3 < lru 10.1") in md
    assert ("- ✗ **does not hold**: Score-Based has the most collisions at 5% (paper: 42.6–60.9%) — collision %: "
            "score 2.5 < lru 10.1, < fld 7.4, > least_stale 2.3") in md
    assert ("- – **not measured**: Least-Stale stays below LRU at 25% — eviction.name=lru, "
            "hardware.capacity=0.25: failed") in md
    assert md.index("**Paper:**") < md.index("**Verdict:**") < md.index("| eviction.name")
    assert "**Verdict:**" in (out / "report.md").read_text()

    page = (out / "index.html").read_text()
    box = page[page.index("<div class='verdict v-no'><h3>Verdict</h3>"):]
    box = box[:box.index("</div></div>")]
    assert page.index("<h3>Paper's claim</h3>") < page.index("<h3>Verdict</h3>")
    assert "<p class='summary'>2 of 4 claims hold; 1 does not hold; 1 not measured</p>" in box
    # mark, the status in words (colour is not the only cue), the claim, the values: escaped
    assert ("<li class='v-ok'><span class='mark' aria-hidden='true'>✓</span><div><b class='state'>holds</b> "
            "Least-Stale has far fewer collisions") in box
    assert "<span class='values'>collision %: least_stale 2.3 &lt; lru 10.1</span>" in box
    assert ("<li class='v-no'><span class='mark' aria-hidden='true'>✗</span><div><b class='state'>does not hold</b>"
            in box and "score 2.5 &lt; lru 10.1, &lt; fld 7.4, &gt; least_stale 2.3" in box)
    assert ("<li class='v-na'><span class='mark' aria-hidden='true'>–</span><div><b class='state'>not measured</b>"
            in box and "hardware.capacity=0.25: failed" in box)
    css = page[page.index("<style>"):page.index("</style>")]
    assert ".v-ok>.mark,.v-ok>div>.state{color:#1a7f37}" in css and ".v-no>.mark,.v-no>div>.state{color:#cf222e}" in css
    assert "(2 of 4 claims hold; 1 does not hold; 1 not measured)</span></li>" in page  # the contents list
    # the ad-hoc sweep has no claim and no verdict
    assert page.count("<h3>Verdict</h3>") == 1 and page.count("Paper's claim") == 1
    assert "Verdict" not in (out / f"{next(s for s in sections if s.adhoc).spec.id}.md").read_text()


def test_a_published_wandb_report_carries_the_verdict(tmp_path, monkeypatch):
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from specmd.commands.report.wandb_io import publish_report

    saved = []
    monkeypatch.setattr(wr.Report, "save", lambda self, *a, **k: saved.append(self) or self)
    monkeypatch.setattr(wr.Report, "url", property(lambda self: "https://wandb.ai/e/p/reports/x"), raising=False)
    _, sections = build([str(make_fig4(tmp_path / "fig4"))], str(tmp_path / "o"))
    publish_report(sections, "e", "p", "report specmd_fig4 1", wr=wr)
    blocks = saved[0].blocks
    assert any(isinstance(b, wr.P) and "Verdict: 2 of 4 claims hold; 1 does not hold; 1 not measured" in str(b.text)
               for b in blocks)
    (items,) = [b.items for b in blocks if isinstance(b, wr.UnorderedList)]
    assert len(items) == 4 and "✗ does not hold: Score-Based has the most collisions" in str(items[1])
