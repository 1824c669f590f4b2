"""specmd/machine.py: the cores a run may use, and where a timed run's threads go (issue 56): the plan's
arithmetic on hand-worked core counts, its pinning applied and undone on this process's real threads, and an
offloaded run's threads where the plan put them."""

import os
import threading

import pytest
import torch

from specmd import machine
from specmd.machine import CorePlan, can_pin


def test_the_usable_cores_are_the_affinity_mask_within_the_cgroup_quota(tmp_path, monkeypatch):
    """cgroup v2: the smallest ``cpu.max`` of the process's group and its ancestors (``max``: none); v1:
    ``cfs_quota_us / cfs_period_us`` (-1: none); an unreadable file is no quota. The usable cores are the
    affinity mask's, at most the quota rounded down, at least 1 (issue 56: never os.cpu_count() alone)."""
    import os

    from specmd import machine as jobs

    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "a" / "cpu.max").write_text("150000 100000\n")
    (v2 / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert jobs.cgroup_cores(v2, "/a/b") == 1.5 and jobs.cgroup_cores(v2, "/") is None
    (v2 / "a" / "b" / "cpu.max").write_text("50000 100000\n")
    assert jobs.cgroup_cores(v2, "/a/b") == 0.5  # (the smallest along the path)
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert jobs.cgroup_cores(v1, "/") == 2.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert jobs.cgroup_cores(v1, "/") is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert jobs.cgroup_cores(v1, "/") is None
    mask = len(os.sched_getaffinity(0))
    for quota, want in ((None, mask), (0.5, 1), (1.5, min(mask, 1)), (64.0, mask)):
        monkeypatch.setattr(jobs, "cgroup_cores", lambda q=quota: q)
        assert jobs.usable_cores() == want, quota


@pytest.mark.parametrize("cores,kw,want", [
    # (threads, host_threads, host lane reserved): one core for the copy thread from two cores on
    (1, {}, (1, 1)),
    (2, {}, (1, 1)),
    (8, {}, (7, 7)),
    # a host lane of its own: half of what the copy thread leaves, the rest computes
    (2, {"host_lane": True}, (1, 1)),
    (8, {"host_lane": True}, (4, 3)),
    (16, {"host_lane": True}, (8, 7)),
    # no copy thread (the cores all compute)
    (4, {"copy_thread": False}, (4, 4)),
    # explicit settings are kept as given, even beyond the cores (oversubscribed: recorded as such)
    (2, {"threads": 2}, (2, 2)),
    (2, {"threads": 3, "host_threads": 2, "host_lane": True}, (3, 2)),
])
def test_the_plan_splits_the_jobs_cores_between_compute_copy_and_host(cores, kw, want):
    plan = CorePlan.plan(**{"threads": "auto", "host_threads": "auto", **kw}, cores=cores)
    assert (plan.threads, plan.host_threads) == want and plan.cores == cores
    assert not plan.pin and plan.compute == plan.copy == plan.host == ()


def test_pinned_roles_get_disjoint_cores_of_the_mask_while_there_are_enough(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {3, 5, 6, 9, 10, 12, 13, 14})
    p = CorePlan.plan(pin=True, host_lane=True, cores=8)  # 4 compute, 1 copy, 3 host
    assert (p.compute, p.copy, p.host) == ((3, 5, 6, 9), (10,), (12, 13, 14))
    p = CorePlan.plan(pin=True, cores=2)  # the 2-core VM: one compute core, one copy core
    assert (p.compute, p.copy, p.host) == ((3,), (5,), (3,))  # (inline: the host lane is the compute thread)
    p = CorePlan.plan(pin=True, cores=1)  # one core: everything on it
    assert (p.compute, p.copy) == ((3,), (3,))
    p = CorePlan.plan(threads=2, pin=True, cores=2)  # more threads than the job's cores: cycled, recorded as is
    assert (p.compute, p.copy) == ((3, 5), (3,))
    assert p.record() == {"threads": 2, "host_threads": 2, "pin": True, "cores": 2, "compute_cores": [3, 5],
                          "copy_cores": [3], "host_cores": None}


def test_the_core_budget_is_the_jobs_share_within_the_usable_cores():
    try:
        machine.set_core_budget(None)
        assert machine.core_budget() == (machine.usable_cores(), False)
        machine.set_core_budget(1, shared=True)
        assert machine.core_budget() == (1, True)
        machine.set_core_budget(10_000)  # (at most the usable cores)
        assert machine.core_budget() == (machine.usable_cores(), False)
    finally:
        machine.set_core_budget(None)


@pytest.mark.skipif(not can_pin() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux affinity and 2 cores")
def test_enter_pins_every_thread_and_helpers_pin_themselves_and_the_undo_restores_both():
    mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
    plan = CorePlan.plan(pin=True, cores=2)
    seen = {}

    def helper():
        plan.enter_helper("copy")
        seen["copy"] = os.sched_getaffinity(0)

    undo = plan.enter()
    try:
        assert os.sched_getaffinity(0) == set(plan.compute) and torch.get_num_threads() == plan.threads
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(t) == set(plan.compute) for t in tasks)  # (torch's pool threads too)
        t = threading.Thread(target=helper)
        t.start()
        t.join()
        assert seen["copy"] == set(plan.copy) and not set(plan.copy) & set(plan.compute)
    finally:
        undo()
    assert os.sched_getaffinity(0) == mask and torch.get_num_threads() == threads
    assert all(os.sched_getaffinity(int(t)) == mask for t in os.listdir("/proc/self/task"))


@pytest.mark.skipif(not can_pin() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux affinity and 2 cores")
def test_an_offloaded_run_puts_its_threads_where_its_plan_says_and_gives_them_back():
    """execution.pin=true: during the run the compute thread is on the plan's compute cores with its threads,
    the transfer thread on its copy core; after it, the process is as it was (a later install plans afresh)."""
    from tests.conftest import sample_ids, tiny

    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
    model = tiny("olmoe")
    spec = spec_of(hardware=HardwareConfig(capacity=0.25))
    spec.execution = EXECUTION.params({"name": "offload", "pin": True, "throttle": False})
    stack = install(model, spec)
    try:
        plan = stack.executor.thread_plan
        assert plan.pin and plan.threads == max(1, machine.core_budget()[0] - 1)
        with torch.no_grad():
            model.generate(sample_ids(1, 16), max_new_tokens=3, do_sample=False)
        assert os.sched_getaffinity(0) == set(plan.compute) and torch.get_num_threads() == plan.threads
        mover = stack.executor.mover._thread
        assert os.sched_getaffinity(mover.native_id) == set(plan.copy)
    finally:
        stack.remove()
    assert os.sched_getaffinity(0) == mask and torch.get_num_threads() == threads


@pytest.mark.skipif(machine.usable_cores() < 2, reason="a launcher's share below the cores needs 2 of them")
def test_pinning_is_refused_where_a_launcher_runs_jobs_side_by_side(tmp_path):
    """Two jobs of a launcher on one machine would pin their threads to the same first cores: refused before
    any model work, one line naming the way out; the same job alone (its share = the cores) runs pinned."""
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute
    from specmd.errors import ConfigError

    overrides = ["model=tiny", "eval.tasks=[]", "logger=none", "execution=offload", "execution.pin=true"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    try:
        with pytest.raises(ConfigError, match=r"execution.pin=true: the launcher runs other jobs .*hydra.launcher.n_jobs=1"):
            execute(cfg, run_dir=str(tmp_path / "shared"), overrides=overrides, threads=1)
        assert (tmp_path / "shared" / "failed.json").is_file() and not (tmp_path / "shared" / "results.json").exists()
        res = execute(cfg, run_dir=str(tmp_path / "alone"), overrides=overrides, threads=machine.usable_cores())
        assert res["provenance"]["machine"]["placement"]["pin"] is True
    finally:
        machine.set_core_budget(None)


@pytest.mark.parametrize("miss,lane", [("hybrid", True), ("cpu_compute", True), ("fetch", False)])
def test_a_host_lane_of_its_own_gets_its_threads_and_cores_only_where_the_miss_policy_computes_on_the_host(miss, lane):
    """host_compute=thread: a miss policy that may answer HostComputed gets a host lane in the plan (its own
    threads; pinned, its own cores), one that never does leaves its cores to compute (issue 56)."""
    from tests.conftest import tiny

    from specmd.compose import spec_of
    from specmd.executor import EXECUTION
    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    pin = can_pin() and len(os.sched_getaffinity(0)) >= 2
    model = tiny("olmoe")
    spec = spec_of(miss=miss, hardware=HardwareConfig(capacity=0.25))
    spec.execution = EXECUTION.params({"name": "offload", "host_compute": "thread", "host_threads": 1, "pin": pin})
    stack = install(model, spec)
    try:
        plan = stack.executor.thread_plan
        assert plan.host_lane is lane and plan == CorePlan.plan(host_threads=1, pin=pin, host_lane=lane)
        worker = stack.executor.host_worker
        got = worker.submit(lambda: (torch.get_num_threads(), os.sched_getaffinity(0) if pin else None)).result()
        assert got[0] == plan.host_threads
        if pin:
            assert got[1] == set(plan.host)
    finally:
        stack.remove()


@pytest.mark.skipif(not can_pin() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux affinity and 2 cores")
def test_a_plan_made_inside_a_pinned_one_divides_the_processs_cores_not_the_pinned_ones():
    """fidelity's cells and calibrate's installs plan inside the command's own pinned plan: they divide the
    process's mask (its copy thread on its own core), not the compute core the outer plan pinned them to."""
    usable = machine.usable_cores()
    outer = CorePlan.plan(pin=True)
    undo = outer.enter()
    try:
        assert machine.usable_cores() == usable and os.sched_getaffinity(0) == set(outer.compute)
        inner = CorePlan.plan(pin=True)
        assert inner == outer and not set(inner.copy) & set(inner.compute)
        undo_inner = inner.enter()
        undo_inner()
        assert os.sched_getaffinity(0) == set(outer.compute)  # (the inner undo gives back the outer's pinning)
    finally:
        undo()
    assert machine.process_mask() == os.sched_getaffinity(0)
