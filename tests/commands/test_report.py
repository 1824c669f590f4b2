"""specmd report on hand-built sweeps: exact table cells, mean ± std over repeats only, failed and missing jobs
listed (never averaged in), relative metrics against a matched baseline, figures, CSV, index.html, W&B."""

import csv
import json

import pytest

from specmd.ending import guarded
import yaml

from specmd.errors import ConfigError
from specmd.commands.report import build, main
from specmd.sweeps import expected_jobs, find_sweeps
from specmd.commands.report.expressions import evaluate
from specmd.commands.report.tables import Spec

SPEC = {
    "title": "hand sweep", "paper": "LS beats LRU",
    "rows": ["eviction"], "cols": "hardware.capacity", "repeat": ["eval.seed"],
    "baseline": {"eviction": "lru"}, "match": ["hardware.capacity"],
    "metrics": [{"hit %": "cache.hit_rate"}, {"miss ratio": "cache.misses / cache.requests"},
                {"gain %": "rel:cache.hit_rate"}],
    "figures": [{"kind": "bars", "x": "eviction", "y": "cache.misses", "overlay": "cache.collision_misses",
                 "panels": "hardware.capacity"},
                {"kind": "lines", "y": "cache.per_layer.hit_rate", "series": "eviction", "panels": "hardware.capacity"}],
}
# (eviction, capacity, seed) -> hit rate; None = failed.json; absent = never ran
HITS = {("lru", "0.05", "1"): 0.4, ("lru", "0.05", "2"): 0.6, ("least_stale", "0.05", "1"): 0.5,
        ("least_stale", "0.05", "2"): 0.7, ("lru", "0.25", "1"): 0.8, ("lru", "0.25", "2"): None,
        ("least_stale", "0.25", "1"): 0.9}


def make_sweep(root, experiment="hand", spec=SPEC, hits=HITS, params=None):
    params = params or {"eviction": "lru,least_stale", "hardware.capacity": "0.05,0.25", "eval.seed": "1,2"}
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text(yaml.safe_dump({
        "hydra": {"sweeper": {"params": params}, "overrides": {"task": [f"+experiment={experiment}"]}},
        "experiment": experiment, "report": spec}, sort_keys=False))
    for num, job in enumerate(expected_jobs(yaml.safe_load((root / "multirun.yaml").read_text()))):
        axes = dict(o.lstrip("+").split("=", 1) for o in job)
        key = (axes["eviction"], axes["hardware.capacity"], axes["eval.seed"])
        if key not in hits:
            continue
        d = root / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        if hits[key] is None:
            (d / "failed.json").write_text(json.dumps({"error": "RuntimeError: boom"}))
            continue
        h = hits[key]
        results = {"config": {"experiment": experiment, "eviction": {"name": axes["eviction"]},
                              "hardware": {"capacity": float(axes["hardware.capacity"])},
                              "eval": {"seed": int(axes["eval.seed"])}},
                   "cache": {"hit_rate": h, "requests": 100, "misses": round(100 * (1 - h)), "collision_misses": 5,
                             "per_layer": {"hit_rate": [h / 2, h]}}}
        (d / "results.json").write_text(json.dumps(results))
    return root


def read_table(md: str) -> dict:
    lines = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}


