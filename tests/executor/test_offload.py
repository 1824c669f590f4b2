"""``execution=offload``: the experts kernel, outputs bit-identical to ``execution=simulated`` (every tiny
family, lossless and lossy stacks; deep_olmoe from host RAM and from disk), the arena following the engine's
residency byte for byte, failed transfers, the transfer thread's pacing and order, and bad configs."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import FAMILIES, ROOT, at_equal_threads, sample_ids, tiny
from specmd import CONF_DIR
from specmd.app import execute
from specmd.errors import ConfigError, DataError
from specmd.executor import EXECUTION
from specmd.executor.kernel import expert_tensors, run_experts, views_of
from specmd.executor.transfer import ThreadMover, Ticket, TransferError
from specmd.hardware import HardwareConfig
from specmd.models.adapters import ADAPTERS, adapter_for

ASSET = ROOT / "specmd" / "assets" / "deep-olmoe"


def spec_of(execution: dict, *, miss="fetch", routing="standard", eviction="lru", prefetch="topk", quant=None, **hw):
    from specmd.compose import spec_of

    spec = spec_of(miss=miss, eviction=eviction, prefetch=prefetch, routing=routing,
                        hardware=HardwareConfig(**hw), **({"quant": quant} if quant else {}))
    spec.execution = EXECUTION.params(at_equal_threads(execution))
    return spec


def run_stack(model, spec, ids, prefill_ids, adapter=None, checkpoint=None, new_tokens=5):
    """Greedy tokens and one more prefill's logits through the stack; (tokens, logits, engine results,
    executor results, executor)."""
    from specmd.hook import install

    with torch.no_grad():
        stack = install(model, spec, adapter, checkpoint=checkpoint)
        try:
            tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            logits = model(prefill_ids).logits
            engine, executor = stack.engine.results(), stack.executor.results()
        finally:
            stack.remove()
    return tokens, logits, engine, executor, stack.executor


# ---------------------------------------------------------------------------------------------------------
# 1. the kernel: grouped_mm's arithmetic, weights read from wherever each expert is
# ---------------------------------------------------------------------------------------------------------

def _layer_inputs(model, family, T, seed):
    adapter = ADAPTERS[family]
    mod = adapter.experts(model, adapter.moe_layers(model)[-1])
    E, k = adapter.num_experts(model.config), int(model.config.num_experts_per_tok)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, model.config.hidden_size, generator=g)
    index = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :k]  # k distinct experts per row
    weights = torch.rand(T, k, generator=g)
    return mod, adapter.experts_layout, E, hidden, index, weights


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 5, 33])
def test_kernel_equals_the_family_experts_forward(family, T):
    model = tiny(family)
    mod, layout, E, hidden, index, weights = _layer_inputs(model, family, T, seed=T)
    with torch.no_grad():
        ref = mod(hidden, index, weights)
        tensors = expert_tensors(mod, E)
        assert tensors and all(t.shape[0] == E for t in tensors.values())
        out = run_experts(mod, layout, hidden, index, weights, views_of(tensors, E))
        assert torch.equal(out, ref)
        # the views permuted into a bigger slot table (an arena): expert e's bytes in slot perm[e]
        g = torch.Generator().manual_seed(100 + T)
        slots = E + 7
        perm = torch.randperm(slots, generator=g)[:E].tolist()
        sources = {}
        for name, t in tensors.items():
            table = torch.randn(slots, *t.shape[1:], generator=g).to(t.dtype)  # other slots hold junk
            for e in range(E):
                table[perm[e]] = t[e]
            sources[name] = [table[perm[e]] for e in range(E)]
        assert torch.equal(run_experts(mod, layout, hidden, index, weights, sources), ref)
        # an expert that does not run here (None): its rows contribute zero, as a zero weight does
        gone = int(index[0, 0])
        sources = {n: [None if e == gone else v for e, v in enumerate(vs)] for n, vs in views_of(tensors, E).items()}
        zeroed = torch.where(index == gone, torch.zeros_like(weights), weights)
        assert torch.equal(run_experts(mod, layout, hidden, index, weights, sources), mod(hidden, index, zeroed))


def _banked_inputs(tensors, E, g, split: bool, gone: int):
    """The experts as banks: one arena with experts at permuted slots among junk (``split`` false), or even
    experts in bank A and odd ones in bank B; ``gone`` runs nowhere (the sentinel)."""
    from specmd.executor.kernel import Bank

    if not split:
        slots = E + 7
        perm = torch.randperm(slots, generator=g)[:E]
        bank = {n: torch.randn(slots, *t.shape[1:], generator=g).to(t.dtype) for n, t in tensors.items()}
        for n, t in tensors.items():
            bank[n][perm] = t
        slot_of = perm.clone()
        slot_of[gone] = slots
        return slot_of, [Bank(bank, 0, slots)]
    half = (E + 1) // 2
    A = {n: torch.zeros(half, *t.shape[1:], dtype=t.dtype) for n, t in tensors.items()}
    B = {n: torch.zeros(half, *t.shape[1:], dtype=t.dtype) for n, t in tensors.items()}
    slot_of = torch.empty(E, dtype=torch.long)
    for e in range(E):
        for n, t in tensors.items():
            (A if e % 2 == 0 else B)[n][e // 2] = t[e]
        slot_of[e] = e // 2 + (0 if e % 2 == 0 else half)
    slot_of[gone] = 2 * half
    return slot_of, [Bank(A, 0, half), Bank(B, half, half)]


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_kernel_over_banks_equals_the_family_experts_forward(family):
    """grouped_experts, both variants (one grouped GEMM per bank and projection; one GEMM per group), over an
    arena with permuted slots and over two banks with an expert that runs nowhere: the family's own experts
    forward, bit for bit (the dropped expert's weight zeroed), for prefill and decode shapes."""
    from specmd.executor.kernel import grouped_experts

    model = tiny(family)
    for T in (1, 5, 33):
        mod, layout, E, hidden, index, weights = _layer_inputs(model, family, T, seed=T)
        g = torch.Generator().manual_seed(200 + T)
        with torch.no_grad():
            tensors = expert_tensors(mod, E)
            for split in (False, True):
                gone = int(index[0, 0])
                slot_of, banks = _banked_inputs(tensors, E, g, split, gone)
                ref = mod(hidden, index, torch.where(index == gone, torch.zeros_like(weights), weights))
                counts = torch.bincount(index.reshape(-1), minlength=E)
                rows = [int(counts[(slot_of >= b.first) & (slot_of < b.first + b.n)].sum()) for b in banks]
                got = grouped_experts(mod, layout, hidden, index, weights, slot_of, banks, rows)
                assert torch.equal(got, ref), (family, T, split, (got - ref).abs().max())
                groups = []
                for b, n in zip(banks, rows):
                    if n:
                        mine = sorted((int(slot_of[e]) - b.first, int(counts[e])) for e in range(E)
                                      if counts[e] and b.first <= slot_of[e] < b.first + b.n)
                        ends = [sum(c for _, c in mine[:i + 1]) for i in range(len(mine))]
                        groups.append((ends, [sl for sl, _ in mine]))
                looped = grouped_experts(mod, layout, hidden, index, weights, slot_of, banks, rows, groups=groups)
                assert torch.equal(looped, ref), (family, T, split, "looped")


def test_a_signal_between_two_host_banks_leaves_the_call_as_itself(monkeypatch):
    """Two Ctrl-C 0.3 s apart during ``miss=hybrid`` printed ``AttributeError: 'NoneType' object has no attribute
    '_condition'``: the first landed between two banks' submits and the clean-up waited on the one never
    submitted. Now the call ends with the signal (Interrupted), after waiting -- with signals held, so a second
    one cannot tear the wait down -- for what the worker had started."""
    import specmd.executor.kernel as kernel
    from specmd.executor.hostwork import HostWorker
    from specmd.signals import SIGNALS, Interrupted

    model = tiny("olmoe")
    mod, layout, E, hidden, index, weights = _layer_inputs(model, "olmoe", 5, seed=1)
    with torch.no_grad():
        slot_of, banks = _banked_inputs(expert_tensors(mod, E), E, torch.Generator().manual_seed(3), True,
                                        int(index[0, 0]))
    counts = torch.bincount(index.reshape(-1), minlength=E)
    rows = [int(counts[(slot_of >= b.first) & (slot_of < b.first + b.n)].sum()) for b in banks]
    worker, started, held = HostWorker(), [], []

    class Interrupting:
        def submit(self, *a):
            raise Interrupted(signal.SIGINT)

    class Recording:
        def submit(self, *a):
            started.append(worker.submit(*a))
            return started[-1]

    banks[0].runner, banks[1].runner = Recording(), Interrupting()
    wait = kernel.futures_wait
    monkeypatch.setattr(kernel, "futures_wait", lambda fs: (held.append(SIGNALS.held), wait(fs))[1])
    try:
        with torch.no_grad(), pytest.raises(Interrupted):
            kernel.grouped_experts(mod, layout, hidden, index, weights, slot_of, banks, rows)
    finally:
        worker.close()
    assert len(started) == 1 and started[0].done() and held == [True] and SIGNALS.held is False


def test_kernel_with_no_expert_available_returns_zeros():
    model = tiny("olmoe")
    mod, layout, E, hidden, index, weights = _layer_inputs(model, "olmoe", 5, seed=0)
    sources = {n: [None] * E for n in expert_tensors(mod, E)}
    assert torch.equal(run_experts(mod, layout, hidden, index, weights, sources), torch.zeros_like(hidden))


# ---------------------------------------------------------------------------------------------------------
# 2. lossless and lossy stacks: offload (check=true) equals simulated bit for bit
# ---------------------------------------------------------------------------------------------------------

# kind -> (miss, routing, the engine counter showing the stack was lossy, or None)
KINDS = {
    "fetch": ("fetch", "standard", None),
    "drop": ({"name": "drop", "J": 1}, "standard", "dropped"),
    "substitute": ({"name": "substitute", "alpha": 1.0}, "standard", "substituted"),
    "cpu_compute": ("cpu_compute", "standard", "host_computed"),
    "prune": ("fetch", {"name": "prune", "h": 1}, None),
}
LOSSY = ["drop", "substitute", "cpu_compute", "prune"]
SCOPES = ["global", "per_layer"]
# the low capacity of each scope: 5% of the tiny Mixtral (4 layers x 8 experts) split into per-layer pools holds
# no expert (an error), 15% holds one per layer
LOW = {"global": 0.05, "per_layer": 0.15}


def _parity_cases():
    """Per family: fetch at both capacities (in different scopes) and two lossy kinds (each lossy kind on four
    families, at alternating capacities and scopes; substitute at 0.3, where resident experts are there to
    substitute with)."""
    cases = []
    for i, fam in enumerate(FAMILIES):
        cases.append((fam, "fetch", LOW[SCOPES[i % 2]], SCOPES[i % 2]))
        cases.append((fam, "fetch", 0.3, SCOPES[(i + 1) % 2]))
        for j, kind in enumerate((LOSSY[i % 4], LOSSY[(i + 1) % 4])):
            scope = SCOPES[(i + j) % 2]
            cap = 0.3 if kind == "substitute" else (LOW[scope], 0.3)[(i // 2 + j) % 2]
            cases.append((fam, kind, cap, scope))
    return cases


PARITY = _parity_cases()


def test_parity_cases_cover_every_family_and_kind():
    for fam in FAMILIES:
        assert any(c[0] == fam and c[1] == "fetch" for c in PARITY)
    for kind in KINDS:
        assert len({c[0] for c in PARITY if c[1] == kind}) >= 2, kind
    assert {c[2] for c in PARITY} == {0.05, 0.15, 0.3} and {c[3] for c in PARITY} == set(SCOPES)


@pytest.mark.parametrize("family,kind,capacity,scope", PARITY, ids=["-".join(map(str, c)) for c in PARITY])
def test_offload_equals_simulated(family, kind, capacity, scope):
    """Both kernels: the grouped one (a GPU's) on every other case, the looped one (a CPU's) on the rest."""
    model = tiny(family)
    adapter = adapter_for(family)
    miss, routing, counter = KINDS[kind]
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=capacity, scope=scope)
    sim = run_stack(model, spec_of({"name": "simulated"}, miss=miss, routing=routing, **hw), ids, prefill, adapter)
    kernel = ("grouped", "looped")[PARITY.index((family, kind, capacity, scope)) % 2]
    off = run_stack(model, spec_of({"name": "offload", "check": True, "kernel": kernel}, miss=miss, routing=routing,
                                   **hw), ids, prefill, adapter)
    assert torch.equal(off[0], sim[0]), (sim[0], off[0])
    assert torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2]  # the engine decided exactly the same (cache, timing, routing sections)
    cache, wall, memory = off[2]["cache"], off[3]["wall"], off[3]["memory"]
    # the stack is what it claims to be, and the copies were real
    if counter is not None:
        assert cache[counter] > 0, (counter, cache[counter])
    if kind == "prune":
        assert off[2]["routing"]["fidelity"] < 1.0
    assert wall["transfers"] > 0 and wall["bytes_moved"] == wall["transfers"] * memory["slot_bytes"]
    assert wall["host_computed_experts"] == cache["host_computed"]
    assert memory["arena_capacity_bytes"] == cache["capacity_bytes"]
    assert memory["arena_peak_bytes"] == cache["peak_bytes"] <= memory["arena_capacity_bytes"]
    assert memory["host"] == "ram" and memory["host_tier_bytes"] > 0 and memory["disk_bytes_read"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_offload_equals_simulated(family):
    """miss=hybrid splits misses between the link and the host worker (which computes its bank beside the
    device): the same outputs as the simulated run, bit for bit, with both ways taken. The profile makes one
    expert on the host cost about 1.5 transfers (so a layer call's misses alternate between the two)."""
    model = tiny(family)
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=0.15, scope="per_layer", host_expert_overhead_us=16.0)
    sim = run_stack(model, spec_of({"name": "simulated"}, miss="hybrid", **hw), ids, prefill, adapter_for(family))
    # the host's share on a worker thread (a GPU's host CPU) on every other family, inline (a CPU's) on the rest
    how = ("thread", "inline")[FAMILIES.index(family) % 2]
    off = run_stack(model, spec_of({"name": "offload", "check": True, "host_compute": how}, miss="hybrid", **hw), ids,
                    prefill, adapter_for(family))
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2]
    outcomes, wall = off[2]["cache"]["miss_outcomes"], off[3]["wall"]
    assert outcomes["host_computed"] > 0 and outcomes["fetched_native"] > 0, outcomes
    assert wall["host_computed_experts"] == outcomes["host_computed"] and wall["host_s"] > 0
    timing = off[2]["timing"]
    assert timing["host_busy_s"] > 0 and timing["link_busy_s"] > 0


