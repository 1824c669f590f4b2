"""The CUDA branches on a CPU (``specmd.accel.StandIn``): its stream and event semantics, the CUDA mover's
order of copies and waits, offload == simulated with every copy deferred until a wait (a missing wait is a
wrong bit), the read-back's one synchronisation per layer call, calibrate's CUDA timings (a copy timed to
where it lands), and every CUDA call kind executed by the default selection."""

import ast
import re
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import FAMILIES, ROOT, sample_ids, tiny
from specmd.accel import ENV, StandIn, accel_for, stand_in
from specmd.executor.transfer import CudaMover, ThreadMover, make_mover
from specmd.models.adapters import adapter_for
from tests.executor.test_offload import QUANT, run_stack, spec_of


# ---- the stand-in itself --------------------------------------------------------------------------------------
def test_a_side_stream_copy_lands_only_when_waited_for():
    a = StandIn()
    side = a.Stream()
    src, dst = torch.arange(8.0), torch.zeros(8)
    ev = a.Event(timing=True)
    with a.stream(side):
        a.copy_(dst, src)
        ev.record()
    assert a.current_stream() is a.compute  # (the context was this thread's only)
    assert not ev.query() and torch.equal(dst, torch.zeros(8)) and a.pending() == 1
    a.compute.wait_event(ev)  # the compute stream waits: the copy lands
    assert ev.query() and torch.equal(dst, src) and a.pending() == 0
    assert [e[0] for e in a.log] == ["stream", "copy", "record", "wait", "land"]


def test_a_compute_copy_is_eager_and_a_blocking_copy_keeps_stream_order():
    a = StandIn()
    side = a.Stream()
    x, y = torch.zeros(4), torch.zeros(4)
    a.copy_(x, torch.ones(4))  # compute stream: at once
    assert torch.equal(x, torch.ones(4))
    with a.stream(side):
        a.copy_(y, torch.full((4,), 2.0))
        a.copy_(y, torch.full((4,), 3.0), blocking=True)  # lands after the queued one, before returning
    assert torch.equal(y, torch.full((4,), 3.0)) and a.pending() == 0


def test_a_side_stream_waiting_on_compute_runs_nothing_and_the_device_sync_lands_everything():
    a = StandIn()
    s1, s2 = a.Stream(), a.Stream()
    d1, d2 = torch.zeros(2), torch.zeros(2)
    mark = a.Event()
    mark.record(a.compute)
    with a.stream(s1):
        s1.wait_event(mark)
        a.copy_(d1, torch.ones(2))
    with a.stream(s2):
        a.copy_(d2, torch.ones(2))
    assert a.pending() == 2
    a.synchronize()
    assert torch.equal(d1, torch.ones(2)) and torch.equal(d2, torch.ones(2)) and a.pending() == 0