def test_report_cells_repeats_failures_and_baselines(tmp_path):
    sweep = make_sweep(tmp_path / "sweep")
    out, sections = build([str(sweep)], str(tmp_path / "out"))
    md = (out / "hand.md").read_text()
    t = read_table(md)
    lru, ls = t["lru"], t["least_stale"]
    # mean ± sample std over the two seeds; the seed axis is averaged because the spec says repeat
    assert lru["hit % @ hardware.capacity=0.05"] == "50.0 ± 14.1 (n=2)"
    assert ls["hit % @ hardware.capacity=0.05"] == "60.0 ± 14.1 (n=2)"
    assert lru["miss ratio @ hardware.capacity=0.05"] == "0.5 ± 0.1414 (n=2)"
    # rel: each LS seed against LRU's mean at the same capacity: 0.5/0.5-1 = 0, 0.7/0.5-1 = 0.4
    assert ls["gain % @ hardware.capacity=0.05"] == "20.0 ± 28.3 (n=2)"
    assert lru["gain % @ hardware.capacity=0.05"] == "0.0 ± 28.3 (n=2)"  # -0.2, +0.2
    # LRU at 25 %: seed 2 failed -> the value stands on one run and says so; LS at 25 %: seed 2 never ran
    assert lru["hit % @ hardware.capacity=0.25"] == "80.0 (1 of 2 runs)"
    assert ls["hit % @ hardware.capacity=0.25"] == "90.0 (1 of 2 runs)"
    assert ls["gain % @ hardware.capacity=0.25"] == "12.5 (1 of 2 runs)"  # 0.9 / 0.8 - 1
    assert "**failed** eviction=lru hardware.capacity=0.25 eval.seed=2" in md and "RuntimeError: boom" in md
    assert "**missing** eviction=least_stale hardware.capacity=0.25 eval.seed=2" in md
    assert "6/8 jobs finished" in md and "**Paper:** LS beats LRU" in md
    rows = list(csv.DictReader(open(out / "hand.csv")))
    r = next(r for r in rows if r["eviction"] == "lru" and r["hardware.capacity"] == "0.05" and r["metric"] == "hit %")
    assert float(r["mean"]) == pytest.approx(50.0) and r["n"] == "2" and r["jobs"] == "2"
    assert (out / "hand_1.png").stat().st_size > 1000 and (out / "hand_2.png").stat().st_size > 1000
    html = (out / "index.html").read_text()
    assert "hand_1.png" in html and "hand_2.png" in html and "failed" in html
    assert sections[0].spec.id == "hand"


def test_unnamed_swept_axes_become_rows_never_averaged(tmp_path):
    spec = dict(SPEC, repeat=[], baseline={}, match=[], figures=[], metrics=[{"hit %": "cache.hit_rate"}])
    sweep = make_sweep(tmp_path / "s", spec=spec)
    out, _ = build([str(sweep)], str(tmp_path / "o"))
    md = (out / "hand.md").read_text()
    assert "| eviction | eval.seed |" in md  # the seed axis is not in rows/cols/repeat: it becomes a row axis
    assert "| lru | 1 | 40.0 | 80.0 |" in md and "| least_stale | 2 | 70.0 | missing |" in md


def test_parent_directory_reads_the_newest_sweep_of_each_experiment(tmp_path):
    import os

    old = make_sweep(tmp_path / "runs" / "hand" / "old")
    new = make_sweep(tmp_path / "runs" / "hand" / "new", hits={("lru", "0.05", "1"): 0.1})
    os.utime(old / "multirun.yaml", (1, 1))
    sweeps, notes = find_sweeps([str(tmp_path / "runs")])
    assert [s.dir for s in sweeps] == [str(new)]
    assert notes and "older sweep of hand" in notes[0] and str(old) in notes[0]
    # naming both combines them: the same group then holds both sweeps' runs
    sweeps, notes = find_sweeps([str(old), str(new)])
    assert len(sweeps) == 2 and not notes


def test_metric_expressions():
    res = {"cache": {"misses": 3, "requests": 4, "bytes_demand": 10, "bytes_prefetch": 30, "per_layer": {"x": [1, 2, 3, 5]}},
           "tasks": {"gsm8k": {"exact_match/strict-match": 0.25}}}
    assert evaluate(res, "cache.misses / cache.requests") == 0.75
    assert evaluate(res, "( cache.bytes_demand + cache.bytes_prefetch ) / 1e1") == 4.0
    assert evaluate(res, "tasks.gsm8k.exact_match/strict-match") == 0.25  # '/' inside a name is no operator
    assert evaluate(res, "mean_first_half:cache.per_layer.x") == 1.5
    assert evaluate(res, "mean_second_half:cache.per_layer.x") == 4.0
    assert evaluate(res, "cache.per_layer.x.-1") == 5 and evaluate(res, "cache.nothing") is None
    assert evaluate(res, "cache.misses / cache.nothing") is None
    with pytest.raises(ConfigError, match="only"):
        evaluate(res, "cache.misses ** cache.requests")


