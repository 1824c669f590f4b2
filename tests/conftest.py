import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run and machine (a CI failure reproduces locally).
settings.register_profile("specmd", derandomize=True, deadline=None)
settings.load_profile("specmd")

ROOT = Path(__file__).resolve().parent.parent
# Quantized expert copies go to a per-session cache (shared by every test and CLI subprocess of the
# session, so each model is quantized once), never to the user's ~/.cache/specmd.
# The session removes it at the end (pytest_sessionfinish), so no specmd-test-cache-* is left in the temp dir.
_SESSION_CACHE = os.environ["SPECMD_CACHE"] = tempfile.mkdtemp(prefix="specmd-test-cache-")
# What a command keeps in the temporary directory (a failed write's content in specmd-rescue/, a bug's traceback
# in specmd-errors/) goes to the session's own, removed with it: the tests fail writes on purpose
_SESSION_TMP = tempfile.tempdir = tempfile.mkdtemp(prefix="specmd-test-tmp-")


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)

from specmd.models.adapters import families  # noqa: E402 -- after SPECMD_CACHE is set


def _absl_never_closes_the_capture():
    """absl's logging handler (imported with lm-eval's ROUGE metric, TruthfulQA's) writes to the ``sys.stderr``
    of its import, and closes that stream when logging is reconfigured unless it is the ``sys.stderr`` of
    that moment. In a test that is pytest's capture file, and a later in-process Hydra run (``specmd run
    --help`` under capsys: Hydra's dictConfig shuts every handler down) closed it: pytest then lost its
    stderr and the session died mid-way. A user's process never swaps stderr; the tests' does. absl's
    handler writes to the process's own stderr instead (which capture redirects at the descriptor)."""
    import sys

    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    absl_logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


_absl_never_closes_the_capture()


def _sigint_as_python_starts_it():
    """A background job of a non-interactive shell (``cmd &`` in a script) starts with SIGINT and SIGQUIT ignored
    (and ``nohup`` with SIGHUP), and Python then leaves them ignored; specmd respects that (only default handlers
    are replaced: specmd/signals.py), so the tests of those signals (tests/test_robust.py) would see none at all.
    The tests' process gets Python's own handlers, as an interactive start has them."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGQUIT, signal.SIGHUP):  # (ignored in a background job as SIGINT is; SIGHUP under nohup)
        if signal.getsignal(s) == signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)


_sigint_as_python_starts_it()

FAMILIES = families()  # every family with an adapter, in its order (tests parametrise over it)


def mirror_path():
    env = os.environ.get("SPECMD_DATA_MIRROR")
    for cand in (env, ROOT.parent / "shared" / "data"):
        if cand and Path(cand, "wikitext2").is_dir():
            return Path(cand).resolve()
    return None


@pytest.fixture(scope="session")
def mirror():
    path = mirror_path()
    if path is None:
        pytest.skip("no data mirror (set SPECMD_DATA_MIRROR or place shared/data beside the repo)")
    return path


_MODELS = {}


def tiny(family):
    """A cached seeded tiny model (tests must leave it unhooked)."""
    from specmd.models.loader import build_tiny

    if family not in _MODELS:
        model = build_tiny(family)
        # One warm-up forward: a fresh process's first forward pass has been seen to differ in the last
        # bits from later ones on some CPUs (kernel selection), which would break bit-exact comparisons.
        with torch.no_grad():
            model(sample_ids(batch=1, seq=16))
        _MODELS[family] = model
    return _MODELS[family]


def make_stack(model, family, *, eviction="lru", prefetch="topk", capacity=0.05, **hw):
    from specmd.hardware import HardwareConfig
    from specmd.hook import install
    from specmd.models.adapters import adapter_for

    from specmd.compose import spec_of

    return install(model, spec_of(eviction=eviction, prefetch=prefetch, hardware=HardwareConfig(capacity=capacity, **hw)),
                   adapter_for(family))


def sample_ids(batch=2, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq), generator=g)


def at_equal_threads(execution: dict) -> dict:
    """An offload config computing at the threads the simulated run beside it computes at (this process's
    torch threads): a CPU GEMM's last bits depend on its thread count, so offload equals simulated bit for bit
    at equal threads, and ``execution.threads=auto`` keeps a core for the copy thread (specmd.machine.CorePlan);
    a host lane of its own (host_compute=thread) computes at the same threads too."""
    if execution.get("name") == "offload" and "threads" not in execution:
        execution = {**execution, "threads": torch.get_num_threads()}
        if execution.get("host_compute") == "thread":  # (the host lane's own threads: its rows' bits too)
            execution["host_threads"] = torch.get_num_threads()
    return execution