# ---------------------------------------------------------------------------------------------------------
# 3. deep_olmoe from host RAM and from its checkpoint on disk
# ---------------------------------------------------------------------------------------------------------

def _deep_cfg(pretrained="specmd:deep-olmoe"):
    from specmd.models.loader import ModelConfig

    return ModelConfig(name="deep_olmoe", family="olmoe", pretrained=pretrained, dtype="float32")


@pytest.fixture(scope="module")
def deep():
    """(the deep_olmoe model fully loaded, the same with its experts on the meta device, prompt, prefill)."""
    from specmd.models.loader import load_model

    cfg = _deep_cfg()
    full, _ = load_model(cfg)
    dense, _ = load_model(cfg, experts_on_meta=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, full.config.vocab_size, (1, 12), generator=g)
    prefill = torch.randint(0, full.config.vocab_size, (1, 24), generator=g)
    with torch.no_grad():  # warm-up (see conftest.tiny)
        full(prefill)
    return full, dense, ids, prefill


@pytest.mark.parametrize("miss", ["fetch", "cpu_compute"])
def test_deep_olmoe_ram_and_disk_equal_simulated(deep, miss):
    """``cpu_compute`` from disk reads host copies on the compute thread while the transfer thread reads too
    (no ``check``: the run as a user has it)."""
    from specmd.models.loader import local_checkpoint

    full, dense, ids, prefill = deep
    check = miss == "fetch"
    hw = dict(capacity=0.05, miss=miss)
    sim = run_stack(full, spec_of({"name": "simulated"}, **hw), ids, prefill)
    ram = run_stack(full, spec_of({"name": "offload", "host": "ram", "check": check}, **hw), ids, prefill)
    ckpt = local_checkpoint(_deep_cfg().pretrained)
    assert ckpt is not None and Path(ckpt) == ASSET
    disk = run_stack(dense, spec_of({"name": "offload", "host": "disk", "check": check}, **hw), ids, prefill,
                     checkpoint=ckpt)
    for name, got in (("ram", ram), ("disk", disk)):
        assert torch.equal(got[0], sim[0]), (name, sim[0], got[0])
        assert torch.equal(got[1], sim[1]), (name, (got[1] - sim[1]).abs().max())
        assert got[2] == sim[2], name
    if miss == "cpu_compute":
        assert disk[3]["wall"]["host_computed_experts"] == sim[2]["cache"]["host_computed"] > 0
    mem = disk[3]["memory"]
    assert mem["host"] == "disk" and mem["host_tier_bytes"] == 0 and mem["disk_bytes_read"] > 0
    assert mem["page_cache"] == "drop"
    assert ram[3]["memory"]["host_tier_bytes"] > 0 and ram[3]["memory"]["disk_bytes_read"] == 0
    # the disk run's model never held its experts: they are on the meta device, and stay there
    experts = [p for n, p in dense.named_parameters() if ".experts." in n]
    assert experts and all(p.is_meta for p in experts)
    assert all(not p.is_meta for n, p in dense.named_parameters() if ".experts." not in n)


