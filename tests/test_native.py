"""The compiled engine (specmd/native.py, setup.py): built by the install, loaded unless pure Python is asked
for, never shadowing an edited source, and equal to its pure-Python sources result for result.

Equality runs the same jobs here and in a subprocess with ``SPECMD_PURE_PYTHON=1`` (tests/native_worker.py)
and compares the results.json sections as text: every stack of the replay-equality tests on recorded
traces, lossy stacks on the same traces, and hypothesis-generated traces (derandomised, conftest).
"""

import dataclasses
import importlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tests import native_worker
from tests.conftest import ROOT, sample_ids, tiny
from specmd import native
from specmd.engine import Geometry
from specmd.engine.store import StoreSizes
from specmd.policies.eviction import EVICTION
from specmd.replay.trace import Trace, TraceMeta, full_calls, read_trace
from tests.replay.test_replay import CASES, case_spec, live

FORCED = os.environ.get(native.ENV, "").strip() not in ("", "0")
WORKER = Path(__file__).with_name("native_worker.py")


def pure_results(jobs, tmp_path: Path) -> list[str]:
    """The worker's results for ``jobs`` in a subprocess running the engine's pure-Python sources."""
    src, dst = tmp_path / "jobs.pkl", tmp_path / "out.pkl"
    src.write_bytes(pickle.dumps(jobs))
    env = {**os.environ, native.ENV: "1"}
    out = subprocess.run([sys.executable, str(WORKER), str(src), str(dst)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RuntimeWarning" not in out.stderr, out.stderr  # chosen pure Python: no warning
    got = pickle.loads(dst.read_bytes())
    assert got["engine"] == "pure"
    return got["results"]


def assert_same(jobs, tmp_path):
    compiled = native_worker.run(jobs)
    pure = pure_results(jobs, tmp_path)
    for (trace, case), c, p in zip(jobs, compiled, pure):
        assert c == p, f"compiled != pure for {case} on {trace.path}:\n{c}\n{p}"


# ---- which copy is loaded ----------------------------------------------------------------------------
@pytest.mark.skipif(FORCED, reason=f"{native.ENV}=1 asks for the sources")
def test_the_install_built_and_loads_every_compiled_module():
    """`pip install -e .` (the README's command) compiled every listed module, and this process loads the
    extensions: a failed or skipped build fails here, not silently in a benchmark."""
    assert native.summary() == {"engine": "compiled"}, native.summary()
    for src in native.sources():
        name = native.module_name(src)
        importlib.import_module(name)
        assert native.loaded(name) == "compiled", name


def test_results_say_which_engine_ran():
    from specmd.provenance import provenance

    assert provenance()["engine"] == native.summary()
    assert native.summary()["engine"] == ("pure" if FORCED else "compiled")


@pytest.mark.skipif(not FORCED, reason=f"runs under {native.ENV}=1 (test_pure_python_engine_tests)")
def test_forced_pure_loads_every_source():
    assert native.summary()["engine"] == "pure"
    for src in native.sources():
        name = native.module_name(src)
        importlib.import_module(name)
        assert native.loaded(name) == "pure", name


def _select(pkg: Path):
    """Run native.select on a copy of the package in a fresh module; return (module, warnings)."""
    spec = importlib.util.spec_from_file_location("native_under_test", ROOT / "specmd" / "native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = list(sys.meta_path)
    env = os.environ.pop(native.ENV, None)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mod.select(pkg)
    finally:
        sys.meta_path[:] = before  # the finder it installed serves the copy's names: not this process's
        if env is not None:
            os.environ[native.ENV] = env
    return mod, [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]


def _package_copy(tmp_path: Path, with_build: bool) -> Path:
    pkg = tmp_path / "specmd"
    for src in native.sources():
        (pkg / src).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "specmd" / src, pkg / src)
        pxd = (ROOT / "specmd" / src).with_suffix(".pxd")
        if pxd.is_file():
            shutil.copy(pxd, (pkg / src).with_suffix(".pxd"))
        ext = native.extension_of(src)
        if with_build and ext is not None:
            shutil.copy(ext, pkg / src.rsplit("/", 1)[0] / ext.name)
    if with_build:
        shutil.copy(ROOT / "specmd" / native.MANIFEST, pkg / native.MANIFEST)
    return pkg


def test_no_build_runs_pure_python_with_one_warning(tmp_path):
    mod, warned = _select(_package_copy(tmp_path, with_build=False))
    assert set(mod.STATE.values()) == {"pure"} and mod.summary()["engine"] == "pure"
    assert len(warned) == 1 and "runs its engine and policies as pure Python" in warned[0] and "not built" in warned[0]
    assert "pip install -e ." in warned[0] and native.ENV in warned[0]


@pytest.mark.skipif(FORCED, reason="needs the built extensions")
def test_an_edited_source_is_never_shadowed_by_its_old_extension(tmp_path):
    pkg = _package_copy(tmp_path, with_build=True)
    mod, warned = _select(pkg)
    assert warned == [] and set(mod.STATE.values()) == {"compiled"}

    src = "policies/eviction/lru.py"
    (pkg / src).write_text((pkg / src).read_text() + "\n# edited\n")
    mod, warned = _select(pkg)
    assert mod.STATE[native.module_name(src)] == "pure"
    assert [n for n, v in mod.STATE.items() if v == "pure"] == [native.module_name(src)]
    assert len(warned) == 1 and "older than their sources: policies/eviction/lru.py" in warned[0]
    assert "1 of its" in warned[0]
    assert mod.summary() == {"engine": "mixed", "pure_modules": [native.module_name(src)],
                             "why_pure": "older than their sources: policies/eviction/lru.py"}
    # the finder it installs serves the edited source ahead of the stale extension
    finder = mod._Sources({native.module_name(src): pkg / src})
    assert finder.find_spec(native.module_name(src)).origin == str(pkg / src)


def test_every_counter_is_a_declared_field():
    """A per-layer counter added to stats.PER_LAYER but not to stats.pxd would land in the instance dict
    of the compiled CacheStats: correct, but a dict lookup per update on the request path."""
    import re

    from specmd.engine.stats import PER_LAYER, PER_PRECISION, SCALARS

    pxd = (ROOT / "specmd/engine/stats.pxd").read_text()
    declared = set(re.findall(r"cdef public .* (\w+)\s*$", pxd, re.M))
    fields = set(PER_LAYER) | set(SCALARS) | set(PER_PRECISION)
    assert fields <= declared, sorted(fields - declared)


@pytest.mark.skipif(FORCED, reason="needs the built extensions")
def test_a_module_built_against_a_stale_one_runs_its_source_too(tmp_path):
    """cache.pxd cimports clock's and stats' declarations and engine.pxd cimports cache's: a compiled cache
    beside a pure clock would not load (its C calls expect the compiled clock), so it runs as source too, and
    so does the engine; an edited .pxd makes its own module stale."""
    assert set(native.cimports("engine/cache.py")) == {"engine/call.py", "engine/clock.py", "engine/hooks.py",
                                                      "engine/residency.py", "engine/stats.py"}
    assert "engine/cache.py" in native.cimports("engine/engine.py")
    assert native.cimports("policies/eviction/lru.py") == ["policies/eviction/fifo.py"]
    pkg = _package_copy(tmp_path, with_build=True)
    src = "engine/clock.py"
    (pkg / src).write_text((pkg / src).read_text() + "\n# edited\n")
    mod, warned = _select(pkg)
    pure = {n for n, v in mod.STATE.items() if v == "pure"}
    assert {"specmd.engine.clock", "specmd.engine.cache", "specmd.engine.engine"} <= pure
    assert "specmd.engine.stats" not in pure and "specmd.policies.eviction.lru" not in pure
    assert len(warned) == 1 and "older than their sources: engine/clock.py" in warned[0]
    assert "built against those: " in warned[0] and "engine/cache.py" in warned[0]

    # the cache manager extends the residency (reading its private per-key arrays): they run as source together;
    # an eviction policy extends its base's public fields only, and the residency an interface without fields
    assert native.extends("engine/cache.py") == ["engine/residency.py"]
    assert native.extends("policies/eviction/lru.py") == [] and native.extends("engine/residency.py") == []
    pkg = _package_copy(tmp_path / "cache", with_build=True)
    src = "engine/cache.py"
    (pkg / src).write_text((pkg / src).read_text() + "\n# edited\n")
    mod, warned = _select(pkg)
    pure = {n for n, v in mod.STATE.items() if v == "pure"}
    assert {"specmd.engine.cache", "specmd.engine.residency", "specmd.engine.call", "specmd.engine.engine"} <= pure
    assert "specmd.engine.stats" not in pure and "specmd.engine.simclock" not in pure

    pkg = _package_copy(tmp_path / "pxd", with_build=True)
    (pkg / "engine/stats.pxd").write_text((pkg / "engine/stats.pxd").read_text() + "\n# edited\n")
    mod, warned = _select(pkg)
    assert mod.STATE["specmd.engine.stats"] == "pure" and mod.STATE["specmd.engine.cache"] == "pure"
    assert "older than their sources: engine/stats.py" in warned[0]

    # the eviction hooks: the manager and the policies compiled as extension types are built against them
    pkg = _package_copy(tmp_path / "hooks", with_build=True)
    (pkg / "engine/hooks.py").write_text((pkg / "engine/hooks.py").read_text() + "\n# edited\n")
    mod, warned = _select(pkg)
    pure = {n for n, v in mod.STATE.items() if v == "pure"}
    assert {"specmd.engine.hooks", "specmd.engine.cache", "specmd.engine.engine", "specmd.policies.eviction.base",
            "specmd.policies.eviction.fifo", "specmd.policies.eviction.lru"} <= pure
    eviction = [p.stem for p in (pkg / "policies/eviction").glob("*.py") if p.stem not in ("__init__", "base")]
    assert all((pkg / f"policies/eviction/{p}.pxd").exists() for p in eviction)  # every built-in: an extension type
    assert all(mod.STATE[f"specmd.policies.eviction.{p}"] == "pure" for p in eviction)  # built against base's
    # ... while a module that only imports the engine at run time (Python classes on its bases) stays compiled
    assert mod.STATE["specmd.policies.prefetch.topk"] == "compiled" and mod.STATE["specmd.policies.miss.fetch"] == "compiled"


@pytest.mark.skipif(FORCED, reason="needs the built extensions")
def test_a_policy_file_added_after_the_build_is_plain_python_without_a_warning(tmp_path):
    pkg = _package_copy(tmp_path, with_build=True)
    (pkg / "policies/eviction/mine.py").write_text("# a user's policy\n")
    mod, warned = _select(pkg)
    assert warned == [] and mod.STATE["specmd.policies.eviction.mine"] == "pure"
    # ... but a module whose compile failed is reported
    manifest = json.loads((pkg / native.MANIFEST).read_text())
    del manifest["built"]["engine/clock.py"]
    manifest["failed"].append("engine/clock.py")
    (pkg / native.MANIFEST).write_text(json.dumps(manifest))
    mod, warned = _select(pkg)
    assert mod.STATE["specmd.engine.clock"] == "pure" and len(warned) == 1
    assert "not built: engine/clock.py" in warned[0]


# The engine's, the policies' and the replay's own tests, run again on the pure-Python sources (CI runs the
# README's two commands only, so the second run is this test's subprocess).
PURE_SUITE = ["engine/test_semantics.py", "engine/test_cache_manager.py", "engine/test_clock.py",
              "policies/test_eviction.py", "policies/test_prefetch.py", "policies/test_policies.py",
              "replay/test_replay.py", "engine/test_capacity.py", "system/test_golden.py", "hook/test_lossless.py",
              "quant/test_quant_cache.py", "test_native.py",
              # the offload executor is the same Python either way: the pure engine's residency events driving it,
              # native and low-precision (the rest of test_offload.py, 40 s here, re-runs that executor)
              "executor/test_offload.py::test_deep_olmoe_ram_and_disk_equal_simulated",
              "executor/test_offload.py::test_low_precision_offload_equals_simulated",
              # layer streaming's hand-worked counts and clock (the streamed call's C path, as source)
              "engine/test_stream.py::test_a_streamed_pass_by_hand",
              "engine/test_stream.py::test_the_stage_ahead_overlaps_the_layer_before",
              "engine/test_stream.py::test_only_calls_at_the_threshold_stream",
              # the selection rule's hand-worked cases (record.py's Scoring, the ranking policies, as source)
              "policies/test_selection.py::test_max_rank_promotes_within_the_selection_ranks_hand_worked",
              "policies/test_selection.py::test_a_group_limit_is_never_crossed_hand_worked",
              "policies/test_selection.py::test_miss_policies_rank_misses_by_the_selection_score_hand_worked",
              "policies/test_selection.py::test_the_rule_round_trips_through_a_trace_meta_and_bad_rules_are_refused",
              "policies/test_selection.py::test_a_left_out_group_scores_what_the_family_fills_hand_worked",
              "policies/test_selection.py::test_probabilities_given_and_a_per_expert_weight_scale_hand_worked"]


# Tests of a process's behaviour, not of the compiled modules' arithmetic (two processes quantizing under one
# lock, a CLI run failing at load, a run's peak RSS): the same Python runs either way, so the pure run leaves
# them out (17 s of its 166). And those that take the pure run's most time for no path of their own: the
# perplexity through lm-eval (126 s of 645 on a loaded machine; the hook's pure path is the hooked-logits
# tests', the scoring is lm-eval's) and LRU's monotone hit rate over capacities (54 s; the pure engine's
# every eviction decision is compared with the compiled one's on generated traces below).
PURE_SKIP = ["tests/quant/test_quant_cache.py::test_concurrent_processes_quantize_once",
             "tests/executor/test_offload.py::test_truncated_checkpoint_fails_the_cli_run_at_load",
             "tests/executor/test_offload.py::test_peak_rss_is_the_runs_own_not_its_launchers",
             "tests/hook/test_lossless.py::test_perplexity_equal_through_lm_eval",
             "tests/engine/test_capacity.py::test_lru_hit_rate_non_decreasing_in_capacity",
             # replay == live per stack, both sides pure (25 s): the pure replay is compared with the compiled one on
             # these very stacks (test_compiled_equals_pure_on_every_replay_equality_stack) and the compiled replay
             # with the compiled live run (the main run); the pure live driver keeps the lossless tests
             "tests/replay/test_replay.py::test_replay_equals_live",
             # orchestration over replays whose every decision the compiled == pure tests compare (40 s pure): the
             # pool's and specmd mrc's jobs (forked workers, the same Python either way), eviction=ml's training (a
             # second process replaying its held-out routing), and the Belady bound over every policy (the pure
             # policies' decisions equal the compiled ones' on 120 generated traces, which the main run bounds)
             "tests/replay/test_replay.py::test_replay_many_equals_one_by_one_replays",
             "tests/replay/test_replay.py::test_mrc_rows_do_not_depend_on_jobs_and_bad_jobs_are_rejected",
             "tests/replay/test_replay.py::test_no_policy_beats_belady",
             "tests/policies/test_eviction.py::test_train_eviction_steps_are_layer_calls_and_holdout_rates_are_a_replays"]


@pytest.mark.skipif(FORCED, reason="this is the pure run")
def test_engine_policy_and_replay_tests_pass_on_the_pure_sources():
    env = {**os.environ, native.ENV: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *(f"tests/{t}" for t in PURE_SUITE), *(f"--deselect={t}" for t in PURE_SKIP)], cwd=ROOT,
                         env=env, capture_output=True, text=True,
                         timeout=3600)  # 42 s here: 80x, for a loaded machine
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1] and "RuntimeWarning" not in out.stdout, out.stdout[-2000:]


