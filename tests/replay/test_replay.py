"""Replay: the engine fed by a recorded trace equals the live run (cache and timing, bit for bit) for every
exact stack; Belady is the optimum (libCacheSim equality, every policy at or below it); oracle prefetch."""

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from specmd.ending import guarded
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from tests.conftest import sample_ids, tiny
from specmd.engine import Geometry
from specmd.compose import spec_of
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.policies.eviction import EVICTION
from specmd.policies.prefetch import PREFETCH
from specmd.replay.driver import check, exactness, run_replay
from specmd.engine.store import StoreSizes
from specmd.replay.trace import Trace, TraceMeta, TraceWriter, full_calls, read_trace
from specmd.shipped import replayed_experiments


def case_spec(case):
    case = dict(case)
    hw = {k: case.pop(k) for k in list(case) if k in HardwareConfig.__dataclass_fields__}
    return spec_of(hardware=HardwareConfig(**hw), **case)


def live(model, spec, prompts, trace_dir=None, depth=2):
    """A live run: each prompt is prefilled, then 3 decode steps (generate)."""
    stack = install(model, spec)
    if trace_dir is not None:
        stack.writer = TraceWriter(trace_dir, stack.geom, stack.scoring, stack.store, depth)
    with torch.no_grad(), stack:
        for ids in prompts:
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    if stack.writer is not None:
        stack.writer.close()
    return stack.engine.results()


# every registered policy a live run can use (oracles need the future: replay only)
EVICTIONS = [e for e in EVICTION.names() if not EVICTION.get(e).needs_future]
PREFETCHES = [p for p in PREFETCH.names() if not PREFETCH.get(p).needs_future]
CASES = (
    [dict(eviction=e, prefetch="topk", capacity=0.25) for e in EVICTIONS]
    + [dict(prefetch=p, capacity=c) for p in PREFETCHES for c in (0.05, 0.25, 0.6)]
    + [dict(eviction=e, prefetch="lookahead", capacity=0.3, scope="per_layer")
       for e in ("lru", "least_stale", "lfu", "fld", "score", "arc")]
    + [dict(miss="cpu_compute", capacity=0.1), dict(miss="cpu_compute", prefetch="score", capacity=0.3, scope="per_layer"),
       dict(eviction="least_stale", capacity=0.2, bandwidth_gbps=0.5, latency_us=200.0),
       dict(eviction="lfu", experts_per_layer=5, scope="per_layer")]
)


@pytest.fixture(scope="module", params=["olmoe", "mixtral"])
def recorded(request, tmp_path_factory):
    family = request.param
    model = tiny(family)
    prompts = [sample_ids(batch=1, seq=20, seed=s) for s in (0, 1)]
    path = tmp_path_factory.mktemp(f"trace_{family}") / "trace"
    first = live(model, case_spec(CASES[0]), prompts, path)
    return family, model, prompts, read_trace(path), first


