"""Families derived from transformers' own classes (issue 55, :mod:`specmd.models.derive`): every MoE family
of the installed transformers that follows its MoE contract runs without a record -- hooked lossless ==
unhooked (prefill of a batch, greedy generation), execution=offload == simulated, replay == live -- and
every other one is refused with the reason, before any weight loads."""

import pytest
import torch

from tests.conftest import at_equal_threads, sample_ids, tiny
from specmd.models.adapters import ADAPTERS, adapter_for, derived_families
from specmd.models.derive import derive, moe_families

DERIVED = derived_families()
# the 2026 models of issue 55 whose families follow the contract: each must derive (GLM-4.5/4.7, GLM-5 (DSA),
# DeepSeek-V3.2, Qwen3-Next, Qwen3.5-MoE, MiniMax-Text and MiniMax-M2 (a router given its block's selection bias),
# Hy3, ERNIE-4.5, Hunyuan, Kimi-Linear, MiMo-V2, Solar-Open)
MUST_RUN = {"glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32", "qwen3_next", "qwen3_5_moe_text", "minimax",
            "minimax_m2", "hy_v3", "ernie4_5_moe", "hunyuan_v1_moe", "kimi_linear", "mimo_v2_flash", "solar_open",
            # vision-language wrappers, run through their text decoder (Kimi-K2.5, Qwen3-VL-MoE, Mistral-4, Aria)
            "kimi_k25", "qwen3_vl_moe", "mistral4", "aria",
            # Llama-4 (Scout, Maverick; its checkpoints, llama4, run as it): its block adopted into the contract
            "llama4_text",
            # DeepSeek-V4: hash-routed first layers (the router reads the pass's token ids), sqrt-softplus scores
            "deepseek_v4",
            # ERNIE-4.5-VL: its text experts (a text pass never calls the vision set)
            "ernie4_5_vl_moe",
            # LongCat-Flash: identity ("zero-computation") experts beside its experts
            "longcat_flash"}


def test_the_families_that_run_are_computed_from_the_installed_transformers():
    every = moe_families()
    assert set(ADAPTERS) <= set(every) | {"phimoe"} and set(DERIVED) <= set(every)
    assert MUST_RUN <= set(DERIVED), sorted(MUST_RUN - set(DERIVED))
    assert len(set(DERIVED) | set(ADAPTERS)) >= 34
    # group limits are probed whatever the class default (GLM's is 1, a checkpoint's config.json sets more) ...
    assert {"glm4_moe", "solar_open", "kimi_linear", "mimo_v2_flash"} <= {f for f in DERIVED
                                                                          if adapter_for(f).group_score == "top2"}
    # ... and a router that scores the groups it leaves out 0.0, not -inf, runs with that rule (A.X-K2: with a
    # negative selection bias those experts win, as its code has it), and one that adds the bias to its logits
    assert adapter_for("axk2").group_fill == 0.0 and adapter_for("glm4_moe").group_fill == float("-inf")
    assert adapter_for("kolibri1").bias_on_logits and not adapter_for("glm4_moe").bias_on_logits  # (Kolibri: on logits)
    # Gemma-4: the decoder layer is the block, the router returns probabilities, weights carry a learned scale
    gemma = adapter_for("gemma4_text")
    assert (gemma.block_attr, gemma.score, gemma.weight_scale_attr) == ("", "probabilities", "per_expert_scale")
    # a wrapper whose causal-LM class is its text model runs as that (its checkpoints load the text weights) ...
    assert derive("qwen3_5_moe").runs_as == "qwen3_5_moe_text" and derive("qwen3_5_moe").adapter is not None
    assert derive("llama4").runs_as == "llama4_text" and derive("llama4").adapter is not None
    # ERNIE-4.5-VL: text and vision experts in each layer, the block the set a text pass calls (probed)
    assert adapter_for("ernie4_5_vl_moe").block_attr == "mlp.text_moe"
    assert adapter_for("longcat_flash").identity_attr == "zero_expert_num"  # (router columns past its experts)
    # ... and one whose text decoder has no causal-LM class runs inside the wrapper, found where its layers are
    assert (adapter_for("kimi_k25").decoder_path, adapter_for("kimi_k25").head_path) == ("model.language_model",
                                                                                          "lm_head")
    assert adapter_for("nemotron_h_omni").head_path == "language_model.lm_head"
    assert adapter_for("aria").topk_attr == "moe_topk"  # (top-k under another name)
    # ERNIE-4.5's selection bias sits in its router's moe_statics (a trained checkpoint's is not zero), AfMoE's
    # router reads [B, S, H] and is initialised to zeros (a probe that did not spread it fitted a softmax)
    assert adapter_for("ernie4_5_moe").bias_path == "moe_statics" and derive("ernie4_5_moe").bias
    assert adapter_for("afmoe").router_batched and adapter_for("afmoe").score == "sigmoid"
    wrappers = {f for f in every if derive(f).runs_as}
    for family in set(every) - set(DERIVED) - set(ADAPTERS) - wrappers:  # each refusal says what the family lacks
        reason = derive(family).reason
        assert reason and reason.startswith("its "), (family, reason)


