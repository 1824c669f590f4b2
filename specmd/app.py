"""One specmd run: build model -> install policy stack -> lm-eval -> results.json (+ logger)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from .engine import GROUPS
from .errors import ConfigError, DataError
from .hardware import HardwareConfig
from .jobs import usable_cores
from .registry import build_params, check_type
from .signals import signals_held, signals_raise

log = logging.getLogger("specmd")
GENERATION_TASKS = ("gsm8k", "nq_open")  # tasks that decode (generate_until); the others only prefill


def check_policy_overheads(table: dict) -> None:
    """Every ``hardware.policy_overhead_us`` key names a registered policy (a typo would charge nothing)."""
    from .policies import REGISTRIES

    for key in table:
        group, name = key.split("/")
        if name not in REGISTRIES[group].names():
            raise ConfigError(f"hardware.policy_overhead_us: {key!r} names no {group} policy; valid: "
                              f"{', '.join(REGISTRIES[group].names())}")


class Checks:
    """One validation style for a run's config: each check is a function that raises :class:`ConfigError`
    (or a message added with :meth:`fail`); every error of a step is collected and reported together."""

    def __init__(self):
        self.errors: list[str] = []

    def run(self, fn, *args):
        """``fn(*args)``, or None with its error collected."""
        try:
            return fn(*args)
        except ConfigError as exc:
            self.errors.append(str(exc))
            return None

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def raise_any(self) -> None:
        if self.errors:
            e = self.errors
            raise ConfigError(e[0] if len(e) == 1 else f"{len(e)} config errors:\n  - " + "\n  - ".join(e))


class Run:
    """A validated run specification (all config errors surface here, before any model is built)."""

    def __init__(self, cfg: DictConfig, overrides: Optional[list] = None):
        """``overrides``: the command line's overrides (Hydra's task overrides), for the checks that depend on
        what the user set rather than on the composed value (mutually exclusive options).

        1. every section on its own (model, hardware, eval, stack and trace, runtime, policies, replay and
           execution), all their errors reported together;
        2. checks across sections (precisions, oracles, measured passes, execution), in order;
        3. the :class:`~specmd.engine.StackSpec` the drivers hand the engine."""
        c = self.raw = OmegaConf.to_container(cfg, resolve=True)
        self.set_by_user = {o.split("=", 1)[0].lstrip("+~") for o in overrides or ()}
        self.overrides_known = overrides is not None  # (None: a caller that did not say what the user set)
        checks = Checks()
        from .shipped import top_keys

        unknown = sorted(set(c) - top_keys())
        if unknown:  # +foo=bar: a key specmd reads nowhere (a sub-key's typo is each section's own error)
            checks.fail(f"{', '.join(unknown)}: no such setting (added with +key=...); a run's settings: "
                        f"{', '.join(sorted(top_keys()))}")
        for step in (self._model, self._hardware, self._eval, self._stack_and_trace, self._runtime,
                     self._policies, self._replay_and_execution):  # 1
            step(c, checks)
        checks.raise_any()
        self._precisions(c)  # 2
        self._oracles()
        self._measured_passes()
        check_execution(self, c)
        from .compose import build_spec  # 3

        self.spec = build_spec(self.policies, self.hardware, self.quant, self.measure, self.execution)
        self._model_ranges()  # 4

    def _model_ranges(self) -> None:
        """4. The settings the model bounds (a policy's top-J, routing=piggyback's k0, routing=budget's
        max_experts / max_fraction, hardware.experts_per_layer, hardware.memory_gb's room) checked from the model's
        config before any weight loads (:func:`~specmd.engine.engine.check_model_ranges`, ``check_memory_fits``; the
        engine checks them again on the loaded model). A live run's only: a replay checks them on its trace's
        geometry before any work; a hub model whose config is not here is checked once loaded."""
        if self.replay.trace or self.model is None:
            return
        from .engine.engine import check_memory_fits, check_model_ranges
        from .models.loader import model_geometry

        try:
            geom = model_geometry(self.model)
        except DataError:  # (its config.json is on the hub, unreachable from here)
            return
        check_model_ranges(self.spec, geom)
        check_memory_fits(self.spec, geom)

    # ---- 1. sections ----------------------------------------------------------------------------------
    def _model(self, c: dict, checks: Checks) -> None:
        from .models.loader import ModelConfig, check_checkpoint, check_tiny, resolve_family

        self.model = checks.run(build_params, ModelConfig, dict(c["model"]), "model")
        if self.model is not None and self.model.pretrained:
            before = len(checks.errors)
            checks.run(check_checkpoint, self.model.pretrained)
            if len(checks.errors) == before:  # a readable config.json: the family it names, before any weight loads
                checks.run(resolve_family, self.model)
        if self.model is not None:
            checks.run(check_tiny, self.model)
        self.mirror = (c.get("data") or {}).get("mirror")

    def _hardware(self, c: dict, checks: Checks) -> None:
        self.hardware = checks.run(build_params, HardwareConfig, dict(c["hardware"]), "hardware")
        if self.hardware is not None:
            checks.run(check_policy_overheads, self.hardware.policy_overhead_us)
        if {"hardware.capacity", "hardware.experts_per_layer"} <= self.set_by_user and \
                (c["hardware"] or {}).get("experts_per_layer") is not None:
            checks.fail("hardware.capacity and hardware.experts_per_layer are mutually exclusive (a byte budget "
                        "or a number of slots per layer): set one of them")
        if "hardware.capacity" in self.set_by_user and (c["hardware"] or {}).get("memory_gb") is not None \
                and (c["hardware"] or {}).get("capacity") != "auto":
            checks.fail("hardware.capacity and hardware.memory_gb are mutually exclusive (a fixed fraction of the "
                        "model, or what the device's memory leaves per pass): set one of them")

    def _eval(self, c: dict, checks: Checks) -> None:
        from .eval.harness import SUPPORTED, EvalConfig, task_index

        self.eval = checks.run(build_params, EvalConfig, dict(c.get("eval") or {}), "eval")
        if self.eval is not None and any(t not in SUPPORTED for t in self.eval.tasks):
            checks.run(task_index, self.eval.tasks)  # another lm-eval task: checked in the full index now
        self.assistant = None  # eval.speculative=assistant's draft model: a model config of conf/model/
        if self.eval is not None and self.eval.assistant is not None:
            from . import shipped
            from .models.loader import ModelConfig

            names = shipped.options("model")
            if self.eval.assistant not in names:
                checks.fail(f"eval.assistant={self.eval.assistant!r}: valid choices: {', '.join(names)} (a model "
                            f"config of specmd/conf/model/)")
            else:
                draft = dict(shipped.option("model", self.eval.assistant))
                self.assistant = checks.run(build_params, ModelConfig, draft, "eval.assistant")

    def _stack_and_trace(self, c: dict, checks: Checks) -> None:
        from .engine.cache import MEASURES
        from .replay.trace import LOGIT_DTYPES

        stack = c.get("stack") or {}
        self.enabled = checks.run(check_type, stack.get("enabled", True), bool, "stack.enabled")
        self.measure = str(stack.get("measure", "all"))
        if self.measure not in MEASURES:
            checks.fail(f"stack.measure={self.measure!r}; valid choices: {', '.join(MEASURES)}")
        tr = c.get("trace") or {}
        self.save_trace = checks.run(check_type, tr.get("save", False), bool, "trace.save")
        self.trace_depth = checks.run(check_type, tr.get("depth", 1), int, "trace.depth")
        self.trace_logits = checks.run(check_type, tr.get("logits", "fp32"), str, "trace.logits")
        if self.trace_logits is not None and self.trace_logits not in LOGIT_DTYPES:
            checks.fail(f"trace.logits={self.trace_logits!r}; valid choices: {', '.join(LOGIT_DTYPES)}")
        if isinstance(self.trace_depth, int) and self.trace_depth < 0:
            checks.fail(f"trace.depth={self.trace_depth} must be >= 0")

    def _runtime(self, c: dict, checks: Checks) -> None:
        from .loggers import build_logger

        self.device = c.get("device", "cpu")
        checks.run(check_device, self.device)
        self.threads = checks.run(check_type, c.get("threads"), Optional[int], "threads")
        if self.threads is not None and self.threads < 1:
            checks.fail(f"threads={self.threads} must be >= 1 or null (the launcher's share of the cores)")
        elif self.threads is not None and self.threads > usable_cores():
            # capped, not rejected: threads is a resource, not part of a job's identity (config.yaml excludes it
            # from the config hash), so a sweep written on a larger machine still runs here; torch itself
            # crashes (SIGSEGV) creating 100,000 threads, before any failed.json could be written
            log.warning("threads=%d is more than the %d cores this process may use: capped at %d",
                        self.threads, usable_cores(), usable_cores())
            self.threads = usable_cores()
        checks.run(build_logger, c.get("logger"))  # its settings are checked with the others

    def _policies(self, c: dict, checks: Checks) -> None:
        from .policies import REGISTRIES
        from .quant import QUANT

        self.quant = checks.run(QUANT.params, c.get("quant") or {"name": "none"})
        self.policies = {g: checks.run(REGISTRIES[g].params, c[g]) for g in GROUPS}  # (class, params), validated
        for g, pol in self.policies.items():  # top-J's upper bound is the model's top-k (engine, once known)
            if pol is not None and isinstance(getattr(pol[1], "J", None), int) and pol[1].J < 0:
                checks.fail(f"{g}.J={pol[1].J} must be >= 0 (ranks always kept, at most the model's top-k)")

    def _replay_and_execution(self, c: dict, checks: Checks) -> None:
        from .executor.base import default_execution
        from .replay.driver import ReplayConfig

        self.replay = checks.run(build_params, ReplayConfig, dict(c.get("replay") or {}), "replay")
        self.execution = checks.run(default_execution, c.get("execution"))

    # ---- 2. across sections -----------------------------------------------------------------------------
    def _precisions(self, c: dict) -> None:
        """The quantization stores every precision the miss policy fetches (``quant=auto`` resolves to them)."""
        mcls, mparams = self.policies["miss"]
        qcls, qparams = self.quant
        needed = mcls.required_precisions(mparams)
        qparams = qcls.resolve(qparams, needed)
        self.quant = (qcls, qparams)
        if isinstance(c.get("quant"), dict) and hasattr(qparams, "precisions"):
            c["quant"]["precisions"] = list(qparams.precisions)  # results.json records what was stored
        stored = qcls.stored_precisions(qparams)
        missing = [p for p in needed if p not in stored]
        if missing:
            raise ConfigError(f"miss={mcls.name} needs precision(s) {missing}, but quant={qcls.name} stores only "
                              f"{', '.join(stored)}; use quant=hqq with quant.precisions including {missing}")

    def _oracles(self) -> None:
        oracles = [f"{g}={cls.name}" for g, (cls, _) in self.policies.items() if cls.needs_future]
        if oracles and not self.replay.trace:
            raise ConfigError(f"{', '.join(oracles)} needs the future, which only a trace replay has: record a "
                              f"trace with trace.save=true, then replay it with replay.trace=PATH")

    def _measured_passes(self) -> None:
        if self.save_trace and self.replay.trace:
            raise ConfigError("trace.save=true records a live run's routing, and replay.trace replays a trace "
                              "without running the model (there is nothing to record): drop one of them")
        if self.measure == "decode" and not self.replay.trace and not self.eval.token_by_token and not any(
                t in GENERATION_TASKS for t in self.eval.tasks):
            raise ConfigError(f"stack.measure=decode counts decode passes only, and eval.tasks={self.eval.tasks} "
                              f"run none (loglikelihood tasks are prefill passes): add a generation task "
                              f"({', '.join(GENERATION_TASKS)}) or set eval.token_by_token=true")

    @property
    def device_experts(self) -> bool:
        """Whether the experts modules' weights go to the device with the model (else the executor holds
        them in a host tier, and the model moves to the device only after the stack is installed)."""
        return self.execution[0].device_experts

    def build_stack(self, model):
        from .hook import install
        from .models.adapters import adapter_for
        from .models.loader import local_checkpoint

        spec = resolve_auto_capacity(self.spec, self.device)  # (hardware.capacity=auto: the device's free memory)
        return install(model, spec, adapter_for(self.model.family), self.device,
                       local_checkpoint(self.model.pretrained) if self.model.pretrained else None)


def check_execution(run: "Run", c: dict) -> None:
    """The executor against the rest of the config, before any model work: the executor says what it cannot
    carry out (:meth:`specmd.executor.base.Executor.config_errors`), each error naming the setting and the way
    out. Nothing executor-specific is decided here."""
    from .executor.base import RunFacts
    from .models.loader import local_checkpoint

    ecls, ep = run.execution
    pretrained = run.model.pretrained
    facts = RunFacts(replay=bool(run.replay.trace), stack_enabled=run.enabled, timing_as=run.hardware.timing_as,
                     layer_budget=run.hardware.layer_budget, capacity=run.hardware.capacity,
                     memory_gb=run.hardware.memory_gb,
                     miss=run.policies["miss"], model_name=run.model.name, pretrained=pretrained,
                     checkpoint=local_checkpoint(pretrained) if pretrained else None, device=str(run.device),
                     explicit=frozenset((c.get("execution") or {}).keys()) - {"name"})
    errors = ecls.config_errors(ep, facts)
    if errors:
        raise ConfigError("; ".join(errors))


def resolve_auto_capacity(spec, device):
    """``spec`` with ``hardware.capacity=auto`` made concrete: the device's free memory now (before the model's
    dense weights move there: the engine counts them) as ``memory_gb``, said on the log. Unchanged otherwise (the
    executor that allows ``auto`` checked the device can be read: ``Executor.config_errors``)."""
    import dataclasses

    import torch

    from .accel import accel_for
    from .engine.memory import GIB
    from .hardware import AUTO

    hw = spec.hardware
    if hw.capacity != AUTO or hw.memory_gb is not None:
        return spec
    accel = accel_for(torch.device(str(device)))
    free, total = accel.mem_get_info()
    log.info("hardware.capacity=auto: %.4g GiB free of %.4g GiB on %s (%s): the experts get what the dense weights, "
             "hardware.reserve_gb=%g and the KV cache leave of it, per pass", free / GIB, total / GIB, device,
             accel.name, hw.reserve_gb)
    return dataclasses.replace(spec, hardware=dataclasses.replace(hw, memory_gb=free / GIB))


def collect(run: Run, engine, tasks: dict, wall_s: float, executor=None) -> dict:
    """A live run's ``results.json`` dict (:func:`specmd.results.assemble`, the builder replay shares)."""
    from .provenance import provenance
    from .results import assemble

    prov = provenance(run.model)
    if executor is not None and executor.thread_plan is not None:  # where its threads ran, and the speed then
        prov["machine"]["placement"] = executor.thread_plan.record()
        prov["machine"]["speed_probe"] = getattr(executor, "speed_at_start", None)
    return assemble(run.raw, tasks, wall_s, prov, engine, executor)