def test_a_trace_with_a_nan_weight_or_logit_is_rejected_naming_the_file_and_row(recorded, tmp_path):
    import shutil

    src = Path(recorded[3].path)
    for name, dtype, row in (("logits", np.float32, 5), ("weights", np.float16, 11)):
        bad = tmp_path / name
        shutil.copytree(src, bad)
        a = np.memmap(bad / f"{name}.bin", dtype=dtype, mode="r+")
        a[row * (a.size // len(recorded[3].index)) + 1] = np.nan
        a.flush()
        del a
        with pytest.raises(ConfigError, match=rf"{name}.bin: row {row} holds a value that is not a finite number"):
            read_trace(bad)


def test_trace_holds_every_pass_and_layer_call(recorded):
    family, model, prompts, trace, first = recorded
    L = trace.meta.geometry.num_layers
    assert trace.passes[:, 0].tolist() == [0, 1, 1, 1] * 2  # prefill, then 3 decode steps, per prompt
    assert trace.passes[:, 1].tolist() == [20, 1, 1, 1] * 2
    assert trace.passes[:, 2].tolist() == [20, 21, 22, 23] * 2  # context
    assert len(trace.calls) == 8 * L and trace.depth == 2
    assert trace.index.shape == (L * 23 * 2, trace.meta.geometry.top_k)
    assert first["timing"]["passes"] == 8


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_replay_equals_live(recorded, case):
    family, model, prompts, trace, _ = recorded
    spec = case_spec(case)
    want = live(model, spec, prompts)
    assert not exactness(trace, spec)
    got = run_replay(trace, spec).results()
    assert got["cache"] == want["cache"]
    assert got["timing"] == want["timing"]
    assert got["routing"] == want["routing"]


def test_lossy_replay_says_inexact(recorded):
    family, model, prompts, trace, _ = recorded
    for case, needle in ((dict(routing="cache_prior"), "routing=cache_prior"), (dict(miss="drop"), "miss=drop"),
                         (dict(miss="substitute"), "miss=substitute")):
        spec = case_spec(case)
        reasons = exactness(trace, spec)
        assert reasons and needle in reasons[0]
        res = run_replay(trace, spec).results()  # applies the policy to the recorded logits
        assert res["cache"]["requests"] > 0


def test_killed_run_leaves_a_readable_prefix(recorded, tmp_path):
    family, model, prompts, trace, _ = recorded
    stack = install(model, case_spec({}))
    stack.writer = TraceWriter(tmp_path / "t", stack.geom, stack.scoring, stack.store, 1)
    with torch.no_grad(), stack:
        model(prompts[0])
        model(prompts[1])
    # a pass cut off mid-way: its rows reach the data files but never the pass table
    stack.writer.begin_pass("prefill", 5, 5)
    stack.writer._rows["index"].append(np.zeros((5, trace.index.shape[1]), dtype=np.uint8))
    stack.writer.files["index"].write(b"\x01" * 7)
    stack.writer.files["index"].flush()
    t = read_trace(tmp_path / "t")
    assert len(t.passes) == 2 and t.passes[:, 1].tolist() == [20, 20]
    assert run_replay(t, case_spec({})).results()["timing"]["passes"] == 2


def test_replay_rejects_what_the_trace_cannot_answer(recorded, tmp_path):
    family, model, prompts, trace, _ = recorded
    with pytest.raises(ConfigError, match="lookahead.*3 layer.*records 2"):
        check(trace, case_spec(dict(prefetch={"name": "lookahead", "depth": 3})))
    with pytest.raises(ConfigError, match="int8.*stores only native"):
        check(trace, case_spec(dict(miss="fetch_priority")))
    with pytest.raises(ConfigError, match="belady needs the future"):
        install(model, case_spec(dict(eviction="belady")))


# ---- Belady and the oracle prefetch on hand-made traces ---------------------------------------------------
def flat_trace(requests, num_experts=None, layers=1, k=1) -> Trace:
    """One token per pass; ``requests`` [passes][layers] lists of k experts."""
    E = num_experts or (max(max(max(r) for r in p) for p in requests) + 1)
    idx = np.asarray(requests, dtype=np.uint8).reshape(-1, k)
    passes = np.array([[0 if i == 0 else 1, 1, i + 1] for i in range(len(requests))], dtype=np.int64)
    geom = Geometry(num_layers=layers, num_experts=E, top_k=k, expert_bytes=100, total_bytes=100 * E * layers)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="fp32", source={"format": "test"})
    logits = np.random.default_rng(len(idx)).normal(size=(len(idx), E)).astype(np.float32)  # for score eviction
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, layers), index=idx, logits=logits)


def replay_hits(trace, eviction, slots, prefetch="none", scope="global"):
    spec = spec_of(eviction=eviction, prefetch=prefetch,
                        hardware=HardwareConfig(experts_per_layer=slots, scope=scope, bandwidth_gbps=1e3))
    return run_replay(trace, spec).cache.stats


def zipf(n, universe, seed, s=1.1):
    rng = random.Random(seed)
    w = [1.0 / (i + 1) ** s for i in range(universe)]
    return rng.choices(range(universe), w, k=n)