def test_a_derived_record_is_what_the_family_declares_where_a_record_exists():
    """Derivation read off transformers agrees with the hand-written records it replaces (where the tiny
    config has what the probe needs: top-k, a softmax/sigmoid router)."""
    for family in ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        mine, theirs = derive(family).adapter, ADAPTERS[family]
        assert mine is not None, derive(family).reason
        assert (mine.router_attr, mine.score, mine.renorm, mine.scale_attr, mine.experts_layout, mine.group_score) == (
            theirs.router_attr, theirs.score, theirs.renorm, theirs.scale_attr, theirs.experts_layout,
            theirs.group_score), family


@pytest.mark.parametrize("family", DERIVED)
def test_a_derived_family_runs_lossless_offloaded_and_replayed(family, tmp_path):
    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig
    from specmd.hook import install
    from specmd.replay.driver import run_replay
    from specmd.replay.trace import TraceWriter, read_trace

    from tests.engine.test_batch import left_padded

    model, adapter = tiny(family), adapter_for(family)
    ids = sample_ids(batch=2, seq=12)
    prompt, mask = left_padded([6, 3, 5, 2], seed=4)  # B = 4 with left padding: the hook serves the live rows
    gen = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model(ids).logits
        ref_tokens = model.generate(prompt, **gen)

    def run(execution, trace=None):
        spec = spec_of(eviction="lru", prefetch="topk", hardware=HardwareConfig(capacity=0.3))
        spec.execution = EXECUTION.params(at_equal_threads(execution))
        stack = install(model, spec, adapter)
        if trace is not None:
            stack.writer = TraceWriter(trace, stack.geom, stack.scoring, stack.store, 1)
        try:
            with torch.no_grad():
                logits = model(ids).logits
                tokens = model.generate(prompt, **gen)
        finally:
            stack.remove()
            if stack.writer is not None:
                stack.writer.close()
        return logits, tokens, stack.engine.results()

    sim = run({"name": "simulated"}, tmp_path / "trace")
    assert torch.equal(sim[0], ref) and torch.equal(sim[1], ref_tokens)  # lossless == unhooked
    assert sim[2]["routing"]["fidelity"] == 1.0 and sim[2]["cache"]["requests"] > 0
    assert sim[2]["timing"]["decode_passes"] == 2
    off = run({"name": "offload", "check": True})
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]) and off[2] == sim[2]  # offload == simulated
    trace = read_trace(tmp_path / "trace")
    got = run_replay(trace, spec_of(eviction="lru", prefetch="topk", hardware=HardwareConfig(capacity=0.3))).results()
    assert got["cache"] == sim[2]["cache"] and got["timing"] == sim[2]["timing"]  # replay == live


