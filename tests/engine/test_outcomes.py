"""Miss outcomes as values (issue 59): an outcome is one verb of the layer call (``fetch``, ``drop``,
``substitute``, ``compute_on_host``), which sets the accounting and the execution plan together. Hand-worked
calls, one per outcome; then every registered miss policy and every routing policy on the tiny model, each
layer call's plan asked for its problems (:meth:`Execution.problems`) and the run's misses accounted for."""

import pytest
import torch
from tests.conftest import sample_ids, tiny

from specmd.compose import spec_of
from specmd.engine.cache import CacheManager
from specmd.engine.geometry import Geometry
from specmd.engine.link import TransferChannel
from specmd.engine.outcomes import Dropped, Fetched, HostComputed, Outcome, Substituted
from specmd.engine.record import LiveRecord, Scoring
from specmd.engine.simclock import Roofline, SimClock
from specmd.engine.store import StoreSizes
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.policies.eviction import EVICTION
from specmd.policies.miss import MISS
from specmd.policies.routing import ROUTING

INDEX = [[0, 1], [1, 2], [0, 3]]  # [T=3, k=2] of E=4 experts; expert 0 resident, 1, 2, 3 miss
WEIGHTS = [[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]]  # (exact in float32)


class Always:
    """A miss policy that answers ``outcome`` for every miss."""

    fetch_precision = "native"

    def __init__(self, outcome):
        self.outcome = outcome

    def passive(self):
        return False

    def handle(self, layer, missing, record, cache):
        return [self.outcome] * len(missing)


def served(outcome):
    """One decode layer call served with ``outcome`` for its misses: ``(manager, call)``."""
    geom = Geometry(num_layers=1, num_experts=4, top_k=2, expert_bytes=100, total_bytes=1000, hidden_size=0,
                    dtype_bytes=2, dense_params=[0], attn_layers=[0], tail_params=0, expert_params=0)
    clock = SimClock(geom, TransferChannel(1000.0, 0.0), Roofline(1e3, 1e15))
    m = CacheManager(geom, [400], [EVICTION.get("lru")()], Always(outcome), clock,
                     StoreSizes(16, 100, {"int4": 25}))
    m.insert(0, 0, 100, m.pools[0], None, False)
    rec = LiveRecord(0, torch.zeros(3, 4), torch.tensor(WEIGHTS), torch.tensor(INDEX), Scoring(False, False, 1.0))
    m.begin_pass("decode", 3, 3)
    return m, m.serve(0, [0, 1, 2, 3], rec)


def test_fetched_native_moves_every_miss_and_needs_no_plan():
    m, call = served(Fetched())
    assert call.execution is None and call.demanded == 3
    assert m.stats.fetched_by_precision == {"native": 3} and m.stats.bytes_demand[0] == 300
    assert (m.stats.hits[0], m.stats.misses[0]) == (1, 3) and sorted(m.entries) == [0, 1, 2, 3]


def test_fetched_at_a_stored_precision_moves_its_bytes_and_runs_at_it():
    m, call = served(Fetched("int4"))
    plan = call.execution
    assert plan.precisions == {1: "int4", 2: "int4", 3: "int4"} and plan.problems() == []
    assert m.stats.fetched_by_precision == {"int4": 3} and m.stats.bytes_demand[0] == 75
    assert (plan.slots, plan.n_run) == (6, 4)


def test_dropped_leaves_the_device_and_the_router_and_is_counted():
    m, call = served(Dropped())
    plan = call.execution
    assert plan.problems() == []
    assert plan.weights.tolist() == [[0.75, 0.0], [0.0, 0.0], [0.625, 0.0]]
    assert plan.kept.tolist() == [[True, False], [False, False], [True, False]]
    assert (plan.slots, plan.n_run, plan.expert_map.tolist()) == (2, 1, [0, -1, -1, -1])
    assert m.stats.dropped[0] == 3 and call.demanded == 0 and m.stats.bytes_demand[0] == 0


def test_host_computed_leaves_the_device_not_the_router_and_is_the_hosts_work():
    m, call = served(HostComputed())
    plan = call.execution
    assert plan.problems() == []
    assert plan.host == [1, 2, 3] and (call.host_slots, call.host_experts) == (4, 3)
    assert (plan.slots, plan.n_run, plan.expert_map.tolist()) == (2, 1, [0, -1, -1, -1])
    assert plan.kept.all() and plan.weights.tolist() == WEIGHTS
    assert m.stats.host_computed[0] == 3 and call.demanded == 0


