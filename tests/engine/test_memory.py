"""``hardware.memory_gb``: the KV cache per family read off transformers' configs (hand-worked byte counts), the
capacity per pass (a shrinking budget evicts exactly what the policy picks, counted as pressure), the series
against an independent computation, replay == live and offload == simulated with it, and bad input refused
before any work."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import sample_ids, tiny
from specmd.compose import spec_of
from specmd.engine import Geometry
from specmd.engine.memory import GIB, KvLayout
from specmd.engine.store import StoreSizes
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.models.kv import kv_layout
from specmd.replay.driver import check_memory, run_replay
from specmd.replay.trace import Trace, TraceMeta, full_calls


def config(family, **over):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[family](**over).get_text_config()


# ---------------------------------------------------------------------------------------------------------
# 1. the KV cache per sequence, per kind of attention (hand-worked from the published configs)
# ---------------------------------------------------------------------------------------------------------
def test_gqa_kv_bytes_olmoe_and_mixtral():
    # OLMoE-1B-7B: 16 layers x K and V x 16 kv heads x 128 dims x 2 bytes = 128 KiB per token
    olmoe = config("olmoe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=16)
    assert kv_layout(olmoe, 2) == KvLayout(16 * 2 * 16 * 128 * 2)
    # Mixtral-8x7B: 32 layers, 8 kv heads of 128 (GQA: 4 query heads share one): also 128 KiB per token
    mixtral = config("mixtral", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
    assert kv_layout(mixtral, 2).token_bytes == 32 * 2 * 8 * 128 * 2 == 131072
    assert kv_layout(mixtral, 4).token_bytes == 2 * 131072  # the dtype's bytes


def test_mla_caches_the_compressed_latent():
    # DeepSeek-V3: 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes = 70,272 bytes (~69 KiB) per token, not
    # the 128 heads' decompressed keys and values (128 x (192 + 128) x 2 x 61 = 5.0 MB)
    v3 = config("deepseek_v3", num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
    assert kv_layout(v3, 2) == KvLayout(61 * (512 + 64) * 2)
    # GLM-5's DSA: the indexer's key (128) beside the latent, per layer
    glm = config("glm_moe_dsa", num_hidden_layers=78, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
    assert kv_layout(glm, 2).token_bytes == 78 * (512 + 64 + 128) * 2


def test_sliding_window_holds_at_most_its_window():
    # gpt-oss: alternating sliding (128) and full layers, 8 kv heads of 64 dims: 2,048 bytes per layer per token
    c = config("gpt_oss", num_hidden_layers=4, num_key_value_heads=8, head_dim=64, sliding_window=128,
               layer_types=["sliding_attention", "full_attention"] * 2)
    layout = kv_layout(c, 2)
    per_layer = 2 * 8 * 64 * 2
    assert layout == KvLayout(2 * per_layer, ((128, 2 * per_layer),))
    # two sequences of 100 and 300 tokens: full layers hold all 400; sliding ones 100 + 128
    assert layout.bytes_of([100, 300]) == 400 * 2 * per_layer + (100 + 128) * 2 * per_layer
    # Llama-4 Scout (the config class's defaults): 48 layers, every 4th full attention, the other 36 chunked
    # (8,192 tokens): each holds one chunk at most; 8 kv heads of 128 dims
    l4 = config("llama4")
    per = 2 * 8 * 128 * 2
    assert kv_layout(l4, 2) == KvLayout(12 * per, ((8192, 36 * per),))
    assert kv_layout(l4, 2).bytes_of([10000]) == 10000 * 12 * per + 8192 * 36 * per


def test_linear_attention_state_is_per_sequence():
    # Qwen3-Next-80B-A3B: 48 layers, every 4th full (12 x 2 x 2 kv heads x 256 x 2 bytes = 24,576 per token); 36
    # gated DeltaNet layers keep 32 value heads x 128 x 128 plus a 4-tap convolution's last 3 columns of q, k, v
    c = config("qwen3_next")
    state = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3
    assert kv_layout(c, 2) == KvLayout(12 * 2 * 2 * 256 * 2, (), 36 * state * 2)
    assert kv_layout(c, 2).bytes_of([1000, 1]) == 1001 * 24576 + 2 * 36 * state * 2


def test_a_layer_type_nobody_sized_is_unknown_and_memory_gb_refuses_it():
    layout = kv_layout(config("deepseek_v4"), 2)
    assert "compressed_sparse_attention" in layout.unknown
    trace = memory_trace([5], kv=layout.to_dict())
    with pytest.raises(ConfigError, match=r"memory_gb=.*compressed_sparse_attention"):
        run_replay(trace, memory_spec(7500))
    with pytest.raises(ConfigError, match=r"memory_gb=.*not recorded"):  # a trace from before layouts
        run_replay(memory_trace([5], kv={}), memory_spec(7500))


def test_every_family_specmd_runs_has_a_known_layout():
    """Every family with an adapter, at its tiny config: the layout is read (none unknown), and positive."""
    from tests.conftest import FAMILIES
    from specmd.models.loader import ModelConfig, model_geometry

    for family in FAMILIES:
        geom = model_geometry(ModelConfig(family=family))
        layout = KvLayout.from_dict(geom.kv)
        assert not layout.unknown and layout.bytes_of([10]) > 0, (family, layout)


# ---------------------------------------------------------------------------------------------------------
# 2. the capacity per pass, hand-worked: 1 MoE layer of 8 experts of 1,000 bytes, 2,000 dense bytes,
#    100 KV bytes per token, memory 7,500 bytes
# ---------------------------------------------------------------------------------------------------------
def memory_trace(contexts, requests=None, kv=None, kinds=None) -> Trace:
    """One sequence per pass at ``contexts[p]``, one token per pass requesting ``requests[p]`` (one layer);
    ``kinds``: 0 prefill / 1 decode per pass (default: a prefill, then decode passes)."""
    requests = requests or [[p % 8] for p in range(len(contexts))]
    k = len(requests[0])
    idx = np.asarray(requests, dtype=np.uint8).reshape(-1, k)
    kinds = kinds or [0 if i == 0 else 1 for i in range(len(contexts))]
    passes = np.array([[kind, 1, c] for kind, c in zip(kinds, contexts)], dtype=np.int64)
    geom = Geometry(num_layers=1, num_experts=8, top_k=k, expert_bytes=1000, total_bytes=10000,
                    kv=KvLayout(100).to_dict() if kv is None else kv)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 1000, {}), logits="fp32", source={"format": "test"})
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, 1), index=idx, path="hand-worked")


def memory_spec(memory_bytes, eviction="lru", **hw):
    return spec_of(eviction=eviction, prefetch="none",
                   hardware=HardwareConfig(memory_gb=memory_bytes / GIB, bandwidth_gbps=1e3, **hw))


def test_a_shrinking_budget_evicts_exactly_the_policys_victims():
    # passes 0-4 at context 5: 7,500 - 2,000 dense - 500 KV = 5,000 bytes, 5 experts; experts 0..4 enter in
    # order. Pass 5 at context 16: 1,600 KV leaves 3,900 -> 3 experts: LRU evicts 0 and 1 (least recent), by
    # pressure; pass 5 requests 0 (a miss, no collision: evicted before the pass), which evicts 2.
    trace = memory_trace([5, 5, 5, 5, 5, 16], [[0], [1], [2], [3], [4], [0]])
    engine = run_replay(trace, memory_spec(7500))
    st = engine.cache.stats
    assert st.total("evictions_pressure") == 2 and st.total("evictions") == 3
    assert sorted(k for k in engine.cache.entries) == [0, 3, 4]
    assert (st.total("misses"), st.total("collision_misses")) == (6, 0)
    assert [p.capacity_bytes for p in st.passes] == [5000] * 5 + [3900]
    assert [p.kv_bytes for p in st.passes] == [500] * 5 + [1600]
    # LFU picks by frequency instead: 0 was used twice before the squeeze, so it stays
    trace = memory_trace([5, 5, 5, 5, 5, 5, 16], [[0], [0], [1], [2], [3], [4], [0]])
    engine = run_replay(trace, memory_spec(7500, eviction="lfu"))
    assert engine.cache.stats.total("evictions_pressure") == 2
    assert 0 in engine.cache.entries and engine.cache.stats.passes[-1].hits == 1


def test_per_layer_pools_split_the_budget_evenly():
    trace = memory_trace([5, 16])
    trace.meta.geometry.num_layers = 1  # (one layer: one pool either way; the split is checked on the section)
    r = run_replay(trace, memory_spec(7500, scope="per_layer")).results()["cache"]["memory"]
    assert r["capacity_bytes"] == {"min": 3900, "mean": 4450.0, "last": 3900}
    assert r["capacity_experts"] == {"min": 3, "mean": 4.0, "last": 3}
    assert r["dense_bytes"] == 2000 and r["kv_token_bytes"] == 100


def test_the_cache_never_exceeds_the_whole_model():
    # 1 GiB of memory, a model of 10,000 bytes: the ceiling is its 8 experts, whatever the memory leaves
    engine = run_replay(memory_trace([5, 6]), memory_spec(GIB))
    assert engine.cache.layout().capacities == (8000,)
    assert [p.capacity_bytes for p in engine.cache.stats.passes] == [8000, 8000]


def test_memory_too_small_is_refused_before_any_pass():
    # the dense weights leave less than one expert: refused when the engine is built, naming the parts
    with pytest.raises(ConfigError, match=r"memory_gb=.*leaves .* GiB for experts .*dense weights.*less than one "
                                          r"expert"):
        run_replay(memory_trace([5]), memory_spec(2500))
    # a pass whose KV cache leaves the dense weights no room: refused before the replay runs, naming the pass
    trace = memory_trace([5, 5, 60])
    from specmd.replay.driver import build_engine

    engine, _, _ = build_engine(trace, memory_spec(7500))
    with pytest.raises(ConfigError, match=r"cannot hold forward pass 2 of hand-worked.*KV cache"):
        check_memory(trace, engine)
    assert engine.cache.stats.passes == []
    # a reserve: 7,500 - 1,000 reserve - 2,000 - 500 = 4,000
    st = run_replay(memory_trace([5]), memory_spec(7500, reserve_gb=1000 / GIB)).cache.stats
    assert st.passes[0].capacity_bytes == 4000


@pytest.mark.parametrize("bad,match", [
    (dict(memory_gb=-1.0), r"memory_gb=-1.0 must be the device's memory in GiB"),
    (dict(memory_gb=0.0), r"memory_gb=0.0 must"),
    (dict(memory_gb=True), r"memory_gb=True must"),
    (dict(memory_gb=float("nan")), r"memory_gb.*(finite|nan)"),
    (dict(memory_gb=float("inf")), r"memory_gb.*(finite|inf)"),
    (dict(memory_gb=2e9), r"memory_gb=2000000000.0 must"),
    (dict(memory_gb=8.0, reserve_gb=-1.0), r"reserve_gb=-1.0 must"),
    (dict(memory_gb=8.0, reserve_gb=8.0), r"reserve_gb=8 leaves nothing of hardware.memory_gb=8"),
    (dict(memory_gb=8.0, experts_per_layer=4), r"memory_gb=8 .*experts_per_layer=4 fixes it"),
])
def test_bad_memory_settings_are_refused_naming_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        HardwareConfig(**bad)


# ---------------------------------------------------------------------------------------------------------
# 3. the drivers agree: replay == live, offload == simulated, the series against an independent computation
# ---------------------------------------------------------------------------------------------------------
def tight_memory(model, fraction=0.3, tokens=12) -> float:
    """GiB leaving exactly ``fraction`` of the tiny model's routed experts (whole experts) after its dense weights
    and a sequence of ``tokens`` tokens' KV cache: one token more and the cache holds one expert less."""
    from specmd.models.adapters import adapter_for

    geom = adapter_for(model.config.model_type).geometry(model)
    routed = geom.num_layers * geom.num_experts * geom.expert_bytes
    kv = KvLayout.from_dict(geom.kv)
    slots = round(fraction * geom.num_layers * geom.num_experts)
    return (geom.total_bytes - routed + slots * geom.expert_bytes + kv.bytes_of([tokens])) / GIB


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_replay_equals_live_with_memory(family, tmp_path):
    from specmd.replay.trace import read_trace
    from tests.replay.test_replay import live

    model = tiny(family)
    prompts = [sample_ids(batch=1, seq=12, seed=s) for s in (0, 1)]
    spec = memory_spec(tight_memory(model) * GIB, eviction="least_stale")
    want = live(model, spec, prompts, tmp_path / "trace")
    got = run_replay(read_trace(tmp_path / "trace"), spec).results()
    assert got["cache"] == want["cache"] and got["timing"] == want["timing"]
    mem = want["cache"]["memory"]
    assert mem["capacity_experts"]["min"] < mem["capacity_experts"]["mean"]  # 13..15 tokens: one slot less
    assert want["cache"]["evictions_pressure"] > 0