def test_bad_specs_and_paths_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colums'\]"):
        Spec.parse({"colums": "x"}, "e")
    with pytest.raises(ConfigError, match="one 'label: expression' pair"):
        Spec.parse({"metrics": ["cache.hit_rate"]}, "e")
    bad = dict(SPEC, figures=[{"kind": "pie", "y": "cache.hit_rate"}])
    with pytest.raises(ConfigError, match="kind='pie'.*bars, lines, scatter"):
        build([str(make_sweep(tmp_path / "s", spec=bad))], str(tmp_path / "o"))
    assert guarded("specmd report", main, [str(tmp_path / "nowhere")]) == 2


def test_report_logs_tables_and_figures_to_an_offline_wandb_run(tmp_path, monkeypatch):
    from tests.wandb_offline import read_offline_run

    from specmd.commands.report.wandb_io import log_report

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, sections = build([str(make_sweep(tmp_path / "s"))], str(tmp_path / "o"))
    log_report(sections, out, "ent/proj", None, mode="offline")
    got = read_offline_run(out)
    assert got["run"]["job_type"] == "report" and got["run"]["group"] == "hand"
    logged = {k.split("/")[0] + "/" + k.split("/")[1] for h in got["history"] for k in h if k.startswith("hand/")}
    assert logged == {"hand/table", "hand/figure_1", "hand/figure_2"}
    tables = list(out.glob("wandb/offline-run-*/files/media/table/hand/table_*.table.json"))
    data = json.loads(tables[0].read_text())
    assert data["columns"][0] == "eviction" and data["data"][0][1] == "50.0 ± 14.1 (n=2)"
    assert len(list(out.glob("wandb/offline-run-*/files/media/images/hand/figure_*.png"))) == 2
    with pytest.raises(ConfigError, match="needs W&B online"):
        log_report(sections, out, "ent/proj", None, mode="offline", publish=True)


class FakeRun:
    def __init__(self, rid, config, summary, state="finished", created_at="2026-11-23T06:00:00Z"):
        self.id, self.config, self.summary, self.state, self.group = rid, config, summary, state, "hand"
        self.created_at = created_at


class FakeApi:
    """``wandb.Api``'s interface as sweeps_from_wandb uses it: ``runs(path, filters=...)``."""

    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return self._runs


def test_sweeps_read_back_from_wandb_runs(tmp_path):
    from specmd.loggers import flat_summary, flatten
    from specmd.commands.report.wandb_io import sweeps_from_wandb

    runs = []
    for i, (ev, hit) in enumerate((("lru", 0.4), ("least_stale", 0.6))):
        results = {"config": {"experiment": "hand", "eviction": {"name": ev}, "hardware": {"capacity": 0.05},
                              "report": dict(SPEC, cols=None, baseline={}, match=[], figures=[],
                                             metrics=[{"hit %": "cache.hit_rate"},
                                                      {"ppl": "tasks.wikitext.word_perplexity"},
                                                      {"L1 hit %": "cache.per_layer.hit_rate.1"}])},
                   "cache": {"hit_rate": hit, "per_layer": {"hit_rate": [0.0, hit]}},
                   "tasks": {"wikitext": {"word_perplexity": 10.0 + i}}}
        config = dict(flatten(results["config"]), hydra_overrides=[f"eviction={ev}"], sweep_dir="/s/new",
                      **{"provenance.git.commit": "x"})
        runs.append(FakeRun(f"r{i}", config, dict(flat_summary(results), _runtime=3)))
        if ev == "lru":  # an older multirun of the same experiment: not mixed in as a repeat
            old = dict(config, sweep_dir="/s/old")
            runs.append(FakeRun("old", old, flat_summary(dict(results, cache={"hit_rate": 0.9})),
                                created_at="2026-11-22T06:00:00Z"))
    runs.append(FakeRun("r9", {"experiment": "hand", "hydra_overrides": ["eviction=fifo"], "sweep_dir": "/s/new"},
                        {}, state="crashed"))
    api = FakeApi(runs)
    sweeps = sweeps_from_wandb("ent/proj", "hand", api=api)
    assert api.calls == [("ent/proj", {"group": "hand"})]
    out, sections = build([], str(tmp_path / "o"), sweeps=sweeps)
    t = read_table((out / "hand.md").read_text())
    assert t["lru"]["hit %"] == "40.0" and t["least_stale"]["ppl"] == "11" and t["least_stale"]["L1 hit %"] == "60.0"
    assert t["fifo"]["hit %"] == "failed"
    assert "W&B state crashed" in (out / "hand.md").read_text()