@pytest.mark.parametrize("seed,cap", [(0, 4), (1, 8), (2, 16)])
def test_belady_equals_libcachesim_on_flat_traces(seed, cap):
    libcachesim = pytest.importorskip("libcachesim")
    reqs = zipf(3000, 40, seed)
    ours = replay_hits(flat_trace([[[e]] for e in reqs], 40), "belady", cap).total("hits")
    nxt, last = [0] * len(reqs), {}
    for i in range(len(reqs) - 1, -1, -1):
        nxt[i] = last.get(reqs[i], np.iinfo(np.int64).max)
        last[reqs[i]] = i
    cache = libcachesim.Belady(cache_size=cap)
    theirs = 0
    for i, e in enumerate(reqs):
        req = libcachesim.Request()
        req.obj_id, req.obj_size, req.next_access_vtime = e + 1, 1, nxt[i]
        theirs += bool(cache.get(req))
    assert ours == theirs


def test_belady_hand_worked():
    # capacity 2: 0 1 2 0 1 -> at 2, evict the one needed last (1, next at t4) -> 0 hits at t3, then 1 misses
    st = replay_hits(flat_trace([[[e]] for e in (0, 1, 2, 0, 1)]), "belady", 2)
    assert (st.total("hits"), st.total("misses")) == (1, 4)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=hs.data())
def test_no_policy_beats_belady(data):
    layers, E = 4, 6  # 4 MoE layers: the shipped ml weights
    n = data.draw(hs.integers(2, 25))
    reqs = [[data.draw(hs.lists(hs.integers(0, E - 1), min_size=2, max_size=2, unique=True)) for _ in range(layers)]
            for _ in range(n)]
    trace = flat_trace(reqs, E, layers, k=2)
    slots = data.draw(hs.integers(2, 6))
    scope = data.draw(hs.sampled_from(["global", "per_layer"]))
    best = replay_hits(trace, "belady", slots, scope=scope).total("hits")
    for name in EVICTION.names():
        assert replay_hits(trace, name, slots, scope=scope).total("hits") <= best, name


def test_oracle_prefetch_has_perfect_prediction():
    reqs = [[[0], [1]], [[2], [3]], [[0], [3]]]
    st = replay_hits(flat_trace(reqs, 4, 2), "lru", 4, prefetch="oracle")
    s = st.summary()
    assert s["prefetch_precision"] == 1.0 and s["prefetch_recall"] == 1.0
    assert s["prefetch_issued"] == 2  # layer 1's 1 and 3 (3 is resident for the last pass)
    # layer 0: 0, 2 miss, 0 hits; layer 1: both prefetches requested before they arrive (compute takes no time)
    assert list(st.misses) == [2, 2] and list(st.prefetch_late) == [0, 2] and list(st.hits) == [1, 1]


def test_oracle_and_belady_are_rejected_live_before_the_model_loads():
    from tests.system.test_configs import compose_run

    for override in ("eviction=belady", "prefetch=oracle"):
        with pytest.raises(ConfigError, match="needs the future.*replay.trace"):
            compose_run([override])


def test_miss_ratio_curves(recorded, tmp_path):
    import csv

    from specmd.commands.mrc import main

    family, model, prompts, trace, _ = recorded
    assert main([f"replay.trace={trace.path}", "eviction=[lru,belady]", "mrc.capacities=[0.1,0.5]",
                 f"mrc.out={tmp_path}", "prefetch=none"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "mrc.csv")))
    assert [(r["policy"], float(r["capacity"])) for r in rows] == [("lru", 0.1), ("lru", 0.5), ("belady", 0.1),
                                                                     ("belady", 0.5)]
    hit = {(r["policy"], r["capacity"]): float(r["hit_rate"]) for r in rows}
    assert hit["belady", "0.1"] >= hit["lru", "0.1"] and hit["belady", "0.5"] >= hit["lru", "0.5"]
    assert hit["lru", "0.5"] >= hit["lru", "0.1"]
    assert (tmp_path / "mrc.png").stat().st_size > 1000


