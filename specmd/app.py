"""One specmd run: build model -> install policy stack -> lm-eval -> results.json (+ logger). The run's config is
validated by :class:`~specmd.runspec.Run` (re-exported here), its checks are :mod:`specmd.checks`; this module
executes it: the job on disk (:func:`execute`), its stages in order, and the one way it succeeds (``_finish``)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from .checks import check_numbers
from .errors import ConfigError
from .jobs import usable_cores
from .runspec import Run
from .signals import signals_held, signals_raise

log = logging.getLogger("specmd")


def collect(run: Run, engine, tasks: dict, wall_s: float, executor=None) -> dict:
    """A live run's ``results.json`` dict (:func:`specmd.results.assemble`, the builder replay shares)."""
    from .provenance import provenance
    from .results import assemble

    prov = provenance(run.model)
    if executor is not None and executor.thread_plan is not None:  # where its threads ran, and the speed then
        prov["machine"]["placement"] = executor.thread_plan.record()
        prov["machine"]["speed_probe"] = getattr(executor, "speed_at_start", None)
    return assemble(run.raw, tasks, wall_s, prov, engine, executor)


class JobRunning(RuntimeError):
    """The job's directory is locked by another process running the same job (a second launch)."""


class _Progress:
    """Where a job is (``stage``, one of :data:`specmd.jobs.STAGES`) and what it has computed so far."""

    def __init__(self):
        self._stage = "config"
        self.run: Optional[Run] = None
        self.partial = None  # () -> dict: the cache/timing accounting so far, once a stack exists
        self.wrote_results = False

    @property
    def stage(self) -> str:
        return self._stage

    @stage.setter
    def stage(self, stage: str) -> None:  # a safe point: a signal whose exception was lost stops the job here
        from .signals import check_interrupt

        check_interrupt()
        self._stage = stage


def execute(cfg: DictConfig, run_dir: Optional[str] = None, group: Optional[str] = None,
            resume: bool = False, overrides: Optional[list] = None, threads: Optional[int] = None) -> dict:
    """Run one configuration: ``results.json`` (atomically) into ``run_dir`` when it succeeds, else
    ``failed.json`` naming the stage that failed (:mod:`specmd.jobs`; a ``results.json`` an earlier run left
    there is then moved aside, so the directory never says done). ``resume`` (a sweep's job): return the
    results already in ``run_dir`` when they are this config's (``results["resumed"]`` is then true), and
    raise :class:`JobRunning` when another process holds the job. ``threads``: torch's intra-op threads
    unless the config's ``threads`` says otherwise (the launcher's share of the cores, specmd.jobs)."""
    from . import jobs

    run_dir = Path(run_dir or os.getcwd())
    progress = _Progress()
    lock = None
    try:
        with signals_raise():
            try:
                digest = jobs.config_hash(OmegaConf.to_container(cfg, resolve=True))
                if resume:  # before validation: a job whose config became invalid is not reported done
                    from filelock import Timeout

                    lock = jobs.job_lock(run_dir)
                    try:
                        lock.acquire(timeout=5)  # `specmd status` probes the lock for an instant
                    except Timeout:
                        lock = None
                        raise JobRunning(f"{run_dir} is locked by another process running this job") from None
                    done = jobs.finished(run_dir, digest)
                    if done is not None:
                        done["resumed"] = True
                        return done
                run = progress.run = Run(cfg, overrides)
                share = threads and min(threads, usable_cores())  # a launcher's share: capped
                threads = run.threads or share
                _core_budget(run, threads, shared=bool(not run.threads and share and share < usable_cores()))
                if threads:
                    import torch

                    torch.set_num_threads(threads)
                return _execute(run, digest, run_dir, group, progress)
            except JobRunning:
                raise
            except BaseException as exc:
                exc.specmd_stage = progress.stage  # what the CLI prints, even when failed.json cannot be written
                if not progress.wrote_results:
                    with signals_held():  # a second Ctrl-C cannot cut the record short
                        _record_failure(cfg, run_dir, progress, exc)
                raise
    finally:
        if lock is not None:
            lock.release()


def _core_budget(run: Run, threads: Optional[int], shared: bool) -> None:
    """The job's cores (:func:`specmd.machine.set_core_budget`: what ``execution.threads=auto`` divides); a run
    that pins its threads while its launcher runs other jobs in the same mask is refused before any model work
    (every job would pin to the same first cores)."""
    from .machine import set_core_budget

    set_core_budget(threads, shared)
    ecls, ep = run.execution
    if shared and getattr(ep, "pin", False):
        raise ConfigError(f"execution.pin=true: the launcher runs other jobs beside this one on the same "
                          f"{usable_cores()} cores (this job's share: {threads}), and each would pin its threads to "
                          f"the same first cores; run the sweep one job at a time (hydra.launcher.n_jobs=1) or "
                          f"leave execution.pin=false")


