"""The printed summary: what a reader sees first, and the rows that explain a low hit rate."""

from rich.console import Console

from specmd.engine import GROUPS
from specmd.summary import COMPARE_HINT, print_summary


def results(**cache):
    base = dict(hit_rate=0.0, hits=0, requests=100, in_cache_rate=0.6, prefetch_late=60, collision_misses=3,
                evictions=50, prefetch_issued=70, prefetch_used=60, streamed=0, prefetch_skipped=0)
    base.update(cache)
    hw = {"name": "a100_pcie", "capacity": 0.05}
    cfg = {g: {"name": "x"} for g in GROUPS}
    cfg.update(model={"name": "m"}, hardware=hw, stack={"measure": "all"})
    return {"config": cfg, "cache": base, "tasks": {}, "wall_s": 1.0, "routing": {"fidelity": 1.0},
            "timing": {"stall_s": 0.1, "ttft_s": 0.01, "tpot_s": 0.001, "tokens_per_s": 10.0}}


def text(res):
    console = Console(record=True, width=220)
    print_summary(res, "run", console)
    return console.export_text()


def test_late_prefetches_lead_with_the_in_cache_rate_then_the_arrived_hit_rate():
    out = text(results())
    assert out.index("in-cache rate") < out.index("hit rate (arrived)")
    assert "0.6000" in out and "60 still in flight" in out
    assert COMPARE_HINT in out


def test_no_late_prefetch_shows_the_plain_hit_rate_and_hides_empty_explanations():
    out = text(results(prefetch_late=0, hit_rate=0.5, hits=50))
    assert "in-cache rate" not in out and "0.5000  (50/100 requests)" in out
    assert "streamed" not in out and "prefetch skipped" not in out


def test_streamed_and_skipped_misses_are_shown_when_they_happened():
    out = text(results(streamed=7, prefetch_skipped=4))
    assert "7 misses ran without a cache slot" in out and "4 predictions not fetched" in out


def test_wikitext_prints_one_progress_bar_per_phase_not_one_per_document(capfd, mirror):
    from specmd.eval.harness import EvalConfig, evaluate
    from specmd.eval.mirror import mirrored
    from specmd.models.loader import ModelConfig, load_model

    model, tok = load_model(ModelConfig(name="t", family="olmoe", pretrained="specmd:tiny-olmoe", dtype="float32"))
    with mirrored(mirror):
        evaluate(model, tok, EvalConfig(tasks=["wikitext"], limit=3, max_length=128))
    err = capfd.readouterr().err
    # lm-eval 0.4.13 opened "Running loglikelihood requests" once per scored batch of windows
    assert "Running loglikelihood requests" not in err, err[-2000:]
