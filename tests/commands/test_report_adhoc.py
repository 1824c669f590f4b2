"""specmd report on ad-hoc sweeps (no +experiment=, no report spec): per swept axis, the axis against hit rate,
collision rate and TPOT; a quality-vs-TPOT Pareto plot only when both vary; absent metrics and unfinished jobs
leave notes, not crashes; numeric axes are drawn in numeric order."""

import json

import yaml

from specmd.commands.report import build
from specmd.commands.report.adhoc import frontier
from specmd.sweeps import expected_jobs

TWO_AXES = {"eviction": "lru,least_stale", "hardware.capacity": "0.01,0.05,0.25"}
MIDS = ("hit", "collision", "tpot")


def default_results(axes: dict) -> dict:
    """Made-up but distinct numbers per job: capacity raises hits and lowers TPOT; least_stale collides less."""
    cap = float(axes.get("hardware.capacity", 0.05))
    ls = axes.get("eviction") == "least_stale"
    return {"cache": {"hit_rate": min(0.9, cap * 3), "in_cache_rate": 0.5, "collision_rate": 0.01 if ls else 0.03},
            "timing": {"ttft_s": 0.02, "tpot_s": 0.003 - cap * 0.004, "decode_tokens_per_s": 300.0},
            "tasks": {"gsm8k": {"exact_match/strict-match": 0.25}}}


def make_adhoc(root, params=TWO_AXES, results=default_results, failed=()):
    """A sweep as ``python -m specmd -m k=v1,v2 ...`` leaves it: no experiment, no report spec, one directory per
    job with its manifest and results.json (``failed.json`` for jobs whose axes dict matches one in ``failed``)."""
    root.mkdir(parents=True)
    mr = {"hydra": {"sweeper": {"params": {}}, "overrides": {"task": [f"{k}={v}" for k, v in params.items()]}},
          "eviction": {"name": "lru"}}
    (root / "multirun.yaml").write_text(yaml.safe_dump(mr, sort_keys=False))
    for num, job in enumerate(expected_jobs(mr)):
        axes = dict(o.split("=", 1) for o in job)
        d = root / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(job))
        if axes in [dict(f) for f in failed]:
            (d / "failed.json").write_text(json.dumps({"error": "RuntimeError: boom"}))
        else:
            (d / "results.json").write_text(json.dumps({"config": {}, **results(axes)}))
    return root


def pngs(out) -> set:
    return {p.name for p in out.glob("*.png")}


def test_two_axes_give_one_figure_per_axis_and_metric_and_no_pareto_when_quality_is_constant(tmp_path):
    out, (sec,) = build([str(make_adhoc(tmp_path / "s"))], str(tmp_path / "o"))
    expected = {f"s_{axis}_{m}.png" for axis in TWO_AXES for m in MIDS}
    assert pngs(out) == expected and {n for n, _ in sec.figures} == expected
    assert all((out / n).stat().st_size > 5000 for n in expected)
    assert "no Pareto plot for gsm8k: its exact_match/strict-match is the same" in " ".join(sec.notes)
    md = (out / "s.md").read_text()
    assert "![TPOT (ms) by hardware.capacity, one series per eviction](s_hardware.capacity_tpot.png)" in md
    assert "| TPOT (ms) |" in md  # the table shows the speed the figures plot