def _record_failure(cfg: DictConfig, run_dir: Path, progress: _Progress, exc: BaseException) -> None:
    """``failed.json`` with the stage, the config and what was computed so far (:func:`jobs.write_failed`,
    which keeps it elsewhere when the run directory cannot take it: ``exc.specmd_failed`` says where)."""
    from . import jobs

    config = progress.run.raw if progress.run is not None else OmegaConf.to_container(cfg, resolve=False)
    try:
        partial = progress.partial() if progress.partial is not None else None
    except Exception:  # noqa: BLE001 -- the accounting of a broken engine: the error itself matters more
        partial = None
    exc.specmd_failed = jobs.write_failed(run_dir, progress.stage, exc, config, partial)


def _execute(run: Run, digest: str, run_dir: Path, group: Optional[str], progress: _Progress) -> dict:
    """The job's stages: a replay of a trace, or 1. the model loaded and 2. the stack built (``load``,
    ``stack``), 3. the tasks evaluated through it (``evaluate``), 4. results collected and written."""
    from .loggers import build_logger

    logger = build_logger(run.raw.get("logger"), group)
    from .provenance import note_start

    note_start()  # (the load while it is timed)
    if run.replay.trace:
        return _replay_job(run, digest, run_dir, logger, progress)
    root = _data_mirror(run)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(run.model.seed)
    from .eval import harness  # noqa: F401 (imported before the clock starts: lm-eval's import is no stage's)
    from .models import loader  # noqa: F401

    t0 = time.perf_counter()
    model, tokenizer, t_load = _load_model(run, progress)
    stack = _build_stack(run, model, progress)
    engine = stack.engine if stack is not None else None
    executor = stack.executor if stack is not None else None
    tasks: dict = {}
    progress.partial = lambda: collect(run, engine, tasks, time.perf_counter() - t0, executor)
    if stack is not None and run.save_trace:
        stack.writer = _trace_writer(run, stack, run_dir)
    t_stack = time.perf_counter()
    progress.stage = "evaluate"
    tasks.update(_evaluate(run, model, tokenizer, stack, root))
    progress.stage = "write"
    t_end = time.perf_counter()
    results = collect(run, engine, tasks, t_end - t0, executor)
    if stack is not None and run.eval.speculative and results.get("cache") is not None:
        from .replay.speculative import live_section

        results["speculative"] = live_section(engine, run.eval.speculative_tokens, stack.live.generated,
                                              run.eval.speculative)
        if stack.writer is not None:  # a replay of the trace reads its accepted tokens there
            stack.writer.annotate(speculative=_speculation(run, stack.live.generated,
                                                           results["speculative"]["verify_steps"]))
    if stack is not None and stack.writer is not None and results.get("cache") is not None:
        # the requests are known (the recorded routing): the oracle's hit rates beside the realized ones
        from .replay.driver import changes_computation, oracle_rates
        from .replay.trace import read_trace

        results["cache"]["oracle"] = oracle_rates(read_trace(run_dir / "trace"), run.spec,
                                                  exact=not changes_computation(run.spec))
    # wall seconds of each stage of this process (start-up = the process's wall time - evaluate)
    results["wall_stages_s"] = {"load": t_load - t0, "stack": t_stack - t_load, "evaluate": t_end - t_stack}
    return _finish(results, engine, digest, run_dir, logger, progress)


def _replay_job(run: Run, digest: str, run_dir: Path, logger, progress: _Progress) -> dict:
    """A run of a recorded (or, ``replay.trace=record``, recorded now) trace: no model."""
    from .recorder import KEYWORD
    from .replay.driver import replay

    progress.stage = "replay"
    if run.replay.trace == KEYWORD:
        run.replay.trace = recorded_trace(run)
    results, engine = replay(run, run_dir)
    progress.stage = "write"
    return _finish(results, engine, digest, run_dir, logger, progress)


def _data_mirror(run: Run):
    """The data mirror's root (the hub is then never asked), or None: tasks then need the hub."""
    from .eval.mirror import require_hub_for, resolve_mirror, set_offline

    root = resolve_mirror(run.mirror)
    if root is not None:
        set_offline()
    elif run.eval.tasks:
        require_hub_for(f"eval.tasks={run.eval.tasks} without a data mirror")
    return root


def _load_model(run: Run, progress: _Progress) -> tuple:
    """Stage ``load``: ``(model, tokenizer, the time it was loaded)``; on the device unless the executor keeps
    the experts in a host tier (then the stack moves the dense weights, :func:`_build_stack`)."""
    from .models.loader import load_model

    progress.stage = "load"
    ecls, eparams = run.execution
    # an executor that reads experts from the checkpoint itself: they are never materialised (meta)
    model, tokenizer = load_model(run.model, experts_on_meta=ecls.experts_on_meta(eparams))
    if run.device_experts:
        model.to(run.device)
    run.draft = None
    if run.assistant is not None:  # eval.speculative=assistant: the draft model, unhooked, on the device
        run.draft, _ = load_model(run.assistant)
        vocab, draft_vocab = model.config.get_text_config().vocab_size, run.draft.config.get_text_config().vocab_size
        if draft_vocab != vocab:
            raise ConfigError(f"eval.assistant={run.eval.assistant}: its vocabulary ({draft_vocab} tokens) is not the "
                              f"model's ({vocab}): a draft model shares the target's tokenizer")
        run.draft.to(run.device)
    return model, tokenizer, time.perf_counter()