def test_elapsed_time_needs_both_events_completed():
    a = StandIn()
    side = a.Stream()
    start, end = a.Event(timing=True), a.Event(timing=True)
    with a.stream(side):
        start.record(side)
        a.copy_(torch.zeros(4), torch.ones(4))
        end.record(side)
    with pytest.raises(RuntimeError, match="not completed"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


def test_accel_for_is_none_on_a_cpu_unless_the_stand_in_is_on(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert accel_for("cpu") is None
    with stand_in() as a:
        assert accel_for("cpu") is a and accel_for(torch.device("cpu")) is a
        assert isinstance(make_mover("cpu", None), CudaMover)
    assert accel_for("cpu") is None and isinstance(make_mover("cpu", None), ThreadMover)


# ---- the CUDA mover ----------------------------------------------------------------------------------------------
def test_cuda_mover_copies_wait_for_the_mark_and_compute_waits_for_the_copies():
    """A job's copies are issued on the side stream after it waited for the submitter's mark (the kernels that
    may read the slot it overwrites), and land only when compute acquires the ticket (the event it waits on)."""
    with stand_in() as a:
        m = make_mover("cpu", None)
        try:
            src, dst = torch.arange(16.0), torch.zeros(16)
            mark = m.mark()
            t = m.submit(lambda: a.copy_(dst, src), 64, True, "layer 0 expert 3", after=mark)
            m.wait(t)  # done = issued
            assert t.event is not None and torch.equal(dst, torch.zeros(16))
            m.acquire(t)
            assert torch.equal(dst, src)
            kinds = [(e[0], e[1]) for e in a.log]
            side = m.stream.id
            i_wait, i_copy = kinds.index(("wait", side)), kinds.index(("copy", side))
            i_acq = kinds.index(("wait", a.compute.id))
            assert a.log[i_wait][2] == mark.id and i_wait < i_copy < i_acq  # WAR fence, copy, RAW fence
            assert kinds.index(("land", side)) > i_acq
            t2 = m.submit(lambda: a.copy_(dst, src * 2), 64, True)  # no mark: waits for all compute so far
            m.acquire(t2)
            assert ("wait_stream", side) in [(e[0], e[1]) for e in a.log] and torch.equal(dst, src * 2)
        finally:
            m.close()
        assert a.pending() == 0 and m.copy_s >= 0.0 and m.transfers == 2


def test_throttled_cuda_mover_waits_for_its_copies_on_the_transfer_thread():
    with stand_in() as a:
        m = make_mover("cpu", 1e9, 0.0)
        try:
            dst = torch.zeros(1 << 16)
            t = m.submit(lambda: a.copy_(dst, torch.ones(1 << 16)), 1 << 18, True)
            m.wait(t)
            assert torch.equal(dst, torch.ones(1 << 16))  # (paced from the copy's real end: it has landed)
            assert a.count("sync", "event") >= 1 and threading.current_thread() is threading.main_thread()
        finally:
            m.close()


def test_landed_is_where_the_copies_have_landed():
    """calibrate times a copy to :meth:`Mover.landed`: on CUDA a done job was only issued (timed to there, an
    H200's link came out at 9e4 GB/s)."""
    with stand_in() as a:
        m = make_mover("cpu", None)
        try:
            dst = torch.zeros(64)
            t = m.submit(lambda: a.copy_(dst, torch.ones(64)), 256, True)
            when = m.landed(t)
            assert torch.equal(dst, torch.ones(64)) and when >= t.finished
        finally:
            m.close()


# ---- the executor and the read-back on the stand-in -----------------------------------------------------------
STANDIN_CASES = [(fam, ("grouped", "looped")[i % 2]) for i, fam in enumerate(FAMILIES)]


@pytest.mark.parametrize("family,kernel", STANDIN_CASES)
def test_offload_on_the_stand_in_equals_simulated(family, kernel):
    """Every expert copy deferred until compute waits for it: the outputs are still the simulated run's, bit
    for bit (a kernel reading a slot before its copy's event would read the evicted expert's bytes)."""
    model = tiny(family)
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=0.15, scope="per_layer")
    sim = run_stack(model, spec_of({"name": "simulated"}, **hw), ids, prefill, adapter_for(family))
    with stand_in() as a:
        off = run_stack(model, spec_of({"name": "offload", "check": True, "kernel": kernel, "host_compute": "inline",
                                        "throttle": False},
                                       **hw), ids, prefill, adapter_for(family))
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2]
    assert a.count("copy") > 0 and a.count("land") > 0 and a.pending() == 0
    assert off[3]["wall"]["transfers"] > 0


def test_a_missing_wait_is_a_wrong_bit(monkeypatch):
    """The stand-in has teeth: the CUDA mover without its compute-stream wait reads slots before their copies
    land, and offload stops equalling simulated."""
    model = tiny("olmoe")
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=0.15, scope="per_layer")
    sim = run_stack(model, spec_of({"name": "simulated"}, **hw), ids, prefill, adapter_for("olmoe"))
    monkeypatch.setattr(CudaMover, "acquire", lambda self, t: ThreadMover.acquire(self, t))  # no wait_event
    with stand_in():
        off = run_stack(model, spec_of({"name": "offload", "host_compute": "inline", "throttle": False}, **hw), ids, prefill,
                        adapter_for("olmoe"))
    assert not (torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]))


@pytest.mark.parametrize("miss,how", [("hybrid", "thread"), ("cpu_compute", "thread"), ("fetch_lowest_bit", "inline")])
def test_host_lane_and_low_copies_on_the_stand_in_equal_simulated(miss, how):
    model = tiny("mixtral")
    ids, prefill = sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2)
    hw = dict(capacity=0.15, scope="per_layer", host_expert_overhead_us=16.0)
    quant = QUANT if miss == "fetch_lowest_bit" else None
    sim = run_stack(model, spec_of({"name": "simulated"}, miss=miss, quant=quant, **hw), ids, prefill,
                    adapter_for("mixtral"))
    with stand_in() as a:
        off = run_stack(model, spec_of({"name": "offload", "check": True, "host_compute": how, "throttle": False}, miss=miss, quant=quant,
                                       **hw), ids, prefill, adapter_for("mixtral"))
    assert torch.equal(off[0], sim[0]) and torch.equal(off[1], sim[1]), (off[1] - sim[1]).abs().max()
    assert off[2] == sim[2] and a.pending() == 0