def test_a_derived_checkpoint_runs_by_path_and_a_refused_family_is_refused_before_loading(tmp_path):
    from specmd.errors import ConfigError
    from specmd.models.loader import ModelConfig, load_model, resolve_family
    from specmd.models.tokenizer import byte_tokenizer

    tiny("glm4_moe").save_pretrained(tmp_path / "glm")
    byte_tokenizer().save_pretrained(tmp_path / "glm")
    cfg = ModelConfig(name="hf", family="auto", pretrained=str(tmp_path / "glm"), dtype="float32")
    model, _ = load_model(cfg)
    assert cfg.family == "glm4_moe" and model.config.model_type == "glm4_moe"
    from transformers import AutoConfig

    AutoConfig.for_model("zaya").save_pretrained(tmp_path / "zaya")
    (tmp_path / "zaya" / "model.safetensors").write_bytes(b"\0garbage")  # never read
    with pytest.raises(ConfigError, match=r"'zaya' model: model family 'zaya' does not run: its router "
                                          r"returns 4 value\(s\), not \(logits, weights, index\)"):
        resolve_family(ModelConfig(name="hf", family="auto", pretrained=str(tmp_path / "zaya")))


def test_a_vision_language_checkpoint_runs_its_text_decoder_by_path(tmp_path):
    """Qwen3.5-MoE's hub checkpoints are the wrapper (``qwen3_5_moe``, the text weights under
    ``model.language_model``): ``model=hf`` runs them as the text model transformers' causal LM loads, weights
    equal to the wrapper's; Kimi-K2.5's text decoder has no causal-LM class, so it runs inside the wrapper."""
    from transformers import AutoModelForImageTextToText

    from specmd.hook import install
    from specmd.compose import spec_of
    from specmd.models.family import build_config
    from specmd.models.tiny import tiny_overrides
    from specmd.models.loader import ModelConfig, load_model

    torch.manual_seed(0)
    vlm = AutoModelForImageTextToText.from_config(build_config("qwen3_5_moe", tiny_overrides("qwen3_5_moe"))).eval()
    vlm.save_pretrained(tmp_path / "qwen35")
    cfg = ModelConfig(name="hf", family="auto", pretrained=str(tmp_path / "qwen35"), tokenizer="specmd:tiny-olmoe")
    model, _ = load_model(cfg)
    assert cfg.family == "qwen3_5_moe_text" and type(model).__name__ == "Qwen3_5MoeForCausalLM"
    ids = sample_ids(batch=1, seq=10)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, vlm(input_ids=ids).logits)  # the text weights, all of them
        stack = install(model, spec_of())
        try:
            hooked = model(ids).logits
        finally:
            stack.remove()
    assert torch.equal(hooked, vlm(input_ids=ids).logits)
    assert ModelConfig(name="x", family="qwen3_5_moe").family == "qwen3_5_moe_text"  # a family named as the wrapper
    # execution.host=disk on the wrapper's checkpoint: the dense weights under the prefix transformers reads
    # (its conversion mapping's PrefixChange), the experts one at a time from model.language_model.layers
    from specmd.executor.kernel import expert_tensors
    from specmd.executor.tiers import DiskTier
    from specmd.models.loader import load_dense

    adapter = adapter_for("qwen3_5_moe_text")
    dense = load_dense(str(tmp_path / "qwen35"), cfg)
    want = model.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in dense.state_dict().items() if not t.is_meta)
    ids, E = adapter.moe_layers(model), adapter.num_experts(model.config)
    fused = [expert_tensors(adapter.experts(model, i), E) for i in ids]
    shapes = {n: tuple(t.shape[1:]) for n, t in fused[0].items()}
    tier = DiskTier(str(tmp_path / "qwen35"), ids, shapes, torch.float32, E, adapter.hub_layout())
    try:
        for layer, tensors in enumerate(fused):
            for e in (0, E - 1):
                dst = {n: torch.empty(s) for n, s in shapes.items()}
                tier.copy_into(layer, e, dst)
                assert all(torch.equal(dst[n], t[e]) for n, t in tensors.items()), (layer, e)
    finally:
        tier.close()

    model = tiny("kimi_k25")
    adapter = adapter_for("kimi_k25")
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration" and adapter.moe_layers(model)
    assert adapter.layers(model) is model.model.language_model.layers