def test_offload_equals_simulated_with_memory():
    from tests.executor.test_offload import run_stack
    from tests.executor.test_offload import spec_of as offload_spec

    model = tiny("olmoe")
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(memory_gb=tight_memory(model, 0.25, 8), scope="global")
    sim = run_stack(model, offload_spec({"name": "simulated"}, **hw), ids, prefill)
    off = run_stack(model, offload_spec({"name": "offload", "check": True}, **hw), ids, prefill)
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1])
    assert off[2] == sim[2]
    cache, memory = off[2]["cache"], off[3]["memory"]
    assert cache["evictions_pressure"] > 0
    # the arena is sized at the largest capacity; the engine never used more than the pass's own
    assert memory["arena_capacity_bytes"] >= cache["memory"]["capacity_bytes"]["last"]
    assert memory["arena_peak_bytes"] == cache["peak_bytes"] <= memory["arena_capacity_bytes"]


def test_capacity_series_equals_an_independent_computation(tmp_path):
    """The CLI's passes.csv capacity per pass against memory - dense - 128 KiB x context, computed here from the
    trace's passes and OLMoE-1B-7B's published sizes (the run times the embedded model as OLMoE)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "specmd", f"replay.trace={ROOT}/tests/data/embedded_trace", "model=tiny",
                        "hardware.timing_as=olmoe", "hardware.memory_gb=2", f"hydra.run.dir={run}"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from specmd.replay.trace import read_trace

    passes = read_trace(ROOT / "tests" / "data" / "embedded_trace").passes
    res = json.loads((run / "results.json").read_text())["cache"]
    # OLMoE-1B-7B: 6,919,161,856 parameters, 16 x 64 experts of 3 x 2048 x 1024, bf16
    total, routed = 6919161856 * 2, 16 * 64 * 3 * 2048 * 1024 * 2
    dense = total - routed
    assert res["memory"]["dense_bytes"] == dense
    rows = (run / "passes.csv").read_text().splitlines()[1:]
    want = [2 * GIB - dense - 131072 * int(c) for c in passes[:, 2]]
    assert [int(r.split(",")[9]) for r in rows] == want
    assert [int(r.split(",")[10]) for r in rows] == [131072 * int(c) for c in passes[:, 2]]


def test_a_trace_recorded_at_a_batch_is_refused_and_a_composed_one_counts_each_sequence():
    from specmd.replay.batching import compose_trace

    trace = memory_trace([5, 6, 7, 5, 6, 7], kinds=[0, 1, 1] * 2)  # two requests: a prefill, 2 decode passes each
    trace.meta.source = {"batch_size": 2}  # recorded by specmd at eval.batch_size=2
    with pytest.raises(ConfigError, match=r"recorded at eval.batch_size=2.*replay.batch=2"):
        run_replay(trace, memory_spec(9000))
    trace.meta.source["batch_size"] = 1
    composed = compose_trace(trace, batch=2)
    st = run_replay(composed, memory_spec(9000)).cache.stats
    # each step holds both requests: KV of 5 + 5, 6 + 6, 7 + 7 tokens
    assert [p.kv_bytes for p in st.passes] == [1000, 1200, 1400]
    assert [p.capacity_bytes for p in st.passes] == [6000, 5800, 5600]


# ---------------------------------------------------------------------------------------------------------
# 4. speculative decoding replayed: a verify step is K + 1 tokens of one sequence through every layer
# ---------------------------------------------------------------------------------------------------------
def spec_trace(requests, E=8, k=2, layers=2):
    """Requests of a prefill (1 token) then decode tokens; ``requests[r][t][l]`` the k experts of token t at layer l."""
    kinds, ctx, rows = [], [], []
    for req in requests:
        for t, tok in enumerate(req):
            kinds.append(0 if t == 0 else 1)
            ctx.append(t + 1)
            rows += [tok[l] for l in range(layers)]
    passes = np.array([[kd, 1, c] for kd, c in zip(kinds, ctx)], dtype=np.int64)
    geom = Geometry(num_layers=layers, num_experts=E, top_k=k, expert_bytes=1000, total_bytes=1000 * E * layers + 500,
                    kv=KvLayout(10).to_dict())
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 1000, {}), logits="fp32", source={"batch_size": 1})
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, layers), index=np.asarray(rows, dtype=np.uint8),
                 path="hand-worked")


def test_a_verify_step_requests_the_union_of_its_tokens_experts():
    from specmd.replay.speculative import speculate

    # one request: prefill, then 5 decode tokens; K = 3, every draft accepted: one verify step of tokens 1..4,
    # then one of token 5 alone (the sequence ends)
    toks = [[[0, 1], [2, 3]], [[0, 4], [2, 5]], [[1, 4], [6, 7]], [[0, 5], [2, 3]], [[0, 1], [2, 5]], [[7, 6], [5, 4]]]
    tr = speculate(spec_trace([toks]), 3, 1.0)
    assert tr.passes.tolist() == [[0, 1, 1], [1, 4, 5], [1, 1, 6]]  # context: through the step's last token
    assert tr.contexts[1].tolist() == [1, 5, 6]  # the KV cache: through the step's last token
    assert tr.speculative["verify_steps"] == 2 and tr.speculative["accepted_tokens"] == 5
    engine = run_replay(tr, spec_of(eviction="lru", prefetch="none",
                                    hardware=HardwareConfig(experts_per_layer=8, scope="per_layer")))
    dec = [p for p in engine.cache.stats.passes if p.kind == "decode"]
    # layer 0: {0, 4, 1, 5} = 4 experts, layer 1: {2, 5, 6, 7, 3} = 5; the last step: {7, 6} + {5, 4}
    assert [p.requests for p in dec] == [4 + 5, 2 + 2]
    # none accepted: each step verifies min(K + 1, left) tokens and advances by one
    tr0 = speculate(spec_trace([toks]), 3, 0.0)
    assert tr0.passes[:, 1].tolist() == [1, 4, 4, 3, 2, 1] and tr0.speculative["accepted_tokens"] == 5
    assert tr0.speculative["verified_tokens"] == 14


def test_speculation_composes_with_batching_and_counts_each_sequences_kv():
    from specmd.replay.batching import compose_trace
    from specmd.replay.speculative import speculate

    rng = np.random.default_rng(0)
    reqs = [[[rng.choice(8, 2, replace=False).tolist() for _ in range(2)] for _ in range(n)] for n in (6, 4)]
    tr = compose_trace(speculate(spec_trace(reqs), 2, 1.0), batch=2)
    # request 0: steps of 3, 2 tokens after its prefill; request 1: 3 tokens: both prefills, then steps side by side
    assert tr.passes[:, 1].tolist() == [2, 6, 2]
    assert [tr.contexts[1][a:b].tolist() for a, b in zip(tr.contexts[0][:-1], tr.contexts[0][1:])] == \
        [[1, 1], [4, 4], [6]]
    st = run_replay(tr, memory_spec_two()).cache.stats
    assert [p.kv_bytes for p in st.passes] == [20, 80, 60]


def memory_spec_two():
    return spec_of(eviction="lru", prefetch="none",
                   hardware=HardwareConfig(memory_gb=(16500 + 500) / GIB, bandwidth_gbps=1e3))


def test_acceptance_sets_the_tokens_per_step_and_replay_says_it_approximates(tmp_path):
    from specmd.replay.driver import exactness
    from specmd.replay.speculative import speculate

    rng = np.random.default_rng(1)
    reqs = [[[rng.choice(8, 2, replace=False).tolist() for _ in range(2)] for _ in range(200)]]
    base = spec_trace(reqs)
    assert speculate(base, 0, 0.5) is base
    per_step = [speculate(base, 3, p, seed=4).speculative for p in (0.0, 0.5, 1.0)]
    # accepted per step: 1, then 1 + p + p^2 + p^3 (the expectation at p = 0.5: 1.875), then K + 1
    assert per_step[0]["verify_steps"] == 199 and per_step[2]["verify_steps"] == 50
    assert 1.6 < 199 / per_step[1]["verify_steps"] < 2.2
    assert any("rejected draft" in r for r in exactness(speculate(base, 3, 0.5), spec_of()))


@pytest.mark.parametrize("bad,match", [
    (dict(speculative_tokens=3), r"needs replay.acceptance"),
    (dict(speculative_tokens=-1, acceptance=0.5), r"speculative_tokens=-1: valid choices are whole numbers in 0..64"),
    (dict(speculative_tokens=65, acceptance=0.5), r"speculative_tokens=65"),
    (dict(speculative_tokens=2, acceptance=1.5), r"acceptance=1.5: valid choices are a probability"),
    (dict(speculative_tokens=2, acceptance=float("nan")), r"acceptance=nan"),
])
def test_bad_speculation_settings_are_refused(bad, match):
    from specmd.replay.config import ReplayConfig

    with pytest.raises(ConfigError, match=match):
        ReplayConfig(trace="somewhere", **bad)


# ---------------------------------------------------------------------------------------------------------
# 5. per-layer budgets: the same bytes, shared by the layers' working sets after the warm-up
# ---------------------------------------------------------------------------------------------------------
def test_proportional_budgets_follow_the_working_sets():
    from specmd.engine.budget import WARMUP

    # 2 layers of 8 experts: layer 0 cycles over 6 experts, layer 1 over 2; 40 passes
    trace = spec_trace([[[[p % 6, 6 + (p % 2)], [p % 2, 2]] for p in range(40)]])
    hw = dict(experts_per_layer=3, scope="per_layer", bandwidth_gbps=1e3)  # 2 x 3 slots = 6,000 bytes
    uni = run_replay(trace, spec_of(eviction="lru", prefetch="none", hardware=HardwareConfig(**hw))).results()
    pro = run_replay(trace, spec_of(eviction="lru", prefetch="none",
                                    hardware=HardwareConfig(layer_budget="proportional", **hw))).results()
    lb = pro["cache"]["layer_budget"]
    # working sets: layer 0 saw {0..5} + {6, 7} = 8, layer 1 {0, 1, 2} = 3; one expert each, then 4,000 bytes
    # split 8:3 -> 1,000 + 2,909 and 1,000 + 1,090: 3 and 2 slots
    assert lb["working_set"] == [8, 3] and lb["slots"] == [3, 2] and lb["measured"]
    assert lb["warmup_passes"] == WARMUP
    assert uni["cache"]["layer_budget"]["slots"] == [3, 3] and uni["cache"]["layer_budget"]["working_set"] is None
    assert pro["cache"]["evictions_pressure"] >= 1  # layer 1's pool shrank from 3 to 2 slots


def test_proportional_budgets_replay_equals_live(tmp_path):
    from specmd.replay.trace import read_trace
    from tests.replay.test_replay import live

    model = tiny("olmoe")
    prompts = [sample_ids(batch=1, seq=12, seed=s) for s in (0, 1, 2, 3, 4, 5, 6, 7, 8)]  # 36 passes: past the warm-up
    spec = spec_of(eviction="lfu", prefetch="none",
                   hardware=HardwareConfig(capacity=0.3, scope="per_layer", layer_budget="proportional"))
    want = live(model, spec, prompts, tmp_path / "trace")
    got = run_replay(read_trace(tmp_path / "trace"), spec).results()
    assert got["cache"] == want["cache"] and got["timing"] == want["timing"]
    assert want["cache"]["layer_budget"]["measured"]


def test_layer_budget_settings_are_checked():
    with pytest.raises(ConfigError, match=r"layer_budget='even'; valid choices: uniform, proportional"):
        HardwareConfig(layer_budget="even", scope="per_layer")
    with pytest.raises(ConfigError, match=r"layer_budget=proportional .*hardware.scope=global.*scope=per_layer"):
        HardwareConfig(layer_budget="proportional")


# ---------------------------------------------------------------------------------------------------------
# 6. hardware.capacity=auto: the device's free memory (execution=offload)
# ---------------------------------------------------------------------------------------------------------
def auto_run(tmp_path, *over):
    from hydra import compose, initialize_config_dir

    from specmd.app import execute
    from tests.system.test_configs import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny", "eval.limit=1", "eval.max_gen_toks=4",
                                                       "hardware.capacity=auto", *over])
    return execute(cfg, run_dir=tmp_path / "run")


def test_capacity_auto_is_refused_where_it_cannot_be_read(tmp_path):
    with pytest.raises(ConfigError, match=r"capacity=auto sizes an arena .* execution=simulated allocates none"):
        auto_run(tmp_path)
    with pytest.raises(ConfigError, match=r"capacity=auto on device=cpu: there is no device memory to read; set "
                                          r"hardware.memory_gb"):
        auto_run(tmp_path, "execution=offload")
    with pytest.raises(ConfigError, match=r"capacity='big' must be a fraction in \(0, 1\] .* or auto"):
        HardwareConfig(capacity="big")
    with pytest.raises(ConfigError, match=r"capacity=auto is read from the device"):
        run_replay(memory_trace([5]), spec_of(prefetch="none", hardware=HardwareConfig(capacity="auto")))


def test_capacity_auto_reads_the_devices_free_memory(tmp_path, monkeypatch):
    """Through the CUDA stand-in (its memory: SPECMD_STANDIN_MEMORY_GB), and on a CPU from memory_gb."""
    from specmd.models.loader import ModelConfig, model_geometry

    from specmd import shipped
    from specmd.registry import build_params

    geom = model_geometry(build_params(ModelConfig, dict(shipped.option("model", "tiny")), "model"))
    dense = geom.total_bytes - geom.num_layers * geom.num_experts * geom.expert_bytes
    kv = KvLayout.from_dict(geom.kv).bytes_of([520])  # a GSM8K prompt cut to the 512-token window, 4 more
    gib = (dense + 20 * geom.expert_bytes + kv) / GIB  # 20 experts beside the KV cache
    monkeypatch.setenv("SPECMD_CUDA_STANDIN", "1")
    monkeypatch.setenv("SPECMD_STANDIN_MEMORY_GB", repr(gib))
    res = auto_run(tmp_path / "standin", "execution=offload")
    mem = res["cache"]["memory"]
    assert mem["memory_bytes"] == int(gib * GIB) and mem["dense_bytes"] == dense
    # the arena holds what the memory leaves with no KV cache; each pass's cache, less
    assert res["memory"]["arena_capacity_bytes"] == int(gib * GIB) - dense and mem["capacity_experts"]["min"] <= 20
    monkeypatch.delenv("SPECMD_CUDA_STANDIN")
    res = auto_run(tmp_path / "cpu", "execution=offload", f"hardware.memory_gb={gib!r}")
    assert res["cache"]["memory"]["memory_bytes"] == int(gib * GIB)


# ---------------------------------------------------------------------------------------------------------
# 7. live speculative decoding (eval.speculative=prompt_lookup): transformers' own assisted generation
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["prompt_lookup", "assistant"])
def test_lossless_stack_speculating_is_bit_equal_to_the_unhooked_model_speculating(method):
    import copy

    from specmd.hook import install

    model = tiny("olmoe")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # repeats: prompt lookup finds drafts
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if method == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 3
    else:  # a draft model: another instance of the model, unhooked, drafting 3 tokens a step
        draft = copy.deepcopy(model)
        draft.generation_config.num_assistant_tokens = 3
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kw["assistant_model"] = draft
    with torch.no_grad():
        want = model.generate(ids, **kw)
        stack = install(model, spec_of(eviction="lru", prefetch="none", hardware=HardwareConfig(capacity=0.2)))
        with stack:
            got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    dec = [p for p in stack.engine.cache.stats.passes if p.kind == "decode"]
    assert max(p.tokens for p in dec) == 4 and len(dec) < 11  # verify steps of up to K + 1 tokens, fewer than 11


def test_a_live_speculative_run_reports_per_accepted_token_and_replays_exactly(tmp_path):
    from hydra import compose, initialize_config_dir

    from specmd.app import execute
    from specmd.replay.trace import read_trace
    from tests.system.test_configs import CONF

    over = ["model=tiny", "eval.limit=1", "eval.max_gen_toks=16", "eval.speculative=prompt_lookup",
            "eval.speculative_tokens=3", "trace.save=true", "prefetch=none"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    res = execute(cfg, run_dir=tmp_path / "run")
    sp = res["speculative"]
    assert sp["method"] == "prompt_lookup" and sp["tokens"] == 3
    assert sp["accepted_tokens"] == 15  # 16 generated: the prefill's first, then 15 from verify steps
    assert sp["verify_steps"] == res["timing"]["decode_passes"] and sp["accepted_per_step"] >= 1
    # the trace holds the verify steps as they ran: replayed, the same cache and timing (no composition)
    spec = __import__("specmd.app", fromlist=["Run"]).Run(cfg).spec
    got = run_replay(read_trace(tmp_path / "run" / "trace"), spec).results()
    live_cache = {k: v for k, v in res["cache"].items() if k != "oracle"}  # (the live run's Belady, from its trace)
    assert got["cache"] == live_cache and got["timing"] == res["timing"]
    # ... and its speculative section: the trace recorded the accepted tokens when the run ended
    trace = read_trace(tmp_path / "run" / "trace")
    assert trace.meta.source["speculative"]["accepted_tokens"] == 15
    from specmd.replay.speculative import speculate, speculative_section

    engine = run_replay(trace, spec)
    assert speculative_section(trace, engine) == {**sp, "method": "recorded prompt_lookup"}
    with pytest.raises(ConfigError, match=r"recorded speculating .* verify steps already"):
        speculate(trace, 3, 0.5)


def test_a_draft_model_speculates_at_a_constant_k(tmp_path):
    """eval.speculative=assistant with the model as its own draft: greedy drafts are the model's own tokens, so
    nearly every draft is accepted."""
    from hydra import compose, initialize_config_dir

    from specmd.app import execute
    from tests.system.test_configs import CONF

    over = ["model=tiny", "eval.limit=1", "eval.max_gen_toks=17", "eval.speculative=assistant", "eval.assistant=tiny",
            "eval.speculative_tokens=3", "prefetch=none"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    sp = execute(cfg, run_dir=tmp_path / "run")["speculative"]
    assert sp["method"] == "assistant" and sp["accepted_tokens"] == 16
    # a constant K: every step but the last verifies K + 1 = 4 tokens (transformers' heuristic schedule would move
    # it); most drafts accepted (a multi-token pass's numerics can flip a near-tie the one-token draft passes chose)
    assert sp["verified_per_step"] > 3 and sp["accepted_per_step"] >= 2 and sp["verify_steps"] < 8


@pytest.mark.parametrize("over,match", [
    (dict(speculative="draft"), r"eval.speculative='draft'; valid choices: prompt_lookup, assistant"),
    (dict(speculative="assistant"), r"a draft model is eval.speculative=assistant's, and it needs one"),
    (dict(assistant="tiny"), r"a draft model is eval.speculative=assistant's"),
    (dict(speculative="prompt_lookup", batch_size=2), r"one sequence at a time: eval.batch_size=2 must be 1"),
    (dict(speculative="prompt_lookup", speculative_tokens=0), r"speculative_tokens=0: valid choices"),
    (dict(speculative="prompt_lookup", token_by_token=True), r"set one of them"),
])
def test_bad_live_speculation_is_refused(over, match):
    from specmd.eval.harness import EvalConfig

    with pytest.raises(ConfigError, match=match):
        EvalConfig(**over)


@pytest.mark.parametrize("eviction", [e for e in __import__("specmd.policies.eviction", fromlist=["EVICTION"])
                                      .EVICTION.names() if e != "ml"])  # (ml: networks of a 4-layer model)
def test_every_eviction_policy_follows_a_budget_that_shrinks_and_grows(eviction):
    """Every registered eviction policy on a capacity that moves every few passes: the pools never exceed their
    budget, pressure evictions are the policy's victims, and a policy sizing its state by the capacity follows it
    (ARC's and LeCaR's c: ``resized``)."""
    rng = np.random.default_rng(0)
    contexts = [5, 5, 9, 16, 16, 12, 5, 20, 20, 8] * 3
    trace = memory_trace(contexts, [[int(e)] for e in rng.integers(0, 8, len(contexts))])
    engine = run_replay(trace, memory_spec(7500, eviction=eviction))
    cache = engine.cache
    cache.check_invariants()
    caps = [p.capacity_bytes for p in cache.stats.passes]
    assert caps == [7500 - 2000 - 100 * c for c in contexts]
    assert cache.stats.total("evictions_pressure") > 0
    policy = cache.pools[0].policy
    if hasattr(policy, "c"):  # ARC, LeCaR: c is the last pass's capacity in experts
        assert policy.c == caps[-1] // 1000