DEVICE_TYPES = ("cpu", "cuda", "mps")  # what a run computes on; torch knows more (meta, xla, hpu...), specmd not


def check_device(device) -> None:
    """``device`` names a torch device of a type specmd runs on (:data:`DEVICE_TYPES`) that this machine has,
    checked before any model work. ``meta`` (tensors without data: no forward pass computes anything) and
    torch's other back-ends (``xla``, ``hpu``, ``xpu``...: none has been run) are rejected by name here, not
    by a traceback from the first tensor op."""
    import torch

    choices = "cpu, cuda, cuda:N, mps"
    if not isinstance(device, str):
        raise ConfigError(f"device={device!r} must be a string; valid choices: {choices}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({exc}); valid choices: {choices}") from None
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"device={device}: specmd runs on {', '.join(DEVICE_TYPES)}, not {dev.type}"
                          + (" (a meta tensor has no data: nothing would be computed)" if dev.type == "meta" else "")
                          + f"; valid choices: {choices}")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ConfigError(f"device={device}: torch has one CPU device (cpu or cpu:0); valid choices: {choices}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device}: this torch ({torch.__version__}) sees no CUDA device; use device=cpu "
                              f"or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device}: MPS is not available here; use device=cpu")


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


class NumericError(ArithmeticError):
    """A figure specmd computed (cache, timing, routing) is not a finite number."""


COMPUTED = ("cache", "timing", "routing", "wall", "memory")  # results.json sections specmd computes itself


def check_numbers(results: dict) -> None:
    """Every number specmd computed is finite, or the run fails (``failed.json``, stage ``write``) naming the
    first one: ``results.json`` writes a non-finite float as null, which would read as "not measured". The
    hardware ranges (:mod:`specmd.hardware`) keep the clock's inputs finite, so what reaches here is a numeric
    bug; task scores are lm-eval's, whose NaN (a metric without a value) stays theirs."""
    from .results import non_finite

    for key in COMPUTED:
        if results.get(key) is not None:
            bad = non_finite(results[key], key)
            if bad:
                where, v = next(iter(bad.items()))  # the first
                raise NumericError(f"{where}={v}: a figure specmd computed is not a finite number (a bug: please "
                                   f"report it with this run's failed.json)")


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