def test_readback_waits_once_per_layer_call_on_the_stand_in():
    from specmd.hook.readback import Readback

    with stand_in() as a:
        rb = Readback(torch.device("cpu"), 2)
        idx = torch.tensor([[3, 1], [0, 2]])
        w = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.bfloat16)
        out = rb(0, [idx, w])
        assert rb.cuda and rb._dev is not None  # the device staging buffer: the CUDA branch
        assert all(torch.equal(x, y) for x, y in zip(out, (idx, w)))
        rb(1, [idx + 1, w])
        assert a.count("sync", "event") == 2 and a.count("pin") == 2  # one wait per call; each layer's host buffer


def test_a_generation_waits_for_the_device_once_per_layer_call_and_twice_per_pass():
    """The log's twin of gpu_check's section 5 (torch.profiler on a GPU: 1 event synchronisation per MoE layer
    call, the pass's two device synchronisations)."""
    model = tiny("olmoe")
    with stand_in() as a:
        off = run_stack(model, spec_of({"name": "offload", "host_compute": "inline", "throttle": False}, capacity=0.15),
                        sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2), adapter_for("olmoe"))
    executor = off[4]
    calls = executor.stack.readback.calls
    passes = len(executor.pass_wall)
    assert calls > 0 and a.count("sync", "event") == calls
    assert a.count("sync", "device") == 2 * passes