# ---- compiled == pure -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A recorded trace per family (prefill + decode, prefetch signal 2 layers deep, fp32 logits)."""
    out = []
    for family in ("olmoe", "mixtral"):
        path = tmp_path_factory.mktemp(f"native_{family}") / "trace"
        live(tiny(family), case_spec(CASES[0]), [sample_ids(batch=1, seq=20, seed=s) for s in (0, 1)], path)
        out.append(read_trace(path))
    return out


def quantized(trace: Trace) -> Trace:
    """``trace`` with int8/int4/int2 copies in its store (a replay needs their sizes only)."""
    store, eb = trace.meta.store, trace.meta.geometry.expert_bytes
    sizes = StoreSizes(store.native_bits, eb, {"int8": eb // 2, "int4": eb // 4, "int2": eb // 8})
    return dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, store=sizes), path=trace.path + "+quant")


LOSSY = [dict(miss="drop", capacity=0.1), dict(miss="substitute", capacity=0.2, prefetch="score"),
         dict(routing="max_rank", capacity=0.2), dict(routing="cache_prior", capacity=0.3, scope="per_layer"),
         dict(routing="prune", capacity=0.2),
         dict(eviction="belady", capacity=0.2), dict(prefetch="oracle", eviction="belady", capacity=0.3),
         dict(prefetch="oracle", capacity=0.15, scope="per_layer")]  # 0.1 per layer holds no tiny Mixtral expert