def test_pareto_plot_only_when_quality_and_speed_both_vary(tmp_path):
    def varied(axes):
        r = default_results(axes)
        r["tasks"]["gsm8k"]["exact_match/strict-match"] = float(axes["hardware.capacity"]) + (
            0.1 if axes["eviction"] == "lru" else 0.0)
        return r

    out, (sec,) = build([str(make_adhoc(tmp_path / "s", results=varied))], str(tmp_path / "o"))
    assert pngs(out) == {f"s_{axis}_{m}.png" for axis in TWO_AXES for m in MIDS} | {"s_pareto_gsm8k.png"}
    assert not any("Pareto" in n for n in sec.notes)

    def slow_constant(axes):  # quality varies, speed does not: a Pareto plot would say nothing
        r = varied(axes)
        r["timing"]["tpot_s"] = 0.002
        return r

    out, (sec,) = build([str(make_adhoc(tmp_path / "t", results=slow_constant))], str(tmp_path / "p"))
    assert "t_pareto_gsm8k.png" not in pngs(out)
    assert "no Pareto plot for gsm8k: TPOT is the same in every configuration" in sec.notes

    def scoring_only(axes):  # a perplexity run decodes nothing: no TPOT, its speed is TTFT
        r = varied(axes)
        r["timing"] = {"tpot_s": None, "ttft_s": 0.02 - float(axes["hardware.capacity"]) / 100}
        return r

    out, (sec,) = build([str(make_adhoc(tmp_path / "u", results=scoring_only))], str(tmp_path / "q"))
    assert "u_pareto_gsm8k.png" in pngs(out) and not any(n.startswith("u_") and "tpot" in n for n in pngs(out))
    assert dict(sec.figures)["u_pareto_gsm8k.png"].startswith("gsm8k exact_match/strict-match vs TTFT")
    assert "no TPOT figures: no finished job reports timing.tpot_s" in sec.notes


def test_frontier_keeps_the_configurations_nothing_beats_on_both():
    pts = [(1.0, 0.5, "a"), (2.0, 0.4, "b"), (2.0, 0.7, "c"), (3.0, 0.7, "d"), (4.0, 0.9, "e")]
    assert [p[2] for p in frontier(pts, higher_is_better=True)] == ["a", "c", "e"]
    # perplexity: lower is better
    assert [p[2] for p in frontier(pts, higher_is_better=False)] == ["a", "b"]


def test_a_metric_absent_from_every_job_gives_a_note_not_a_figure_and_failed_jobs_are_left_out(tmp_path):
    def no_timing(axes):
        r = default_results(axes)
        del r["timing"]
        return r

    failed = [{"eviction": "lru", "hardware.capacity": "0.25"}]
    out, (sec,) = build([str(make_adhoc(tmp_path / "s", results=no_timing, failed=failed))], str(tmp_path / "o"))
    assert pngs(out) == {f"s_{axis}_{m}.png" for axis in TWO_AXES for m in ("hit", "collision")}
    assert "no TPOT figures: no finished job reports timing.tpot_s" in sec.notes
    assert "1 job(s) that did not finish are left out of every figure (listed below)" in sec.notes
    assert "no Pareto plot for gsm8k: fewer than two configurations report both a speed" in " ".join(sec.notes)
    md = (out / "s.md").read_text()
    assert "**failed** eviction=lru hardware.capacity=0.25" in md and "*Note: no TPOT figures" in md


def test_numeric_axis_is_drawn_in_numeric_order_on_a_log_scale(tmp_path, monkeypatch):
    """Swept as 0.5,0.05,10,2 (string order 0.05 < 0.5 < 10 < 2): drawn at 0.05, 0.5, 2, 10, log x (> 1 decade);
    the categorical axis keeps the sweep's order."""
    from specmd.commands.report import adhoc

    drawn = {}

    def keep(fig, path):
        ax = fig.axes[0]
        drawn[path.name] = (ax.get_xscale(), [list(map(float, line.get_xdata())) for line in ax.lines],
                            [t.get_text() for t in ax.get_xticklabels()])
        adhoc._plt().close(fig)

    monkeypatch.setattr(adhoc, "_save", keep)
    params = {"hardware.bandwidth_gbps": "0.5,0.05,10,2", "eviction": "lru,fifo"}
    _, (sec,) = build([str(make_adhoc(tmp_path / "s", params=params, results=lambda a: default_results(
        {"hardware.capacity": a["hardware.bandwidth_gbps"]})))], str(tmp_path / "o"))
    scale, lines, ticks = drawn["s_hardware.bandwidth_gbps_hit.png"]
    assert scale == "log" and lines and all(xs == [0.05, 0.5, 2.0, 10.0] for xs in lines)
    assert ticks == ["0.05", "0.5", "2", "10"]
    assert drawn["s_eviction_hit.png"][2] == ["lru", "fifo"]  # categorical: the sweep's order
    series, cats = adhoc.axis_series("hardware.bandwidth_gbps", ["eviction"], adhoc.METRICS[0], sec.groups)
    assert cats is None and [x for x, _, _ in series["lru"]] == [0.05, 0.5, 2.0, 10.0]