# ---------------------------------------------------------------------------------------------------------
# 4. the arena holds exactly the engine's resident set (random stacks, check=true)
# ---------------------------------------------------------------------------------------------------------

def _random_stack(seed):
    rnd = random.Random(seed)
    hw = dict(scope=rnd.choice(SCOPES), capacity=round(rnd.uniform(0.02, 0.5), 3))
    if rnd.random() < 0.35:
        hw["experts_per_layer"] = rnd.choice([1, 3, 8, 0.25])
    return dict(eviction=rnd.choice(["lru", "lfu", "fifo", "least_stale", "score"]),
                prefetch=rnd.choice(["none", "topk", "score"]),
                miss=rnd.choice(["fetch", "fetch", "cpu_compute", {"name": "drop", "J": 1}]), **hw)


@pytest.mark.parametrize("seed", range(12))
def test_arena_follows_the_engine_on_random_stacks(seed):
    model = tiny("olmoe")
    adapter = adapter_for("olmoe")
    kw = _random_stack(seed)
    ids, prefill = sample_ids(batch=1, seq=12, seed=seed), sample_ids(batch=2, seq=10, seed=seed + 50)
    # check=true: Offload.run asserts after every layer call that the slots are the engine's entries, pool by
    # pool, and that every arrived slot holds its expert's bytes
    off = run_stack(model, spec_of({"name": "offload", "check": True, "throttle": seed % 2 == 0,
                                    "kernel": ("grouped", "looped")[seed // 2 % 2]}, **kw), ids, prefill,
                    adapter, new_tokens=4)
    sim = run_stack(model, spec_of({"name": "simulated"}, **kw), ids, prefill, adapter, new_tokens=4)
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), kw
    assert off[2] == sim[2], kw
    cache, mem = off[2]["cache"], off[3]["memory"]
    assert mem["arena_capacity_bytes"] == cache["capacity_bytes"], kw
    assert mem["arena_peak_bytes"] <= mem["arena_capacity_bytes"], kw
    assert mem["arena_peak_bytes"] == cache["peak_bytes"], kw
    ex = off[4].placement
    assert mem["arena_slots"] * mem["slot_bytes"] <= mem["arena_capacity_bytes"] < \
        (mem["arena_slots"] + len(ex.pools)) * mem["slot_bytes"], kw
    assert sum(a.used for a in ex.pools) == sum(p.used for p in off[4].stack.cache.pools), kw
    held = sorted(k for k, o in enumerate(ex.at) if o >= 0)
    assert held == sorted(off[4].stack.cache.entries), kw
    for pi, arena in enumerate(ex.pools):  # free + held slots partition each pool's slots
        taken = [ex.at[k] for k in held if ex.pool_of_layer[k // ex.E] == pi]
        assert sorted(taken + arena.holes()) == list(range(arena.n)), kw


def test_check_residency_catches_a_wrong_slot():
    """The check itself: a slot overwritten behind the engine's back, or a slot the engine does not hold, fails it."""
    from specmd.hook import install

    model = tiny("olmoe")
    spec = spec_of({"name": "offload", "check": False, "throttle": False}, capacity=0.1)
    with torch.no_grad(), install(model, spec, adapter_for("olmoe")) as stack:
        model(sample_ids(batch=1, seq=8, seed=3))
        ex, place = stack.executor, stack.executor.placement
        for t in place.tickets:
            if t is not None:
                ex.mover.wait(t)
        ex.check_residency()
        key = next(k for k, o in enumerate(place.at) if o >= 0)
        layer, e = divmod(key, place.E)
        views = place.pools[place.pool_of_layer[layer]].views(place.at[key])
        saved = {n: v.clone() for n, v in views.items()}
        next(iter(views.values())).add_(1.0)
        with pytest.raises(AssertionError, match=f"layer {layer} expert {e}"):
            ex.check_residency()
        for n, v in views.items():
            v.copy_(saved[n])
        ex.check_residency()
        free_key = next(k for k, o in enumerate(place.at) if o < 0)
        place.at[free_key] = 0
        with pytest.raises(AssertionError, match="arena holds"):
            ex.check_residency(contents=False)
        place.at[free_key] = -1


# ---------------------------------------------------------------------------------------------------------
# 4b. stored low-precision copies: their own bytes move, into arena ranges of their size
# ---------------------------------------------------------------------------------------------------------

QUANT = {"name": "hqq", "optimize": False, "precisions": ["int8", "int4", "int2"]}
LOW = [(fam, ("fetch_lowest_bit", "fetch_priority")[i % 2], (0.05, 0.1)[(i // 2) % 2], SCOPES[i % 2])
       for i, fam in enumerate(FAMILIES)]


@pytest.mark.parametrize("family,miss,capacity,scope", LOW, ids=["-".join(map(str, c)) for c in LOW])
def test_low_precision_offload_equals_simulated(family, miss, capacity, scope):
    """Bit-packed copies (and fp16 scale/zero) move, are unpacked by the store's own function when they run:
    outputs and engine sections equal simulated's; the bytes moved are the engine's, precision by precision;
    check=true asserts after every layer call that each resident copy is at its precision, byte for byte."""
    model = tiny(family)
    adapter = adapter_for(family)
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=capacity, scope=scope, miss=miss, quant=QUANT)
    sim = run_stack(model, spec_of({"name": "simulated"}, **hw), ids, prefill, adapter)
    off = run_stack(model, spec_of({"name": "offload", "check": True}, **hw), ids, prefill, adapter)
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2]
    cache, wall, mem = off[2]["cache"], off[3]["wall"], off[3]["memory"]
    assert wall["bytes_moved"] == sum(cache["bytes_by_precision"].values())
    assert wall["low_precision_runs"] > 0 and mem["arena_layout"] == "mixed"
    assert mem["arena_peak_bytes"] == cache["peak_bytes"] <= mem["arena_capacity_bytes"] == cache["capacity_bytes"]
    if miss == "fetch_priority":  # several sizes share the pools
        assert len([p for p, b in cache["bytes_by_precision"].items() if b]) > 1


@pytest.mark.parametrize("family,how", [("olmoe", "inline"), ("mixtral", "thread")])
def test_hybrid_with_low_copies_offload_equals_simulated(family, how):
    """miss=hybrid with its third option (an int4 fetch for low-scored misses): fetched native copies, int4
    copies and host-computed experts in one run, offload == simulated bit for bit."""
    model = tiny(family)
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=0.15, scope="per_layer", host_expert_overhead_us=40.0, quant=QUANT,
              miss={"name": "hybrid", "low": "int4"})
    sim = run_stack(model, spec_of({"name": "simulated"}, **hw), ids, prefill, adapter_for(family))
    off = run_stack(model, spec_of({"name": "offload", "check": True, "host_compute": how}, **hw), ids, prefill,
                    adapter_for(family))
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2]
    outcomes = off[2]["cache"]["miss_outcomes"]
    assert outcomes["host_computed"] > 0 and outcomes["fetched_int4"] > 0 and outcomes["fetched_native"] > 0, outcomes
    assert off[3]["wall"]["low_precision_runs"] > 0


def test_deep_olmoe_lowest_bit_from_ram_equals_simulated(deep):
    full, _, ids, prefill = deep
    hw = dict(capacity=0.05, miss="fetch_lowest_bit", quant=QUANT)
    sim = run_stack(full, spec_of({"name": "simulated"}, **hw), ids, prefill)
    off = run_stack(full, spec_of({"name": "offload", "check": True}, **hw), ids, prefill)
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1])
    assert off[2] == sim[2]
    assert off[3]["wall"]["bytes_moved"] == off[2]["cache"]["bytes_by_precision"]["int2"] > 0


@pytest.mark.parametrize("miss", ["fetch", "fetch_lowest_bit"])
def test_experts_run_from_the_arena_bytes(miss):
    """Native and low-precision experts alike compute from what is in the arena: zero the arena behind the
    engine's back (every expert resident, so nothing is fetched again) and the same input gives other logits."""
    from specmd.hook import install

    model = tiny("olmoe")
    spec = spec_of({"name": "offload", "throttle": False}, capacity=1.0, prefetch="none", miss=miss, quant=QUANT)
    ids = sample_ids(batch=1, seq=12, seed=8)
    with torch.no_grad(), install(model, spec, adapter_for("olmoe")) as stack:
        model(ids)  # every expert fetched (at the miss policy's precision) and resident
        first = model(ids).logits
        place = stack.executor.placement
        assert stack.executor.mover.transfers == place.copies
        for a in place.pools:
            for t in ([a.buf] if a.mixed else a.tensors.values()):
                t.zero_()
        again = model(ids).logits
        assert not torch.equal(first, again)
        assert place.copies == stack.executor.mover.transfers  # nothing was fetched again


def _pattern(key, size):
    return (torch.arange(size, dtype=torch.int64) * 7 + key * 131).remainder(251).to(torch.uint8)


def test_arena_first_fit_merge_and_compaction():
    from specmd.executor.arena import ByteArena

    a = ByteArena(100, 20, "cpu")  # copies of >= 20 bytes: first-fit from the front
    assert [a.alloc(k, n) for k, n in ((1, 30), (2, 20), (3, 30))] == [0, 30, 50] and a.used == 80
    a.release(2)  # a 20-byte hole at 30, and 20 free at the end
    assert a.holes() == [(30, 20), (80, 20)]
    assert a.alloc(4, 30) is None  # 40 bytes free, no hole of 30: the engine would have admitted it
    a.buf[0:30], a.buf[50:80] = _pattern(1, 30), _pattern(3, 30)
    assert a.compact() == {3: 30} and a.holes() == [(60, 40)]
    assert torch.equal(a.buf[30:60], _pattern(3, 30)) and torch.equal(a.buf[0:30], _pattern(1, 30))
    assert a.alloc(4, 30) == 60
    a.release(3)
    a.release(1)  # merges with the hole before and after: one hole
    assert a.holes() == [(0, 60), (90, 10)]
    a.release(4)
    assert a.holes() == [(0, 100)] and a.used == 0


def test_arena_compaction_slides_the_cheapest_run_of_holes():
    """Three holes of 20, 15 and 15 bytes and a 30-byte copy needing a 30-byte hole: the first run that holds
    it (20 + 15, around a 30-byte copy) is not the cheapest (15 + 15, around a 10-byte copy). Only the cheaper
    run's copy moves: taking the first run opens a hole as large, moving 3x the bytes (30, not 10)."""
    from specmd.executor.arena import ByteArena

    a = ByteArena(100, 10, "cpu")  # every copy here is >= 10 bytes: first-fit from the front
    sizes = {1: 10, 2: 20, 3: 30, 4: 15, 5: 10, 6: 15}
    assert [a.alloc(k, n) for k, n in sizes.items()] == [0, 10, 30, 60, 75, 85]
    for k in (2, 4, 6):
        a.release(k)
    assert a.holes() == [(10, 20), (60, 15), (85, 15)] and a.alloc(7, 30) is None
    for k in (1, 3, 5):
        a.buf[a.live[k][0]:sum(a.live[k])] = _pattern(k, sizes[k])
    assert a.window(30) == (60, 100)
    assert a.compact(30) == {5: 60} and a.bytes_compacted == 10 and a.compactions == 1
    assert a.holes() == [(10, 20), (70, 30)] and a.alloc(7, 30) == 70
    assert {k: a.live[k][0] for k in (1, 3, 5)} == {1: 0, 3: 30, 5: 60}
    for k in (1, 3, 5):
        assert torch.equal(a.buf[a.live[k][0]:sum(a.live[k])], _pattern(k, sizes[k])), k


@pytest.mark.parametrize("seed", range(6))
def test_arena_random_operations_keep_every_copys_bytes(seed):
    """Random allocations and releases of mixed sizes whose bytes fit (as the engine admits them): an
    allocation that finds no hole succeeds after compaction; live ranges never overlap and each still holds
    its own bytes after every compaction."""
    from specmd.executor.arena import ByteArena

    rnd = random.Random(seed)
    cap = 4096
    a = ByteArena(cap, 256, "cpu")
    live = {}
    for step in range(400):
        if live and (rnd.random() < 0.45 or a.used > cap - 64):
            k = rnd.choice(list(live))
            a.release(k)
            del live[k]
            continue
        size = rnd.choice([64, 96, 128, 256, 320])
        if a.used + size > cap:
            continue
        off = a.alloc(step, size)
        if off is None:
            a.compact(size if step % 2 else None)  # partial (as the executor) or full
            off = a.alloc(step, size)
        assert off is not None, (step, a.used, a.holes())
        a.buf[off:off + size] = _pattern(step, size)
        live[step] = size
        spans = sorted(a.live.values()) + a.holes()
        spans.sort()
        assert all(x[0] + x[1] <= y[0] for x, y in zip(spans, spans[1:])), spans
        assert sum(n for _, n in spans) == cap
        for k, (o, n) in a.live.items():
            assert torch.equal(a.buf[o:o + n], _pattern(k, n)), k
    assert a.compactions > 0


# ---------------------------------------------------------------------------------------------------------
# 5. failed transfers: a truncated checkpoint, a missing expert
# ---------------------------------------------------------------------------------------------------------

def _ckpt_copy(tmp_path: Path, name="ckpt") -> Path:
    """deep-olmoe's checkpoint directory: the non-weight files symlinked, model.safetensors copied."""
    d = tmp_path / name
    d.mkdir()
    for f in ASSET.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).symlink_to(f)
    shutil.copyfile(ASSET / "model.safetensors", d / "model.safetensors")
    return d