QUANT = [dict(miss="fetch_priority", capacity=0.15, prefetch="topk"), dict(miss="drop_priority_cascade", capacity=0.1),
         dict(miss="fetch_lowest_bit", capacity=0.1, eviction="lfu"), dict(miss="substitute", capacity=0.1),
         dict(miss="fetch_priority", capacity=0.3, scope="per_layer", eviction="score", prefetch="lookahead")]


@pytest.mark.skipif(FORCED, reason="compares the compiled engine with the sources")
def test_compiled_equals_pure_on_every_replay_equality_stack(traces, tmp_path):
    jobs = [(trace, case) for trace in traces for case in CASES + LOSSY]
    jobs += [(quantized(trace), case) for trace in traces for case in QUANT]
    assert_same(jobs, tmp_path)


def _random_trace(p: dict) -> Trace:
    rng = np.random.default_rng(p["seed"])
    L, E, k = p["layers"], p["experts"], p["k"]
    tokens = [p["prefill"]] + [1] * (p["passes"] - 1)
    passes = np.array([[0 if i == 0 else 1, t, sum(tokens[:i + 1])] for i, t in enumerate(tokens)], dtype=np.int64)
    rows = L * sum(tokens)
    index = np.argsort(rng.random((rows, E)), axis=1)[:, :k].astype(np.uint8)  # k distinct experts per row
    logits = rng.normal(size=(rows, E)).astype(np.float32)
    geom = Geometry(num_layers=L, num_experts=E, top_k=k, expert_bytes=1000, total_bytes=1000 * E * L + 5000,
                    hidden_size=64, dense_params=[300] * L, attn_layers=[1] * L)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 1000, {}), logits="fp32", source={"format": "test"})
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, L), index=index, logits=logits,
                 path=f"hypothesis-{p['seed']}")