def test_mrc_rows_do_not_depend_on_jobs_and_bad_jobs_are_rejected(recorded, tmp_path, capsys):
    """specmd mrc replays its points on mrc.jobs forked processes over one decoded trace: the CSV is the
    same text as the one-process run's (point order included, score's torch ops and belady's future too)."""
    from specmd.commands.mrc import main

    family, model, prompts, trace, _ = recorded
    common = [f"replay.trace={trace.path}", "eviction=[score,lru,belady]", "mrc.capacities=[0.05,0.1,0.5]",
              "prefetch=topk"]
    for jobs in (1, 2):
        assert main([*common, f"mrc.out={tmp_path / str(jobs)}", f"mrc.jobs={jobs}"]) == 0
    assert (tmp_path / "1" / "mrc.csv").read_text() == (tmp_path / "2" / "mrc.csv").read_text()
    capsys.readouterr()
    for bad in ("0", "-2", "two", "1.5"):
        assert guarded("specmd mrc", main, [*common, f"mrc.out={tmp_path / 'x'}", f"mrc.jobs={bad}"]) == 2
        err = capsys.readouterr().err
        assert f"mrc.jobs={bad!r} must be a positive integer" in err, err
    assert not (tmp_path / "x").exists()


def test_replay_many_equals_one_by_one_replays(recorded):
    """replay_many's results are run_replay(trace, spec).results() of each spec, in order, for any jobs;
    a spec the trace cannot replay fails the study before any replay."""
    import json

    from specmd.pool import check_jobs, replay_many

    family, model, prompts, trace, _ = recorded
    specs = [spec_of(eviction=e, prefetch=p, hardware=HardwareConfig(capacity=c))
             for e, p, c in (("lru", "none", 0.1), ("ml", "topk", 0.2), ("least_stale", "score", 0.05),
                             ("belady", "oracle", 0.3), ("lecar", "none", 0.15))]
    if family != "olmoe":  # eviction=ml's shipped networks are tiny-olmoe's
        specs.pop(1)
    alone = [json.dumps(run_replay(trace, s).results(), sort_keys=True) for s in specs]
    for jobs in (1, 2, 3):
        assert [json.dumps(r, sort_keys=True) for r in replay_many(trace, specs, jobs)] == alone
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"jobs={bad!r} must be a positive integer"):
            check_jobs(bad)


def test_imported_jsonl_replays_with_every_eviction_policy(tmp_path):
    """A routing capture of another engine (JSON Lines, ids + weights, no logits) through the CLI path."""
    import json

    from hydra import compose, initialize_config_dir

    from specmd.app import execute
    from tests.system.test_configs import CONF

    rng = random.Random(0)
    path = tmp_path / "routes.jsonl"
    with open(path, "w") as f:
        for seq in range(3):
            for tok in range(12):
                for layer in range(4):
                    ids = rng.sample(range(16), 2) if rng.random() < 0.5 else [layer, (tok + layer) % 16 if (tok + layer) % 16 != layer else 15]
                    f.write(json.dumps({"seq": seq, "token": tok, "layer": layer, "experts": ids,
                                        "weights": [0.7, 0.3]}) + "\n")
    # model=tiny: eviction=ml's default networks are the model's own, and tiny's have this trace's 4 layers
    base = [f"replay.trace={path}", "replay.format=jsonl", "replay.num_experts=16", "prefetch=none",
            "hardware.experts_per_layer=3", "model=tiny"]
    hits = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name in EVICTION.names():
            res = execute(compose(config_name="config", overrides=[*base, f"eviction={name}"]), run_dir=tmp_path / name)
            assert (tmp_path / name / "results.json").is_file()
            assert res["replay"]["format"] == "jsonl" and res["replay"]["exact"] is False
            assert res["replay"]["passes"] == 36 and res["cache"]["requests"] == 36 * 4 * 2
            hits[name] = res["cache"]["hits"]
        named = [*base, "prefetch=topk"]  # a prefetcher the user names (the CLI passes its overrides): refused
        with pytest.raises(ConfigError, match="prefetch=topk.*records 0"):
            execute(compose(config_name="config", overrides=named), run_dir=tmp_path / "topk", overrides=named)
    assert all(h <= hits["belady"] for h in hits.values()), hits
    assert hits["belady"] > hits["fifo"]