def _data_start(path: Path) -> int:
    from specmd.executor.tiers import read_header

    return read_header(path)[1]


DISK_RUN = ["execution=offload", "execution.host=disk", "eval.tasks=[]", "eval.limit=1", "logger=none"]


def _execute(overrides, run_dir):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return execute(cfg, run_dir=str(run_dir), overrides=overrides)


def test_truncated_checkpoint_fails_the_cli_run_at_load(tmp_path):
    d = _ckpt_copy(tmp_path)
    st = d / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "specmd", f"model.pretrained={d}", *DISK_RUN,
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0, r.stdout[-2000:]
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.name not in (".hydra", "__main__.log")) == ["failed.json"]
    assert json.loads((run / "failed.json").read_text())["stage"] == "load"


def test_truncated_checkpoint_error_names_the_file(tmp_path):
    d = _ckpt_copy(tmp_path)
    st = d / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)
    run = tmp_path / "run"
    with pytest.raises(Exception) as exc:
        _execute([f"model.pretrained={d}", *DISK_RUN], run)
    assert sorted(p.name for p in run.iterdir()) == ["failed.json"]
    failed = json.loads((run / "failed.json").read_text())
    assert failed["stage"] == "load"
    assert isinstance(exc.value, DataError), repr(exc.value)
    assert str(st) in str(exc.value) or "model.safetensors" in str(exc.value), str(exc.value)