JOB = hs.fixed_dictionaries({
    "seed": hs.integers(0, 2**16), "layers": hs.integers(1, 4), "experts": hs.integers(2, 12),
    "k": hs.integers(1, 3), "passes": hs.integers(2, 25), "prefill": hs.integers(1, 6),
    "eviction": hs.sampled_from(sorted(EVICTION.names())), "scope": hs.sampled_from(["global", "per_layer"]),
    "slots": hs.integers(1, 12), "prefetch": hs.sampled_from(["none", "oracle"]),
    "miss": hs.sampled_from(["fetch", "fetch", "cpu_compute", "hybrid", "drop"]),
    "bandwidth_gbps": hs.sampled_from([1e-3, 0.5, 16.0, 1e3]),
})


def _job(p: dict):
    p = dict(p)
    if p["eviction"] == "ml":
        p["layers"] = 4  # the shipped networks' layers (specmd:tiny-olmoe)
    p["k"] = min(p["k"], p["experts"])
    miss = {"name": p["miss"], "J": min(2, p["k"])} if p["miss"] == "drop" else p["miss"]  # J: ranks kept, <= k
    case = dict(eviction=p["eviction"], scope=p["scope"], experts_per_layer=min(p["slots"], p["experts"]),
                prefetch=p["prefetch"], miss=miss, bandwidth_gbps=p["bandwidth_gbps"])
    return _random_trace(p), case