def test_experts_with_their_own_loop_are_computed_in_its_order_by_both_kernels():
    """Step-3.7's experts loop over experts in their own forward (``torch.where`` rows per expert, added onto
    zeros in ascending id): both experts kernels -- per-expert sources (``run_experts``) and banks
    (``grouped_experts``, the arena's) -- give its bits with ``ExpertsLayout.own_loop`` and not without (the
    rank-order sum, or the stock sort's row order, rounds otherwise), so offloaded equals simulated."""
    import dataclasses

    from specmd.executor.kernel import Bank, expert_tensors, grouped_experts, run_experts, views_of

    model, adapter = tiny("step3p7"), adapter_for("step3p7")
    assert adapter.experts_layout.own_loop
    mod = adapter.experts(model, adapter.moe_layers(model)[0])
    E = adapter.num_experts(model.config)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, mod.gate_up_proj.shape[-1], generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(37)])
    weights = torch.rand(index.shape, generator=g)
    tensors = expert_tensors(mod, E)
    with torch.no_grad():
        own = mod(hidden, index, weights)
        for layout, equal in ((adapter.experts_layout, True), (dataclasses.replace(adapter.experts_layout,
                                                                                    own_loop=False), False)):
            by_source = run_experts(mod, layout, hidden, index, weights, views_of(tensors, E))
            by_bank = grouped_experts(mod, layout, hidden, index, weights, torch.arange(E), [Bank(tensors, 0, E)])
            assert torch.equal(by_source, own) == equal and torch.equal(by_bank, own) == equal


def test_llama4s_block_is_adopted_into_the_contract_computing_its_function():
    """Llama-4's block runs every expert on every token, each on its input scaled by a sigmoid score, and sums
    the [E, T, H] outputs. Adopted (:mod:`specmd.models.contract`): the router gives the same numbers as
    ``(logits, weights, index)``, the state dict keeps its names, the model computes the dense block's function
    sparsely (a few fp32 ulps apart: a GEMM's rows round by its row count), and both experts kernels give the
    adopted experts' bits with ``ExpertsLayout.input_weighted`` -- at Llama-4's top-1 and at top-4 -- and not
    without (weighing outputs instead of inputs)."""
    import copy
    import dataclasses

    from transformers import AutoModelForCausalLM

    from specmd.executor.kernel import Bank, expert_tensors, grouped_experts, run_experts, views_of
    from specmd.models.contract import adopt
    from specmd.models.tiny import tiny_overrides
    from specmd.models.family import build_config

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(build_config("llama4_text", tiny_overrides("llama4_text"))).eval()
    adopted = copy.deepcopy(dense)
    adopt(adopted)
    adopt(adopted)  # (idempotent)
    assert list(adopted.state_dict()) == list(dense.state_dict())
    import pickle

    again = pickle.loads(pickle.dumps(adopted))  # (an adopted model pickles: its forwards are partials)
    experts = adapter_for("llama4_text").experts(again, adapter_for("llama4_text").moe_layers(again)[0])
    assert experts.forward.args[0] is experts
    adapter = adapter_for("llama4_text")
    assert adapter.experts_layout.input_weighted and adapter.block_attr == "feed_forward"
    ids = sample_ids(batch=2, seq=12)
    hidden = torch.randn(37, dense.config.hidden_size, generator=torch.Generator().manual_seed(5))
    layer = adapter.moe_layers(dense)[0]
    with torch.no_grad():
        a, b = dense(ids).logits, adopted(ids).logits
        assert torch.allclose(a, b, rtol=0, atol=1e-5), float((a - b).abs().max())
        assert torch.equal(again(ids).logits, b)
        scores, logits = adapter.router(dense, layer)(hidden)  # transformers' router: [T, E] scores, logits
        lg, w, index = adapter.router(adopted, layer)(hidden)
        assert torch.equal(lg, logits) and torch.equal(torch.zeros_like(scores).scatter_(1, index, w), scores)
    mod = adapter.experts(adopted, layer)
    E = adapter.num_experts(adopted.config)
    tensors = expert_tensors(mod, E)
    g = torch.Generator().manual_seed(6)
    for k in (1, 4):
        index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(37)])
        weights = torch.rand(index.shape, generator=g)
        with torch.no_grad():
            own = mod(hidden, index, weights)
            for layout, equal in ((adapter.experts_layout, True),
                                  (dataclasses.replace(adapter.experts_layout, input_weighted=False), False)):
                by_source = run_experts(mod, layout, hidden, index, weights, views_of(tensors, E))
                by_bank = grouped_experts(mod, layout, hidden, index, weights, torch.arange(E), [Bank(tensors, 0, E)])
                assert torch.equal(by_source, own) == equal and torch.equal(by_bank, own) == equal, (k, layout)