def test_substituted_runs_the_resident_expert_with_the_missing_ones_weight():
    m, call = served(Substituted(torch.tensor([0, 0, 0])))
    plan = call.execution
    assert plan.problems() == []
    assert plan.index.tolist() == [[0, 0], [0, 0], [0, 0]] and plan.weights.tolist() == WEIGHTS
    assert plan.kept.tolist() == [[True, False], [False, False], [True, False]]
    assert (plan.slots, plan.n_run, plan.expert_map.tolist()) == (6, 1, [0, -1, -1, -1])
    assert m.stats.substituted[0] == 3 and call.demanded == 0


class HalfDropped(Outcome):
    """An outcome that edits the plan's fields by hand and forgets two of them (the old way)."""

    kind, stat = "half", "half_dropped"

    def serve(self, call, expert):
        plan = call.plan()
        plan.weights = plan.weights.masked_fill(plan.index == expert, 0)
        plan.n_run -= 1


def test_a_plan_with_a_field_left_behind_is_named():
    _, call = served(HalfDropped())
    assert call.execution.problems() == ["n_run 1, the expert map runs 4"]
    call.execution.expert_map[1:] = -1  # now the map agrees, but slots and the dropped slots do not
    assert call.execution.problems() == ["slots 6, the device runs 2",
                                         "a dropped expert's slot keeps its weight or stays the router's own"]


# ---- every registered policy on the tiny model -------------------------------------------------------

def checked(stack) -> list:
    """The stack's executor wrapped: each layer call's plan is asked for its problems before it runs."""
    inner, found = stack.executor, []

    class Checking:
        def __getattr__(self, name):
            return getattr(inner, name)

        def run(self, mod, hidden, index, weights, plan, rec=None):
            if plan is not None:
                found.append(plan.problems())
            return inner.run(mod, hidden, index, weights, plan, rec)

    stack.executor = Checking()
    return found


def run_checked(tmp_path, monkeypatch, miss, routing) -> tuple:
    """The tiny OLMoE (top-8 of 64) through one batch at a quarter of its experts: ``(plans' problems,
    summary)``."""
    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path))
    cls = MISS.get(miss["name"])
    lossy = any(p != "native" for p in cls.required_precisions(MISS.build(miss).params))
    model = tiny("olmoe")
    stack = install(model, spec_of(miss=miss, routing=routing, hardware=HardwareConfig(capacity=0.25),
                                   quant={"name": "hqq", "optimize": False} if lossy else None))
    found = checked(stack)
    with torch.no_grad(), stack:
        model(sample_ids(batch=2, seq=16))
    return found, stack.cache.stats.summary()


def misses_accounted_for(s: dict) -> bool:
    """Every miss is a late prefetch, a layer stream's, or one outcome's (fetched at a precision, dropped,
    substituted, computed on the host, or a policy's own counter)."""
    return s["misses"] == s["prefetch_late"] + s["stream_served"] + sum(s["miss_outcomes"].values())


def with_passes(registry, name) -> dict:
    params = getattr(registry.get(name), "Params", None)
    return {"name": name, **({"passes": "all"} if params and "passes" in vars(params()) else {})}


@pytest.mark.parametrize("name", MISS.names())
def test_every_miss_policy_leaves_consistent_plans_and_accounts_for_its_misses(name, tmp_path, monkeypatch):
    found, s = run_checked(tmp_path, monkeypatch, {"name": name}, "standard")
    assert all(p == [] for p in found), next(p for p in found if p)
    assert s["misses"] > 0 and misses_accounted_for(s)


@pytest.mark.parametrize("name", ROUTING.names())
def test_every_routing_policy_leaves_consistent_plans(name, tmp_path, monkeypatch):
    """Each routing policy with a miss policy that builds a plan on every call with a miss (drop, J = 0)."""
    found, s = run_checked(tmp_path, monkeypatch, {"name": "drop", "J": 0}, with_passes(ROUTING, name))
    assert found and all(p == [] for p in found), next((p for p in found if p), None)
    assert misses_accounted_for(s)