def test_missing_expert_tensor_fails_naming_layer_and_expert(tmp_path):
    """The dense weights load (experts are skipped on the meta device); the host tier, part of loading an
    offloaded model, finds the hole: stage ``load``."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ASSET.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).symlink_to(f)
    gone = "model.layers.3.mlp.experts.7.up_proj.weight"
    tensors = load_file(ASSET / "model.safetensors")
    del tensors[gone]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    del tensors
    run = tmp_path / "run"
    with pytest.raises(DataError) as exc:
        _execute([f"model.pretrained={d}", *DISK_RUN], run)
    msg = str(exc.value)
    assert gone in msg and "layer 3" in msg and "expert 7" in msg, msg
    assert sorted(p.name for p in run.iterdir()) == ["failed.json"]
    failed = json.loads((run / "failed.json").read_text())
    assert failed["stage"] == "load" and failed["kind"] == "data", failed["stage"]
    assert gone in failed["error"]


def test_disk_tier_truncated_after_construction_is_a_short_read(tmp_path):
    from specmd.executor.tiers import DiskTier

    d = _ckpt_copy(tmp_path)
    st = d / "model.safetensors"
    shapes = {"gate_up_proj": (64, 128), "down_proj": (128, 32)}
    tier = DiskTier(str(d), list(range(16)), shapes, torch.float32, 64, adapter_for("olmoe").hub_layout())
    try:
        dst = {n: torch.empty(s) for n, s in shapes.items()}
        tier.copy_into(15, 63, dst)  # whole: reads fine
        assert tier.bytes_read == 64 * 128 * 2 + 128 * 32 * 2  # bf16 on disk
        os.truncate(st, _data_start(st) + 16)
        with pytest.raises(DataError, match="short read") as exc:
            tier.copy_into(15, 63, dst)
        assert str(st) in str(exc.value) and "truncated" in str(exc.value)
    finally:
        tier.close()


def test_truncated_during_a_run_is_a_transfer_error(tmp_path):
    from specmd.hook import install
    from specmd.models.loader import load_model

    d = _ckpt_copy(tmp_path)
    st = d / "model.safetensors"
    model, _ = load_model(_deep_cfg(str(d)), experts_on_meta=True)
    spec = spec_of({"name": "offload", "host": "disk", "throttle": False}, capacity=0.05)
    stack = install(model, spec, checkpoint=str(d))  # the tier opens the file and checks its size here
    try:
        os.truncate(st, _data_start(st) + 16)
        with torch.no_grad(), pytest.raises(TransferError, match=r"model.layers.\d+ expert \d+") as exc:
            model(torch.arange(1, 9).unsqueeze(0))
        cause = exc.value.__cause__
        assert isinstance(cause, DataError) and str(st) in str(cause) and "short read" in str(cause)
    finally:
        stack.remove()


# ---------------------------------------------------------------------------------------------------------
# 6. the transfer thread: pacing, demand before prefetch, cancel, promote
# ---------------------------------------------------------------------------------------------------------

def _copy_job(n_floats=1 << 20):
    src, dst = torch.ones(n_floats), torch.empty(n_floats)
    return (lambda: dst.copy_(src)), src.numel() * src.element_size()


def test_throttled_copy_takes_latency_plus_bytes_over_bandwidth():
    B, L = 0.25e9, 4e-3
    job, nbytes = _copy_job()  # 4 MiB: 16.8 ms + 4 ms at this link
    m = ThreadMover(bandwidth_bytes_per_s=B, latency_s=L)
    try:
        t = m.submit(job, nbytes, demand=True, what="big")
        m.wait(t)
        took = t.finished - t.issued
        assert took >= nbytes / B + L, took
        assert took < nbytes / B + L + 1.0, took
        assert t.finished - t.started >= nbytes / B + L
        assert m.bytes_moved == nbytes and m.transfers == 1 and m.busy_s >= nbytes / B + L
    finally:
        m.close()
    fast = ThreadMover(bandwidth_bytes_per_s=None)
    try:
        best = float("inf")
        for _ in range(3):  # the best of three: a busy machine may deschedule the thread once
            t = fast.submit(job, nbytes, demand=True)
            fast.wait(t)
            best = min(best, t.finished - t.started)
        assert best < (nbytes / B + L) / 2, best
    finally:
        fast.close()


class _Gate:
    """A job that blocks the transfer thread until released (so later submissions queue behind it)."""

    def __init__(self, mover):
        self.running, self.release = threading.Event(), threading.Event()
        self.ticket = mover.submit(self._run, 0, demand=False, what="gate")
        assert self.running.wait(5)

    def _run(self):
        self.running.set()
        assert self.release.wait(5)


def test_demand_runs_before_queued_prefetch_and_cancel_and_promote():
    order = []

    def job(name):
        return lambda: order.append(name)

    m = ThreadMover(bandwidth_bytes_per_s=None)
    try:
        gate = _Gate(m)
        a = m.submit(job("A"), 10, demand=False)  # prefetch, queued first
        b = m.submit(job("B"), 10, demand=True)  # demand, queued second: runs first
        c = m.submit(job("C"), 10, demand=False)
        assert m.cancel(c) and c.state == Ticket.CANCELLED and c.done()
        assert not m.cancel(gate.ticket)  # running: cannot be cancelled
        gate.release.set()
        m.wait(a), m.wait(b)
        assert order == ["B", "A"] and b.finished <= a.started
        assert m.wait(c) == 0.0 and m.transfers == 3  # gate, B, A: the cancelled job never ran

        order.clear()
        gate = _Gate(m)
        p = [m.submit(job(f"P{i}"), 10, demand=False) for i in range(3)]
        m.promote(p[2])  # needed now: ahead of the earlier prefetches
        m.promote(gate.ticket)  # running: no effect
        gate.release.set()
        for t in p:
            m.wait(t)
        assert order == ["P2", "P0", "P1"]
        m.promote(p[0])  # done: no effect
        assert not m.cancel(p[0])

        order.clear()  # a promoted prefetch goes before demand jobs already queued: compute needs it first
        gate = _Gate(m)
        d = m.submit(job("D"), 10, demand=True)
        q = m.submit(job("Q"), 10, demand=False)
        m.promote(q)
        gate.release.set()
        m.wait(d), m.wait(q)
        assert order == ["Q", "D"]
    finally:
        m.close()


def test_failed_job_raises_transfer_error_naming_it():
    m = ThreadMover(bandwidth_bytes_per_s=None)
    try:
        def boom():
            raise DataError("/x/model.safetensors: short read")

        t = m.submit(boom, 10, demand=True, what="layer 2 expert 5")
        with pytest.raises(TransferError, match="layer 2 expert 5.*short read"):
            m.wait(t)
        with pytest.raises(TransferError):  # done already: still raises
            m.wait(t)
        ok = m.submit(lambda: None, 10, demand=True)  # the thread goes on
        m.wait(ok)
    finally:
        m.close()


def test_a_layer_calls_demand_fetches_go_as_one_job():
    """One channel job per layer call with demand misses (one hand-off to the transfer thread, not one per
    expert), counted as its experts; the outputs are the simulated run's."""
    model = tiny("olmoe")
    kw = dict(prefetch="none", capacity=0.3)
    ids, prefill = sample_ids(batch=1, seq=12, seed=4), sample_ids(batch=2, seq=10, seed=5)
    off = run_stack(model, spec_of({"name": "offload", "check": True, "throttle": False}, **kw), ids, prefill,
                    adapter_for("olmoe"), new_tokens=4)
    sim = run_stack(model, spec_of({"name": "simulated"}, **kw), ids, prefill, adapter_for("olmoe"), new_tokens=4)
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1])
    m, cache = off[4].mover, off[2]["cache"]
    calls = len(off[4].stack.moe_ids) * (4 + 1)  # MoE layers x (4 passes of the generation + 1 prefill)
    assert m.transfers == off[4].placement.copies == cache["misses"] > calls  # fetch: every miss is a demand fetch
    assert 0 < m.jobs <= calls


