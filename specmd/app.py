"""One specmd run: build model -> install policy stack -> lm-eval -> results.json (+ logger)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from .engine import GROUPS, StackSpec
from .errors import ConfigError
from .hardware import HardwareConfig
from .registry import build_params, check_type

log = logging.getLogger("specmd")
GENERATION_TASKS = ("gsm8k", "nq_open")  # tasks that decode (generate_until); the others only prefill


class Run:
    """A validated run specification (all config errors surface here, before any model is built)."""

    def __init__(self, cfg: DictConfig):
        from .eval.harness import SUPPORTED, EvalConfig, task_index
        from .models.loader import ModelConfig
        from .policies import REGISTRIES
        from .quant import QUANT

        c = OmegaConf.to_container(cfg, resolve=True)
        self.raw = c
        self.model = build_params(ModelConfig, dict(c["model"]), "model")
        self.hardware = build_params(HardwareConfig, dict(c["hardware"]), "hardware")
        self.eval = build_params(EvalConfig, dict(c.get("eval") or {}), "eval")
        if any(t not in SUPPORTED for t in self.eval.tasks):  # another lm-eval task: checked in its index now
            task_index(self.eval.tasks)
        stack = c.get("stack") or {}
        self.enabled = check_type(stack.get("enabled", True), bool, "stack.enabled")
        from .engine.cache import MEASURES

        self.measure = str(stack.get("measure", "all"))
        if self.measure not in MEASURES:
            raise ConfigError(f"stack.measure={self.measure!r}; valid choices: {', '.join(MEASURES)}")
        tr = c.get("trace") or {}
        self.save_trace = check_type(tr.get("save", False), bool, "trace.save")
        self.trace_depth = check_type(tr.get("depth", 1), int, "trace.depth")
        self.trace_logits = check_type(tr.get("logits", "fp32"), str, "trace.logits")
        self.quant = QUANT.params(c.get("quant") or {"name": "none"})
        self.policies = {g: REGISTRIES[g].params(c[g]) for g in GROUPS}  # (class, params), validated
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
        from .replay.driver import ReplayConfig

        self.replay = build_params(ReplayConfig, dict(c.get("replay") or {}), "replay")
        oracles = [f"{g}={cls.name}" for g, (cls, _) in self.policies.items() if cls.needs_future]
        if oracles and not self.replay.trace:
            raise ConfigError(f"{', '.join(oracles)} needs the future, which only a trace replay has: record a "
                              f"trace with trace.save=true, then replay it with replay.trace=PATH")
        from .replay.trace import LOGIT_DTYPES

        if self.trace_logits not in LOGIT_DTYPES:
            raise ConfigError(f"trace.logits={self.trace_logits!r}; valid choices: {', '.join(LOGIT_DTYPES)}")
        if self.trace_depth < 0:
            raise ConfigError(f"trace.depth={self.trace_depth} must be >= 0")
        self.mirror = (c.get("data") or {}).get("mirror")
        self.device = c.get("device", "cpu")

        if self.measure == "decode" and not self.replay.trace and not self.eval.token_by_token and not any(
                t in GENERATION_TASKS for t in self.eval.tasks):
            raise ConfigError(f"stack.measure=decode counts decode passes only, and eval.tasks={self.eval.tasks} "
                              f"run none (loglikelihood tasks are prefill passes): add a generation task "
                              f"({', '.join(GENERATION_TASKS)}) or set eval.token_by_token=true")
        from .engine.engine import timing_of

        self.spec = StackSpec(hardware=self.hardware, quant=self.quant, measure=self.measure,
                              timing=timing_of(self.hardware), **self.policies)

    def build_stack(self, model):
        from .hook import install
        from .models.adapters import adapter_for

        return install(model, self.spec, adapter_for(self.model.family))


def collect(run: Run, engine, tasks: dict, wall_s: float) -> dict:
    from .provenance import provenance

    results = {"config": run.raw, "tasks": tasks, "wall_s": wall_s, "provenance": provenance(run.model)}
    if engine is None:
        results.update(cache=None, timing=None, routing={"fidelity": 1.0})
        return results
    results.update(engine.results())
    return results


def execute(cfg: DictConfig, run_dir: Optional[str] = None, group: Optional[str] = None) -> dict:
    """Run one configuration; writes ``results.json`` (atomically) into ``run_dir``."""
    from .eval.mirror import mirrored, require_hub_for, resolve_mirror, set_offline
    from .loggers import build_logger
    from .results import write_json_atomic, write_passes_csv

    run = Run(cfg)
    logger = build_logger(run.raw.get("logger"), group)
    run_dir = Path(run_dir or os.getcwd())
    if run.replay.trace:
        from .replay.driver import replay
        from .replay.record import KEYWORD, recorded_trace

        if run.replay.trace == KEYWORD:
            run.replay.trace = recorded_trace(run)

        results, engine = replay(run, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_passes_csv(run_dir / "passes.csv", engine.cache.stats.passes)
        write_json_atomic(run_dir / "results.json", results)
        logger.log_run(results, str(run_dir))
        return results
    root = resolve_mirror(run.mirror)
    if root is not None:
        set_offline()
    elif run.eval.tasks:
        require_hub_for(f"eval.tasks={run.eval.tasks} without a data mirror")

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(run.model.seed)
    from .eval.harness import evaluate
    from .models.loader import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(run.model)
    model.to(run.device)
    stack = run.build_stack(model) if run.enabled else None
    engine = stack.engine if stack is not None else None
    if stack is not None and run.save_trace:
        from .replay.driver import changes_computation
        from .replay.trace import TraceWriter

        exact = not changes_computation(run.spec)
        stack.writer = TraceWriter(run_dir / "trace", stack.geom, stack.scoring, stack.store, run.trace_depth,
                                   run.trace_logits, {"model": run.raw.get("model"), "run_dir": str(run_dir),
                                                      "device": run.device, "stack": run.spec.names(),
                                                      "exact": exact})
    tasks: dict = {}
    try:
        with mirrored(root):
            tasks = evaluate(model, tokenizer, run.eval, device=run.device)
    except BaseException as exc:
        # Keep what was computed: the cache/timing accounting so far, marked failed (never results.json).
        partial = collect(run, engine, tasks, time.perf_counter() - t0)
        partial["error"] = f"{type(exc).__name__}: {exc}"
        write_json_atomic(run_dir / "failed.json", partial)
        raise
    finally:
        if stack is not None:
            stack.remove()
            if stack.writer is not None:
                stack.writer.close()
    results = collect(run, engine, tasks, time.perf_counter() - t0)
    if engine is not None:
        write_passes_csv(run_dir / "passes.csv", engine.cache.stats.passes)
    write_json_atomic(run_dir / "results.json", results)
    logger.log_run(results, str(run_dir))
    return results