@pytest.mark.skipif(FORCED, reason="compares the compiled engine with the sources")
@settings(max_examples=3, deadline=None)
@given(batch=hs.lists(JOB, min_size=40, max_size=40))
def test_compiled_equals_pure_on_generated_traces(batch, tmp_path_factory):
    """40 generated (trace, stack) jobs per example, one pure-Python subprocess per example."""
    assert_same([_job(p) for p in batch], tmp_path_factory.mktemp("gen"))


# ---- a user's policy: one plain file, registered, in the compiled engine ---------------------------
USER_POLICY = '''
from specmd.policies.eviction.base import EVICTION, OrderedEviction


@EVICTION.register("test_mru")
class MRU(OrderedEviction):
    """Most recently used: the newest evictable key leaves first."""

    def on_access(self, key):
        order = self._order
        del order[key]
        order[key] = None

    def victim(self, evictable):
        for key in reversed(self._order):
            if evictable(key):
                return key
        return None
'''


def test_a_users_policy_file_runs_in_the_compiled_engine(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(USER_POLICY)
    spec = importlib.util.spec_from_file_location("my_policy", path)
    mod = sys.modules["my_policy"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        assert native.loaded("specmd.engine.cache") == ("pure" if FORCED else "compiled")
        assert native.loaded("my_policy") == "pure"
        # one layer, 3 slots, requests 0 1 2 3 0 1 2 3: misses 0 1 2; 3 evicts 2 (newest); hits 0 1;
        # 2 evicts 1 (now newest); hit 3. LRU would miss all eight.
        reqs = [0, 1, 2, 3, 0, 1, 2, 3]
        passes = np.array([[0 if i == 0 else 1, 1, i + 1] for i in range(len(reqs))], dtype=np.int64)
        geom = Geometry(num_layers=1, num_experts=4, top_k=1, expert_bytes=100, total_bytes=400)
        meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="none", source={"format": "test"})
        trace = Trace(meta=meta, passes=passes, calls=full_calls(passes, 1),
                      index=np.asarray(reqs, dtype=np.uint8)[:, None])
        got = native_worker.results(trace, dict(eviction="test_mru", experts_per_layer=3, prefetch="none"))
        cache = json.loads(got)["cache"]
        assert (cache["hits"], cache["misses"], cache["evictions"]) == (3, 5, 2)
    finally:
        EVICTION._classes.pop("test_mru", None)
        sys.modules.pop("my_policy", None)


def test_compiled_policies_hooks_are_called_in_c_and_python_overrides_stay_python():
    """The manager calls a pool's hooks in C only when each is an extension type's own method (LRU, FIFO
    compiled); a Python class overriding any of them (a user's LRU-like subclass) is called through its bound
    Python methods, and gives the same answers. Where the engine runs as source nothing is called in C."""
    from specmd.engine.hooks import compiled_hooks
    from specmd.policies.eviction import EVICTION
    from specmd.policies.eviction.fifo import FIFO
    from specmd.policies.eviction.lru import LRU

    class Tracing(LRU):  # a Python override of one hook
        def on_access(self, key):
            self.seen = getattr(self, "seen", 0) + 1
            LRU.on_access(self, key)

    class Plain(LRU):  # a Python subclass that overrides no hook
        pass

    compiled = not FORCED and native.loaded("specmd.policies.eviction.lru") == "compiled"
    assert compiled_hooks(LRU()) is compiled and compiled_hooks(FIFO()) is compiled
    assert compiled_hooks(Plain()) is compiled
    assert compiled_hooks(Tracing()) is False
    assert compiled_hooks(EVICTION.get("score")()) is compiled  # an extension type of its own
    assert compiled_hooks(EVICTION.get("lhu")()) is compiled  # an extension type on LFU overriding no hook
    # the same requests through each: identical victims
    answers = []
    for pol in (LRU(), Plain(), Tracing()):
        for k in (5, 1, 9, 3):
            pol.on_insert(k, False)
        pol.on_access(1)
        pol.on_access(5)
        pol.on_remove(9)
        answers.append([pol.victim(lambda k: True), pol.victim(lambda k: k != 3)])
    assert answers == [[3, 1]] * 3


def test_an_extension_type_policy_names_itself_in_its_class_body():
    """A compiled policy's class cannot be given attributes after its class statement: registering it under
    another name than its body's is a TypeError saying so (a Python class is named by the registry)."""
    from specmd.policies.eviction.lru import LRU
    from specmd.registry import Registry

    reg = Registry("eviction", "specmd.policies.eviction")
    assert reg.register("lru")(LRU) is LRU and LRU.name == "lru"
    if native.loaded("specmd.policies.eviction.lru") == "compiled":
        with pytest.raises(TypeError, match="name it in its class body"):
            reg.register("other")(LRU)
    assert LRU.name == "lru"


def test_register_takes_the_class_and_its_body_name():
    """The one registration style (all four families): ``FAMILY.register(Cls)`` after the class, its name
    from the class body; a class without one is a TypeError before anything is registered."""
    from specmd.policies.eviction.lru import LRU
    from specmd.registry import Registry

    reg = Registry("eviction", "specmd.policies.eviction")
    assert reg.register(LRU) is LRU and reg._classes == {"lru": LRU}

    class Nameless:
        pass

    with pytest.raises(TypeError, match="names itself in its class body"):
        reg.register(Nameless)
    assert set(reg._classes) == {"lru"}


SOURCES = sorted((ROOT / "specmd").rglob("*.py"))


def test_sources_are_plain_python_and_every_c_declaration_is_in_a_pxd():
    """Cython's own style: no ``import cython``, no ``cython.`` directive or type, no ``__cinit__`` twin in any
    ``.py`` of the package, not even in a comment; the C declarations live in the ``.pxd`` beside it. (A
    module-level directive comment, ``# cython: wraparound=False``, names no attribute of it.)"""
    import re

    bad = []
    for path in SOURCES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bcython\.|^\s*(import cython|from cython)\b|__cinit__", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
    assert any(p.with_suffix(".pxd").is_file() for p in SOURCES)  # (the rule has something to hold)


def test_the_pure_sources_run_without_cython_installed(tmp_path):
    """Cython is a build dependency only: with ``import cython`` made to fail, the pure sources import every
    compiled module and replay a stack (the engine, a compiled policy, the driver)."""
    code = (
        "import sys; sys.modules['cython'] = None\n"  # (an import of it raises ImportError)
        "import importlib, specmd\n"
        "from specmd import native\n"
        "for src in native.sources():\n"
        "    importlib.import_module(native.module_name(src))\n"
        "print('imported', len(native.sources()))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, native.ENV: "1"}, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"imported {len(native.sources())}" in out.stdout