def test_a_batch_is_paced_as_its_transfers():
    B, L = 0.25e9, 4e-3
    job, nbytes = _copy_job(1 << 16)  # 256 KiB: 1 ms of bytes, 3 x 4 ms of latency
    m = ThreadMover(bandwidth_bytes_per_s=B, latency_s=L)
    try:
        t = m.submit(job, nbytes, demand=True, what="batch", count=3)
        m.wait(t)
        assert t.finished - t.started >= 3 * L + nbytes / B
        assert m.transfers == 3 and m.jobs == 1
    finally:
        m.close()


def _slot_holds(place, key):
    layer, e = divmod(key, place.E)
    views = place.pools[place.pool_of_layer[layer]].views(place.at[key])
    want = place.tier.host_views(layer, e)
    return all(torch.equal(views[n], want[n]) for n in place.names)


def test_demand_batch_eviction_before_and_after_submission():
    """Driving the executor's events by hand (layer 0's pool, all slots free): an expert evicted before its
    call's batch is submitted is never copied; one evicted while its batch is queued waits for the batch (a
    batch is never cancelled: its other experts' copies would be lost with it)."""
    from specmd.hook import install

    model = tiny("olmoe")
    spec = spec_of({"name": "offload", "throttle": False}, capacity=0.5)
    with install(model, spec, adapter_for("olmoe")) as stack:
        ex = stack.executor.placement
        m = ex.mover
        gate = _Gate(m)
        ex.inserted(1, 0, "native", False)
        ex.inserted(2, 0, "native", False)
        ex.evicted(1)  # pending: dropped from the batch
        ex.inserted(3, 0, "native", False)
        ex.flush()
        t = ex.tickets[2]
        assert t is ex.tickets[3] and t.count == 2 and ex.tickets[1] is None
        threading.Timer(0.2, gate.release.set).start()
        ex.evicted(2)  # its batch is queued behind the gate: waits, never cancels
        assert t.state == Ticket.DONE and _slot_holds(ex, 3)
        assert m.transfers == 1 + 2  # the gate, then experts 2 and 3: expert 1 was never copied
        ex.evicted(3)