def _build_stack(run: Run, model, progress: _Progress):
    """Stage ``stack``: the policy stack installed on ``model`` (None: an unhooked run), and a calibrated profile
    used elsewhere than where it was fitted said, once."""
    on_device = run.device_experts
    # an executor that keeps the experts in a host tier builds it with the stack (for a checkpoint on disk, its
    # expert index): part of loading the model, so its errors are load errors
    progress.stage = "stack" if on_device else "load"
    stack = run.build_stack(model) if run.enabled else None
    progress.stage = "stack"
    if not on_device:  # the experts stay in their host tier: only the dense weights go to the device
        model.to(run.device)
    if stack is not None:
        import platform

        import torch

        from .hardware import profile_mismatch

        ex = stack.executor
        plan = ex.thread_plan.record() if ex.thread_plan is not None else {}
        # (the threads only where they are timed: a simulated run's own threads change no simulated number)
        for line in profile_mismatch(run.hardware, {"host": platform.node(), "device": str(run.device),
                                                    "torch": torch.__version__, "dtype": run.model.dtype,
                                                    "threads": plan.get("threads"), "pin": plan.get("pin"),
                                                    "model": run.model.name, "expert_bytes": stack.geom.expert_bytes}):
            log.warning("%s", line)
        if ex.timed:  # the machine's speed as a timed run starts, on its compute threads (provenance.machine)
            from .machine import speed_probe

            ex.speed_at_start = speed_probe(torch.device(run.device))
    return stack


def _trace_writer(run: Run, stack, run_dir: Path):
    """The writer of the run's trace (``trace.save``), into ``<run dir>/trace``."""
    from .replay.driver import changes_computation
    from .replay.trace import TraceWriter

    exact = not changes_computation(run.spec)
    source = {"model": run.raw.get("model"), "run_dir": str(run_dir), "device": run.device,
              "stack": run.spec.names(), "exact": exact,
              "batch_size": run.eval.batch_size}  # (a stopped run's trace says how it was batched: no results.json)
    if run.eval.speculative:  # its decode passes are verify steps: the accepted tokens are added when it ends
        source["speculative"] = _speculation(run)
    return TraceWriter(run_dir / "trace", stack.geom, stack.scoring, stack.store, run.trace_depth,
                       run.trace_logits, source)


def _speculation(run: Run, accepted=None, steps=None):
    """A live run's speculative decoding as its trace records it (None: none)."""
    if not run.eval.speculative:
        return None
    return {"method": run.eval.speculative, "tokens": run.eval.speculative_tokens, "accepted_tokens": accepted,
            "verify_steps": steps}


def _evaluate(run: Run, model, tokenizer, stack, root) -> dict:
    """Stage ``evaluate``: the tasks' scores; however it ends, the hooks are removed and the trace closed whole,
    whatever a second Ctrl-C does."""
    from .eval.harness import evaluate
    from .eval.mirror import mirrored

    try:
        with mirrored(root):
            return evaluate(model, tokenizer, run.eval, device=run.device,
                            live=stack.live if stack is not None else None, assistant=getattr(run, "draft", None))
    finally:
        with signals_held():
            if stack is not None:
                stack.remove()
                if stack.writer is not None:
                    stack.writer.close()


def recorded_trace(run: Run) -> str:
    """``replay.trace=record``: the trace of ``run``'s model and tasks, recorded live by :func:`execute`
    unless the trace cache holds it (:mod:`specmd.recorder` decides the key and the lock; the app
    orchestrates record-then-replay)."""
    from .recorder import recorded_trace as cached

    return cached(run, lambda cfg, out: execute(OmegaConf.create(cfg), run_dir=str(out)))


def _finish(results: dict, engine, digest: str, run_dir: Path, logger, progress: _Progress) -> dict:
    """The one way a run succeeds, live or replayed: ``passes.csv``, then ``results.json`` (atomically, with
    the config hash), then the logger (which never raises: W&B trouble is a warning, specmd.loggers)."""
    from .results import write_json_atomic, write_passes_csv

    from .jobs import rescue

    results["config_hash"] = digest
    check_numbers(results)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if engine is not None:
            write_passes_csv(run_dir / "passes.csv", engine.cache.stats.passes)
        (run_dir / "failed.json").unlink(missing_ok=True)  # an earlier attempt's (the trace cache's run re-run)
        write_json_atomic(run_dir / "results.json", results)
    except OSError as exc:  # a full disk, a directory made read-only: the results are kept elsewhere, and named
        if exc.filename == str(run_dir / "results.json") and getattr(exc, "kept", None) is not None:
            raise  # (write_file kept them and says where; when it could not, rescue's last resort: stderr)
        kept = rescue(run_dir, "results.json", results)
        raise OSError(exc.errno, f"{exc.strerror}; the run's results are kept in {kept}", exc.filename) from exc
    progress.wrote_results = True
    logger.log_run(results, str(run_dir))
    return results