def test_bad_traces_get_clear_errors(recorded, tmp_path):
    import json
    import shutil

    family, model, prompts, trace, _ = recorded
    src = Path(trace.path)
    empty = tmp_path / "empty"
    shutil.copytree(src, empty)
    (empty / "passes.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="no complete forward pass"):
        read_trace(empty)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    meta = json.loads((broken / "meta.json").read_text())
    del meta["geometry"]
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="geometry is missing"):
        read_trace(broken)
    with pytest.raises(ConfigError, match="not a specmd trace directory"):
        read_trace(tmp_path)
    # a trace without logits cannot feed a routing policy that reads them
    t = read_trace(src)
    t.logits, t.meta = None, dataclasses.replace(t.meta, logits="none")
    with pytest.raises(ConfigError, match="no router logits.*max_rank"):
        run_replay(t, case_spec(dict(routing="max_rank", prefetch="none")))


def test_a_trace_recorded_under_a_lossy_stack_is_not_exact(recorded):
    family, model, prompts, trace, _ = recorded
    t = read_trace(trace.path)
    t.meta = dataclasses.replace(t.meta, source={"stack": {"miss": "drop"}, "exact": False})
    assert "changed what the model computed" in " ".join(exactness(t, case_spec({})))


def test_import_takes_its_geometry_from_a_model_config(tmp_path):
    from specmd.replay.config import ReplayConfig, open_trace

    rng = np.random.default_rng(0)
    path = tmp_path / "routes.npy"
    np.save(path, np.stack([rng.permutation(64)[:8] for _ in range(5 * 4)]).reshape(5, 4, 8))
    trace = open_trace(ReplayConfig(trace=str(path), format="npy", model="tiny"))
    g = trace.meta.geometry
    assert (g.num_experts, g.expert_bytes, g.total_bytes) == (64, 147456, 46416896)  # the embedded model
    assert g.dense_params[0] > 0 and trace.meta.store.bytes_of == {"native": 147456}
    res = run_replay(trace, case_spec(dict(prefetch="none", capacity=0.25))).results()
    assert res["timing"]["total_s"] > res["timing"]["stall_s"] > 0  # dense compute is modelled
    with pytest.raises(ConfigError, match=r"replay.model=tiny_mixtral.*\(4, 8, 2\).*\(4, 64, 8\)"):
        open_trace(ReplayConfig(trace=str(path), format="npy", model="tiny_mixtral", num_experts=64))
    with pytest.raises(ConfigError, match="replay.model='nope'.*valid choices"):
        open_trace(ReplayConfig(trace=str(path), format="npy", model="nope"))