# ---------------------------------------------------------------------------------------------------------
# 7. bad input: rejected before any model work
# ---------------------------------------------------------------------------------------------------------

BASE = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=64", "logger=none"]
BAD = [
    (["execution=offload", "replay.trace={trace}"], ["execution=offload", "replay.trace"]),
    (["execution=offload", "stack.enabled=false"], ["execution=offload", "stack.enabled=false"]),
    (["execution=offload", "hardware.timing_as=olmoe"], ["execution=offload", "hardware.timing_as=olmoe"]),
    (["execution=offload", "execution.host=disk", "model=deep_olmoe", "miss=fetch_lowest_bit"],
     ["execution.host=disk", "miss=fetch_lowest_bit", "execution.host=ram"]),
    (["execution=offload", "execution.host=disk", "model=tiny_olmoe"], ["execution.host=disk", "tiny_olmoe",
                                                                         "execution.host=ram"]),
    (["execution=offload", "execution.page_cache=keep"], ["execution.page_cache=keep", "host=disk"]),
    (["execution=offload", "execution.host=ssd"], ["ssd", "ram, disk"]),
    (["execution=offload", "execution.throttle=maybe"], ["throttle", "maybe", "true or false"]),
    (["execution=offload", "execution.kernel=fast"], ["kernel='fast'", "auto, grouped, looped"]),
    (["execution=offload", "execution.host_compute=gpu"], ["host_compute='gpu'", "auto, thread, inline"]),
    (["execution=offload", "execution.threads=0"], ["threads=0", "auto or whole numbers in 1..1024"]),
    (["execution=offload", "execution.threads=many"], ["threads='many'", "auto or whole numbers in 1..1024"]),
    # (torch crashes -- SIGSEGV -- creating 100,000 threads, before any failed.json: refused first)
    (["execution=offload", "execution.threads=100000"], ["threads=100000", "1..1024", "oversubscribed"]),
    (["execution=offload", "execution.host_threads=2"], ["host_threads=2", "host_compute=thread", "inline"]),
    (["execution=offload", "execution.host_compute=thread", "execution.host_threads=2"],
     ["host_threads=2", "miss=fetch computes no expert on the host"]),
    (["execution=offload", "execution.pin=maybe"], ["pin", "maybe", "true or false"]),
    (["miss=hybrid", "miss.low=int5"], ["low='int5'", "int4"]),
    (["miss=hybrid", "miss.percentile=120"], ["percentile=120", "[0, 100]"]),
]


@pytest.mark.parametrize("overrides,needles", BAD, ids=[" ".join(c[0]) for c in BAD])
def test_bad_offload_config_rejected_before_the_model_loads(overrides, needles, tmp_path, monkeypatch):
    import specmd.models.loader as loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded for a config error")

    monkeypatch.setattr(loader, "load_model", no_load)
    monkeypatch.setattr(loader, "load_dense", no_load)
    trace = ROOT / "tests" / "data" / "embedded_trace"
    overrides = [o.replace("{trace}", str(trace)) for o in overrides]
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as exc:
        _execute([*BASE, *overrides], run)
    msg = str(exc.value)
    assert all(n in msg for n in needles), msg
    assert sorted(p.name for p in run.iterdir()) == ["failed.json"]
    failed = json.loads((run / "failed.json").read_text())
    assert failed["stage"] == "config" and failed["kind"] == "config"
    assert msg.splitlines()[0] in failed["error"]


def test_unknown_execution_option_is_hydras_error_with_the_choices():
    from hydra.errors import MissingConfigException

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        with pytest.raises(MissingConfigException) as exc:
            compose(config_name="config", overrides=[*BASE, "execution=warp"])
    msg = str(exc.value) + " " + " ".join(getattr(exc.value, "options", None) or [])
    assert "execution/warp" in msg and "offload" in msg and "simulated" in msg, msg