def test_publish_builds_a_wandb_report_with_a_panel_per_table_and_figure(tmp_path, monkeypatch):
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from specmd.commands.report.wandb_io import publish_report

    saved = []
    monkeypatch.setattr(wr.Report, "save", lambda self, *a, **k: saved.append(self) or self)
    monkeypatch.setattr(wr.Report, "url", property(lambda self: "https://wandb.ai/ent/proj/reports/x"), raising=False)
    _, sections = build([str(make_sweep(tmp_path / "s"))], str(tmp_path / "o"))
    url = publish_report(sections, "ent", "proj", "report hand 1", wr=wr)
    assert url.endswith("/reports/x") and len(saved) == 1
    report = saved[0]
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == 1 and grids[0].runsets[0].query == "report hand 1"
    panels = grids[0].panels
    assert panels[0].table_name == "hand/table" and panels[1].media_keys == ["hand/figure_1", "hand/figure_2"]
    assert any(isinstance(b, wr.P) and "LS beats LRU" in str(b.text) for b in report.blocks)


def test_a_job_that_never_ran_lands_in_its_own_row(tmp_path):
    """Rows named by config path (eviction.name) read a missing job's value from its group override."""
    spec = dict(SPEC, rows=["eviction.name"], cols=None, repeat=["eval.seed", "hardware.capacity"], baseline={},
                match=[], figures=[], metrics=[{"hit %": "cache.hit_rate"}])
    hits = {("lru", "0.05", "1"): 0.4}
    out, _ = build([str(make_sweep(tmp_path / "s", spec=spec, hits=hits))], str(tmp_path / "o"))
    t = read_table((out / "hand.md").read_text())
    assert set(t) == {"lru", "least_stale"}
    assert t["lru"]["hit %"] == "40.0 (1 of 4 runs)" and t["least_stale"]["hit %"] == "missing"


def test_lines_draw_more_metrics_per_series_where_when_selects(tmp_path, monkeypatch):
    """``also``: extra lines in the series' colour (hybrid_offload: measured points beside the simulated line,
    the bound for the fetch series only), ``when`` keeping the groups whose axes have those values."""
    import matplotlib.axes

    drawn = []
    plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(args[1]) if len(args) > 1 else None))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    fig = {"kind": "lines", "x": "config.hardware.capacity", "y": "cache.hit_rate", "series": "eviction",
           "also": [{"y": "cache.misses / cache.requests", "label": "miss ratio", "when": {"eviction": "lru"}}]}
    build([str(make_sweep(tmp_path / "s", spec=dict(SPEC, figures=[fig])))], str(tmp_path / "o"))
    by = dict(drawn)
    assert by["lru miss ratio"] == pytest.approx([0.5, 0.2])  # 1 - mean hit rate at 5% and 25% (seed 2 failed)
    assert "least_stale miss ratio" not in by and by["least_stale"] == pytest.approx([0.6, 0.9])
