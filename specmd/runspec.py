"""A run's configuration validated (:class:`Run`, what :func:`specmd.app.execute` runs and the commands build to
replay or tune): every section on its own, all errors reported together, then the checks across sections
(the executor's: :func:`check_execution`), then the :class:`~specmd.engine.StackSpec` the drivers hand the
engine -- all before any model is built."""

from __future__ import annotations

import logging
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from .checks import Checks, check_device, check_policy_overheads, resolve_auto_capacity
from .engine import GROUPS
from .errors import ConfigError, DataError
from .hardware import HardwareConfig
from .jobs import usable_cores
from .registry import build_params, check_type

log = logging.getLogger("specmd")
GENERATION_TASKS = ("gsm8k", "nq_open")  # tasks that decode (generate_until); the others only prefill


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
        from .replay.config import ReplayConfig

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