def test_peak_rss_is_the_runs_own_not_its_launchers():
    """A run started by a process holding 3 GB (a benchmark with a model loaded, a sweep's launcher) reports its
    own peak RSS: Linux carries the parent's high-water mark into ru_maxrss across fork + exec."""
    held = torch.ones(3 << 28, dtype=torch.float32)  # 3 GiB, touched
    r = subprocess.run([sys.executable, "-c", "from specmd.executor.base import peak_rss_bytes; print(peak_rss_bytes())"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) < 2e9, (r.stdout, held.numel())


def test_copy_bytes_across_word_types():
    """A packed row (int64 words) into an arena range whose offset made its words int32 or int16 (the CUDA
    path's tensor copy; the CPU path memmoves): the bytes arrive whatever the two word types."""
    from specmd.executor.tiers import copy_bytes, words

    src = words(torch.arange(48, dtype=torch.uint8))  # int64[6]
    buf = torch.zeros(64, dtype=torch.uint8)
    for off in (4, 2, 8):
        dst = words(buf[off:off + 48])
        copy_bytes(dst, src)
        assert torch.equal(buf[off:off + 48], torch.arange(48, dtype=torch.uint8)), (off, dst.dtype)
        buf.zero_()


def test_a_slow_link_never_holds_a_stopping_run():
    """A throttled transfer on a slow link paces for minutes (1 kB/s: ~147 s per tiny expert); a run stopped by
    a signal or an error closes the mover, which must end the pacing at once (it waited out the link and
    ignored SIGTERM for 10 minutes), and a waiter blocked on the ticket must see the signal."""
    import signal
    import time

    class Stop(Exception):
        pass

    m = ThreadMover(bandwidth_bytes_per_s=1000.0)
    slow = m.submit(lambda: None, nbytes=147_456, demand=True, what="layer 0 expert 0")
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(Stop()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.perf_counter()
        with pytest.raises(Stop):
            m.wait(slow)  # the handler runs while the waiter blocks
        assert time.perf_counter() - t0 < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    t0 = time.perf_counter()
    m.close()  # the paced transfer is 147 s from done
    assert time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------------------------------------------------
# 8. the seam, the read-back, the double buffer
# ---------------------------------------------------------------------------------------------------------

def test_the_engine_declares_the_pools_and_one_residency_subscriber():
    from specmd.engine.events import PoolLayout, ResidencyEvents
    from specmd.hook import install

    model = tiny("olmoe")
    for scope, pools in (("global", 1), ("per_layer", 4)):
        spec = spec_of({"name": "offload", "throttle": False}, capacity=0.3, scope=scope)
        with install(model, spec, adapter_for("olmoe")) as stack:
            cache = stack.cache
            layout = cache.layout()
            assert isinstance(layout, PoolLayout) and len(layout.capacities) == pools
            assert layout.capacities == tuple(p.capacity for p in cache.pools)
            assert layout.pool_of_layer == ((0,) * 4 if pools == 1 else (0, 1, 2, 3)) and layout.num_experts == 64
            assert layout.layers_of(0) == ([0, 1, 2, 3] if pools == 1 else [0])
            assert cache.events is stack.executor.placement
            with pytest.raises(RuntimeError, match="already has a residency subscriber"):
                cache.subscribe(ResidencyEvents())
            cache.subscribe(stack.executor.placement)  # the same one again: nothing changes


def test_readback_packs_a_calls_tensors_into_one_host_buffer_per_layer():
    from specmd.hook.readback import Readback

    rb = Readback(torch.device("cpu"), 2)
    idx = torch.tensor([[3, 1], [0, 2]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.bfloat16)
    logits = torch.randn(2, 5)
    out = rb(0, [idx, w, logits])
    assert [t.dtype for t in out] == [torch.int64, torch.bfloat16, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(out, (idx, w, logits)))
    assert all(t.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr() for t in out)  # one buffer
    assert rb.calls == 1 and rb.bytes == 2 * (16 + 4 + 20)
    other = rb(1, [idx + 1, w])  # another layer: its own buffer, layer 0's record stays valid
    assert torch.equal(out[0], idx) and torch.equal(other[0], idx + 1)
    again = rb(0, [idx * 2, w, logits])  # layer 0's next call reuses its buffer (records are per layer)
    assert torch.equal(out[0], idx * 2) and again[0].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()


def test_streamed_experts_go_through_a_double_buffer_each_bank_acquired_before_it_computes():
    """A call that streams experts submits the arena's copies and each stream bank's as separate jobs, and the
    kernel acquires each bank's copies just before that bank computes: arena first, then stream bank 0, then
    stream bank 1 (whose copies may still be landing while bank 0 computes). Outputs stay the simulated run's."""
    from specmd.hook import install

    model = tiny("olmoe")
    spec = spec_of({"name": "offload", "throttle": False, "check": True}, capacity=0.04, prefetch="none")
    order = []
    with torch.no_grad(), install(model, spec, adapter_for("olmoe")) as stack:
        place = stack.executor.placement
        ready = place.ready

        def spy(bank):
            names = {id(place._arena_bank): "arena", id(place.stream_banks[0]): "stream0",
                     id(place.stream_banks[1]): "stream1"}
            order.append((names.get(id(bank), "other"), list(bank.tickets)))
            ready(bank)

        place.ready = spy
        tokens = model.generate(sample_ids(batch=1, seq=12, seed=3), max_new_tokens=3, do_sample=False)
        jobs = stack.executor.mover.jobs
        streamed = stack.engine.results()["cache"]
    sim = run_stack(model, spec_of({"name": "simulated"}, capacity=0.04, prefetch="none"),
                    sample_ids(batch=1, seq=12, seed=3), sample_ids(batch=1, seq=4, seed=4), new_tokens=3)
    assert torch.equal(tokens, sim[0])
    # a prefill at 4% streams most of a layer's experts: both stream banks, each with its own job
    names = [n for n, _ in order]
    assert "stream1" in names, names
    i = names.index("stream1")
    assert names[i - 1] == "stream0", names  # bank 0 computes before bank 1's copies are waited for
    assert "arena" in names, names
    assert len(order[i][1]) == len(order[i - 1][1]) == 1  # one job per stream bank, acquired by its own bank
    assert order[i][1][0] is not order[i - 1][1][0]  # two jobs: bank 1's copies may land after bank 0 computes
    assert jobs > len(stack.moe_ids)  # more than one job per layer call when it streams
    assert streamed["misses"] > 0


def test_a_block_that_passes_its_experts_another_selection_is_read_as_passed():
    """No family's block changes what its router returned before calling the experts; if one did, the engine
    and the executor read the selection the block passes (a second read-back) and outputs stay the simulated
    run's."""
    from specmd.hook import install
    from specmd.hook.stack import SpecmdExperts

    model = tiny("olmoe")
    ids = sample_ids(batch=1, seq=8, seed=6)
    forward = SpecmdExperts.forward
    outs = {}
    try:
        SpecmdExperts.forward = lambda self, h, index, weights: forward(self, h, index.clone(), weights.clone())
        for name in ("simulated", "offload"):
            spec = spec_of({"name": name, **({"check": True} if name == "offload" else {})}, capacity=0.2,
                           prefetch="none")
            with torch.no_grad(), install(model, spec, adapter_for("olmoe")) as stack:
                outs[name] = model.generate(ids, max_new_tokens=3, do_sample=False)
                assert stack.readback.calls > 0
    finally:
        SpecmdExperts.forward = forward
    assert torch.equal(outs["offload"], outs["simulated"])


def test_grouped_kernel_with_one_slot_and_a_dropped_expert():
    """One slot id in all (histc over a single bin takes the data's range: the sentinel must not count)."""
    from specmd.executor.kernel import Bank, grouped_experts

    model = tiny("olmoe")
    mod, layout, E, hidden, index, weights = _layer_inputs(model, "olmoe", 1, seed=9)
    with torch.no_grad():
        tensors = expert_tensors(mod, E)
        keep = int(index[0, 0])
        bank = Bank({n: t[keep:keep + 1].clone() for n, t in tensors.items()}, 0, 1)
        slot_of = torch.full((E,), 1, dtype=torch.long)
        slot_of[keep] = 0
        ref = mod(hidden, index, torch.where(index == keep, weights, torch.zeros_like(weights)))
        got = grouped_experts(mod, layout, hidden, index, weights, slot_of, [bank], [1])
    assert torch.equal(got, ref)
    from specmd.executor.kernel import group_ends

    assert group_ends(torch.tensor([0, 1, 1, 1]), 1).tolist() == [1]  # not 4: the sentinel rows are out
    assert group_ends(torch.tensor([0, 2, 2, 3]), 3).tolist() == [1, 1, 3]