def test_reuse_by_rank_hand_worked():
    """One layer, E = 3, k = 1. Passes: prefill, decode x3, prefill, decode x2. Logits rank the experts
    per decode step; the top-1 (selected) sequence per generation is [0, 1, 0] then [2, 2].
    Horizon 1, generation 1: step 0 ranks (0, 1, 2) -> next selects 1: rank0 no, rank1 yes, rank2 no;
    step 1 ranks (1, 2, 0) -> next selects 0: rank2 yes. Generation 2: step 0 ranks (2, 0, 1) -> next
    selects 2: rank0 yes. The last step of each generation has no successor; the first step of
    generation 2 is not paired with generation 1's last. So 3 samples: P(rank0) = 1/3, rank1 1/3, rank2 1/3."""
    from specmd.replay.analysis import reuse_by_rank
    from specmd.replay.trace import Trace, full_calls

    passes = np.array([[0, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 4], [0, 1, 1], [1, 1, 2], [1, 1, 3]])
    ranks = {1: [0, 1, 2], 2: [1, 2, 0], 3: [0, 2, 1], 5: [2, 0, 1], 6: [2, 1, 0]}
    logits = np.zeros((7, 3), dtype=np.float32)
    for row, order in ranks.items():
        logits[row, order] = [3.0, 2.0, 1.0]
    idx = logits.argmax(axis=1)[:, None].astype(np.int64)
    geom = Geometry(num_layers=1, num_experts=3, top_k=1, expert_bytes=100, total_bytes=300, layer_ids=[0])
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="fp32", source={"format": "test"})
    trace = Trace(meta=meta, passes=passes, calls=full_calls(passes, 1), index=idx, logits=logits)
    out = reuse_by_rank(trace, 1)
    assert out["samples"] == 3
    assert out["probability"] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    # horizon 2: only generation 1's step 0 has two successors (1, 0): ranks (0, 1, 2) -> 0 yes, 1 yes, 2 no
    out = reuse_by_rank(trace, 2)
    assert out["samples"] == 1 and out["probability"] == [1.0, 1.0, 0.0]


def test_recorded_trace_key_changes_with_what_decides_routing_only():
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import Run
    from specmd.recorder import recording_config, trace_key

    conf = CONF_DIR

    def key(*overrides):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            run = Run(compose(config_name="config", overrides=["model=tiny", "replay.trace=record", *overrides]))
        cfg = recording_config(run.raw)
        assert cfg["eviction"] == {"name": "lru"} and cfg["trace"]["save"] and cfg["replay"]["trace"] is None
        return trace_key(run, cfg)

    base = key()
    # the stack and the device's figures do not change which experts the model routes to: one recording
    assert key("eviction=belady", "prefetch=score", "hardware.capacity=0.25", "hardware=rtx4090") == base
    # what the model computes or reads does: a new recording each
    for change in ("eval.limit=3", "eval.tasks=[wikitext]", "trace.depth=2", "model.seed=1", "trace.logits=fp16"):
        assert key(change) != base, change


# what an experiment's stack needs changed to run on a 32-layer, 8-expert import (Mixtral's geometry)
ON_MIXTRAL = {"flashmoe_fig6": ["eviction=lru"],  # eviction=ml needs networks of a 32-layer model: eviction.weights=FILE
              "cce_fig10": ["hardware.experts_per_layer=4"]}


@pytest.mark.parametrize("experiment", replayed_experiments())
def test_replay_experiments_take_an_imported_trace(tmp_path, experiment):
    """A user's routing capture reproduces a paper's figure in one line: +experiment=E replay.trace=FILE
    replay.format=jsonl replay.model=mixtral (the geometry comes from Mixtral's shipped config: no hub). Every
    replayed experiment (``replay.trace: record``): those whose stack reads what an import lacks (a prefetch
    signal, router logits) say so and name the way out."""
    import json

    from hydra import compose, initialize_config_dir

    from specmd.app import Run, execute
    from specmd.models.loader import shipped_geometry
    from tests.system.test_configs import CONF

    rng = random.Random(3)
    path = tmp_path / "routes.jsonl"
    with open(path, "w") as f:
        for tok in range(6):
            for layer in range(32):
                f.write(json.dumps({"token": tok, "layer": layer, "experts": rng.sample(range(8), 2)}) + "\n")
    over = [f"+experiment={experiment}", f"replay.trace={path}", "replay.format=jsonl", "replay.model=mixtral"]
    over += ON_MIXTRAL.get(experiment, [])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    run = Run(cfg)
    pcls, pparams = run.spec.prefetch
    if pcls.signal_depth(pparams) or run.replay.reuse_horizon:  # an import has no signal and no logits
        with pytest.raises(ConfigError, match=r"an imported trace has no prefetch signal|needs router logits"):
            execute(cfg, run_dir=tmp_path / "run")
        return
    res = execute(cfg, run_dir=tmp_path / "run")
    assert res["replay"]["format"] == "jsonl"
    if run.replay.speculative_tokens:  # verify steps: the 5 decode tokens in fewer passes, every one accepted once
        assert res["replay"]["passes"] < 6 and res["speculative"]["accepted_tokens"] == 5
        return
    assert res["replay"]["passes"] == 6
    decode_only = run.measure == "decode"  # stack.measure=decode: the first token is the prefill
    assert res["cache"]["requests"] == (5 if decode_only else 6) * 32 * 2
    geom = shipped_geometry("mixtral")
    assert res["cache"]["capacity_bytes"] > 0 and geom.expert_bytes > 100e6  # Mixtral's expert size, not 1 byte