def test_an_expert_set_a_text_run_never_calls_is_neither_cached_nor_dense_compute():
    """ERNIE-4.5-VL's layers hold text and vision experts; a text pass runs the text set (``mlp.text_moe``), which
    specmd caches. The vision set is no dense compute of the layer either: its MoE layers' dense parameters are
    the layer's less both sets."""
    model, adapter = tiny("ernie4_5_vl_moe"), adapter_for("ernie4_5_vl_moe")
    geometry, layers = adapter.geometry(model), adapter.layers(model)
    E = adapter.num_experts(model.config)
    for j, i in enumerate(geometry.layer_ids[1:], start=1):  # (the first MoE layer also carries the dense layer 0)
        mlp = layers[i].mlp
        both = sum(p.numel() for m in (mlp.text_moe.experts, mlp.vision_moe.experts) for p in m.parameters())
        assert geometry.dense_params[j] == sum(p.numel() for p in layers[i].parameters()) - both
    assert geometry.expert_params * E == sum(p.numel() for p in layers[geometry.layer_ids[0]].mlp.text_moe.experts.parameters())


def test_identity_experts_are_selected_but_never_served_hand_worked():
    """LongCat-Flash's router chooses among its E experts and Z identity experts (ids E .. E + Z - 1, output =
    input): an identity expert is no request, no fetch, no compute. A replay of 1 layer, E = 4, Z = 2, two
    slots: prefill [0, 4], [5, 1] requests {0, 1}; a decode step [4, 5] requests nothing; [2, 4] requests {2}:
    3 requests, 3 cold misses, and the oracle (Belady, which reads the same requests) agrees."""
    import numpy as np

    from specmd.compose import spec_of
    from specmd.engine import Geometry
    from specmd.engine.store import StoreSizes
    from specmd.hardware import HardwareConfig
    from specmd.replay.driver import oracle_rates, run_replay
    from specmd.replay.trace import Trace, TraceMeta, full_calls

    passes = np.array([[0, 2, 2], [1, 1, 3], [1, 1, 4]], dtype=np.int64)
    geom = Geometry(num_layers=1, num_experts=4, top_k=2, expert_bytes=100, total_bytes=800, identity_experts=2)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="none", source={"format": "test"})
    index = np.asarray([[0, 4], [5, 1], [4, 5], [2, 4]], dtype=np.uint8)
    trace = Trace(meta=meta, passes=passes, calls=full_calls(passes, 1), index=index)
    spec = spec_of(prefetch="none", hardware=HardwareConfig(experts_per_layer=0.5, scope="per_layer"))
    cache = run_replay(trace, spec).results()["cache"]
    assert (cache["requests"], cache["misses"]) == (3, 3)
    assert meta.to_dict()["version"] == 3 and TraceMeta.from_dict(meta.to_dict(), "m").geometry.identity_experts == 2
    assert oracle_rates(trace, spec) is not None