# ---- calibrate's CUDA timings -------------------------------------------------------------------------------
def test_calibrate_times_the_link_to_where_copies_land_on_the_stand_in():
    """Each copy calibrate times has landed before the clock stops (on CUDA a done job's copies were only
    issued: timed to there, an H200's link came out at 9.4e4 GB/s): in the stand-in's log every timed copy is
    followed by its landing before the next copy is issued; the contention stage waits for the side stream
    before each of its two timings."""
    from specmd.commands.calibrate.measure import measure_contention, measure_ram_link

    with stand_in() as a:
        bw, lat = measure_ram_link(torch.device("cpu"), reps=1, sizes=(64 << 10, 1 << 20), source_bytes=8 << 20,
                                   rounds=1)
        kinds = [e[0] for e in a.log if e[0] in ("copy", "land")]
        assert kinds and kinds == ["copy", "land"] * (len(kinds) // 2), kinds[:8]
        assert bw > 0 and lat >= 0.0
        del a.log[:]
        c, rep = measure_contention(torch.device("cpu"), {"bandwidth_gbps": 10.0}, reps=1)
        assert 0.0 <= c <= 1.0 and rep["link_ms"] > 0
        assert a.count("sync", "stream") >= 2 * 2  # (warm-up and one repetition: the link alone, then both)
        assert a.pending() == 0


def test_every_cuda_call_kind_runs_in_the_default_selection():
    """The CUDA branches, by the stand-in's log: a run of the offload executor with its pinned tiers, marks,
    events, read-back and syncs."""
    kinds = set()
    with stand_in() as a:
        model = tiny("olmoe")
        off = run_stack(model, spec_of({"name": "offload", "check": True, "host_compute": "inline"}, capacity=0.15),
                        sample_ids(batch=1, seq=8, seed=1), sample_ids(batch=1, seq=16, seed=2), adapter_for("olmoe"))
        kinds |= {(e[0], e[1] if e[0] == "sync" else None) for e in a.log}
        assert off[3]["wall"]["transfers"] > 0
    want = {("stream", None), ("copy", None), ("record", None), ("wait", None), ("wait_stream", None),
            ("land", None), ("pin", None), ("sync", "event"), ("sync", "device"), ("sync", "stream")}
    assert want <= kinds, want - kinds


# ---- every CUDA branch runs in the default selection ------------------------------------------------------------
CUDA_FILES = ("specmd/executor/transfer.py", "specmd/executor/tiers.py", "specmd/executor/placement.py",
              "specmd/executor/base.py", "specmd/executor/offload.py", "specmd/hook/readback.py",
              "specmd/commands/calibrate/measure.py", "specmd/commands/calibrate/command.py", "specmd/machine.py")
ON = re.compile(r"accel is not None|\bself\.cuda\b|^(self\._)?accel$|^ac$")  # the test of a CUDA branch
OFF = re.compile(r"^(self\.|self\._)?accel is None$")  # ... of a CPU branch (its else is CUDA's)


def cuda_only_lines(path: Path) -> set:
    """The statement lines only a CUDA device (or its stand-in) runs: the class :class:`CudaMover`, the body of an
    ``if`` on the accelerator, the ``else`` of an ``if accel is None`` -- and, after an ``if accel is None:``
    that returns, the rest of its block (derived from the source: a new CUDA branch is counted by itself)."""
    tree = ast.parse(path.read_text())
    lines: set = set()

    def stmts(body):  # the first line of every statement in ``body`` (what a line tracer sees run)
        for s in body:
            lines.update(n.lineno for n in ast.walk(s) if isinstance(n, ast.stmt))

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CudaMover":
            for f in node.body:
                if isinstance(f, ast.FunctionDef):
                    stmts(f.body[1:] if ast.get_docstring(f) else f.body)
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, s in enumerate(block):
                if not isinstance(s, ast.If):
                    continue
                test = ast.unparse(s.test)
                if ON.search(test):
                    stmts(s.body)
                elif OFF.search(test):
                    stmts(s.orelse)
                    if s.body and isinstance(s.body[-1], ast.Return):
                        stmts(block[i + 1:])
    return lines


def _cuda_scenarios(tmp_path):
    """Every CUDA path, each once, on the stand-in: the offload executor (unthrottled and throttled, the host lane,
    stored low-precision copies, the contents check), the disk tier's bounce buffer, the read-back, the mover's
    timing and landing, calibrate's stages and the speed probe."""
    from specmd.commands.calibrate.command import thread_plan
    from specmd.commands.calibrate.measure import (measure_compute, measure_contention, measure_host_experts,
                                                   measure_ram_link)
    from specmd.executor.tiers import DiskTier
    from specmd.hook.readback import Readback
    from specmd.machine import speed_probe
    from tests.executor.test_offload import _ckpt_copy

    cpu = torch.device("cpu")
    with stand_in() as a:
        for execution, kw in (({"throttle": False, "kernel": "grouped"}, {}), ({"kernel": "looped"}, {}),
                              ({"throttle": False, "host_compute": "thread"}, dict(miss="hybrid")),
                              ({"throttle": False}, dict(miss="fetch_lowest_bit", quant=QUANT))):
            run_stack(tiny("olmoe"), spec_of({"name": "offload", "check": True, **execution}, capacity=0.15, **kw),
                      sample_ids(batch=1, seq=6, seed=1), sample_ids(batch=1, seq=8, seed=2), adapter_for("olmoe"),
                      new_tokens=3)
        shapes = {"gate_up_proj": (64, 128), "down_proj": (128, 32)}
        tier = DiskTier(str(_ckpt_copy(tmp_path)), list(range(16)), shapes, torch.float32, 64,
                        adapter_for("olmoe").hub_layout(), device=cpu)
        try:
            with a.stream(a.Stream()):
                tier.copy_into(15, 63, {n: torch.empty(s) for n, s in shapes.items()})
        finally:
            tier.close()
        Readback(cpu, 1)(0, [torch.tensor([[3, 1]]), torch.tensor([[0.5, 0.5]])])
        m = make_mover(cpu, None)  # a job submitted before any mark: the side stream waits for all compute
        m.acquire(m.submit(lambda: a.copy_(torch.zeros(4), torch.ones(4)), 16, True))
        m.close()
        measure_ram_link(cpu, reps=1, sizes=(64 << 10,), source_bytes=1 << 20, rounds=1)
        measure_contention(cpu, {"bandwidth_gbps": 10.0}, reps=1)
        measure_compute(cpu, reps=1, rounds=1, pool_bytes=8 << 20)
        measure_host_experts(tiny("olmoe"), "olmoe", {"host_tflops": 0.1, "host_mem_bandwidth_gbps": 10.0}, cpu,
                             reps=1, plan=thread_plan("auto", False, cpu))
        speed_probe(cpu, reps=1, rounds=1)


def test_every_cuda_branch_runs_on_the_stand_in(tmp_path):
    """The CUDA-only lines of the executor, the read-back, calibrate and the machine (derived from their source:
    :func:`cuda_only_lines`) all run in the default selection, through the stand-in; a CUDA branch nobody runs
    fails here, named by file and line. Prints the coverage."""
    import sys

    files = {str(ROOT / f): f for f in CUDA_FILES}
    want = {f: cuda_only_lines(ROOT / f) for f in CUDA_FILES}
    ran: dict = {f: set() for f in CUDA_FILES}

    def tracer(frame, event, arg):
        f = files.get(frame.f_code.co_filename)
        if f is None:
            return None
        if event == "line":
            ran[f].add(frame.f_lineno)
        return tracer

    threading.settrace(tracer)  # (the transfer thread and the host worker too)
    sys.settrace(tracer)
    try:
        _cuda_scenarios(tmp_path)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    missed = {f: sorted(want[f] - ran[f]) for f in CUDA_FILES if want[f] - ran[f]}
    total = sum(map(len, want.values()))
    print(f"CUDA-only lines run on the stand-in: {total - sum(map(len, missed.values()))}/{total}")
    assert total > 60 and not missed, missed