def test_future_next_use_equals_a_scan_for_calls_in_any_order():
    """The future keeps a cursor per key (a replay asks with calls that never decrease); a call asked out of
    order is answered by bisection: every answer equals a scan of the recorded requests."""
    import random

    import numpy as np

    from specmd.replay.future import NEVER, Future

    rng = random.Random(3)
    L, E, C = 2, 6, 200
    layers = np.array([c % L for c in range(C)], dtype=np.int64)
    per_call = [sorted(rng.sample(range(E), rng.randrange(0, 4))) for _ in range(C)]
    ptr = np.cumsum([0] + [len(x) for x in per_call]).astype(np.int64)
    fut = Future(layers, ptr, np.array([e for x in per_call for e in x], dtype=np.int64), E)

    def scan(key, call):
        return next((c for c in range(call + 1, C) if layers[c] == key // E and key % E in per_call[c]), NEVER)

    calls = sorted(rng.randrange(-1, C) for _ in range(300))  # a replay's order, then any order
    calls += [rng.randrange(-1, C) for _ in range(300)]
    for call in calls:
        key = rng.randrange(L * E + 2)
        assert fut.next_use(key, call) == scan(key, call), (key, call)


def test_a_replay_with_a_request_table_of_the_wrong_size_is_an_error():
    """The compiled loop reads the per-call request offsets unchecked: a table that does not match the calls
    is refused before the loop (in both builds)."""
    from specmd.replay.driver import build_engine, run_replay

    from specmd.hardware import HardwareConfig

    trace = flat_trace([0, 1, 2, 1, 0], num_experts=4)
    spec = spec_of(prefetch="none", hardware=HardwareConfig(capacity=0.5))  # 5% of 4 experts holds none
    engine, ptr, experts = build_engine(trace, spec)
    with pytest.raises(ValueError, match="request offsets"):
        run_replay(trace, spec, engine, ptr[:-2], experts)


def test_probs_table_rows_are_each_calls_own_softmax():
    """A replay's router probabilities, computed a chunk of rows at a time (ProbsTable), have the bits of each
    call's own ``scoring.probs(logits)``: across chunk boundaries, for a call longer than a chunk, and for a
    width the vector kernels do not divide (37 experts). A sigmoid router gets no table."""
    from specmd.engine.record import Scoring
    from specmd.replay.driver import ProbsTable, probs_table

    rng = np.random.default_rng(0)
    lengths = [1, 3, 1, 20, 1, 1, 7, 1, 2, 40, 1]
    logits = (rng.standard_normal((sum(lengths), 37)) * 4).astype(np.float32)
    trace = Trace(meta=None, passes=None, calls=None, index=None, logits=logits)
    scoring = Scoring(False, False, 1.0)
    table = ProbsTable(trace, scoring, chunk=16)
    r0 = 0
    for n in lengths:
        want = scoring.probs(torch.from_numpy(logits[r0:r0 + n])).numpy()
        got = table.rows(r0, n)
        assert got.shape == (n, 37) and got.dtype == np.float32 and np.array_equal(got, want), (r0, n)
        r0 += n
    assert probs_table(trace, Scoring(True, False, 1.0)) is None and probs_table(trace, scoring) is not None
    assert probs_table(dataclasses.replace(trace, logits=None), scoring) is None