def test_identity_experts_rows_are_their_input_in_both_kernels():
    """LongCat-Flash's experts module adds an identity expert's input, weighted, in its own loop; both kernels give
    its bits with the identity rows (the offload kernel told where identity ids start) -- and not without."""
    from specmd.executor.kernel import Bank, expert_tensors, grouped_experts, run_experts, views_of

    model, adapter = tiny("longcat_flash"), adapter_for("longcat_flash")
    mod = adapter.experts(model, adapter.moe_layers(model)[0])
    E, Z = adapter.num_experts(model.config), adapter.identity_experts(model.config)
    tensors = expert_tensors(mod, E)
    assert Z == 8 and tensors["gate_up_proj"].shape[0] == E  # (its up projection's identity rows left out)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, model.config.hidden_size, generator=g)
    index = torch.stack([torch.randperm(E + Z, generator=g)[:4] for _ in range(37)])
    weights = torch.rand(index.shape, generator=g)
    slot_of = torch.cat([torch.arange(E), torch.full((Z,), E)])  # identity ids: the sentinel
    with torch.no_grad():
        own = mod(hidden, index, weights)
        assert torch.equal(run_experts(mod, adapter.experts_layout, hidden, index, weights, views_of(tensors, E)), own)
        rows = [int((index < E).sum())]
        by_bank = grouped_experts(mod, adapter.experts_layout, hidden, index, weights, slot_of, [Bank(tensors, 0, E)],
                                  rows, identity_from=E)
        assert torch.equal(by_bank, own)
        assert not torch.equal(grouped_experts(mod, adapter.experts_layout, hidden, index, weights, slot_of,
                                               [Bank(tensors, 0, E)], rows), own)


@pytest.mark.parametrize("stack", [dict(eviction="score"), dict(miss="hybrid"),
                                   dict(routing={"name": "budget", "max_fraction": 0.25, "passes": "all"}),
                                   dict(routing={"name": "max_rank", "M": 6, "J": 1})])
def test_identity_experts_are_no_requests_under_any_stack(stack):
    """On LongCat-Flash (a third of its tiny router's picks are identity experts) every stack counts the router's
    own requests as the distinct experts with weights it chose, per call -- score-based eviction reads the E
    experts' columns, the hybrid miss's device time and a budget leave identity experts out."""
    from specmd.compose import spec_of
    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    model, adapter = tiny("longcat_flash"), adapter_for("longcat_flash")
    E = adapter.num_experts(model.config)
    ids = sample_ids(batch=2, seq=12)
    calls = []
    hooks = [adapter.router(model, i).register_forward_hook(lambda m, a, o: calls.append(o[2]))
             for i in adapter.moe_layers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    own = sum(len({e for e in c.reshape(-1).tolist() if e < E}) for c in calls)
    assert own < sum(len(set(c.reshape(-1).tolist())) for c in calls)  # (identity experts were chosen)
    spec = spec_of(**{"prefetch": "topk", "hardware": HardwareConfig(capacity=0.3), **stack})
    with install(model, spec, adapter) as s, torch.no_grad():
        model(ids)
        cache = s.engine.results()["cache"]
    assert cache["requests_router"] == own and cache["requests"] <= E * len(calls)


def test_a_trace_says_the_oldest_version_that_reads_it():
    """A version-2 reader drops rule fields it does not know (sqrt-softplus, hash-routed layers, identity
    experts) and would misread the selection: a trace that needs them is version 3, one that needs a version-2
    field 2, any other 1 (what every older specmd reads)."""
    from specmd.engine import Geometry
    from specmd.engine.record import Scoring
    from specmd.engine.store import StoreSizes
    from specmd.replay.trace import TraceMeta

    def version(scoring, identity=0):
        geom = Geometry(num_layers=1, num_experts=4, top_k=2, expert_bytes=100, total_bytes=800,
                        identity_experts=identity)
        return TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), scoring=scoring, logits="none").to_dict()["version"]

    assert version(Scoring(False, True, 1.0)) == 1 and version(Scoring(False, True, 1.0, given=True)) == 2
    assert version(Scoring(False, True, 1.0, hashed=(0,))) == 3 and version(Scoring(False, True, 1.0), 2) == 3
    assert version(Scoring(False, True, 1.0, sqrt_softplus=True, given=True)) == 3
