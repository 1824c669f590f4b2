"""One specmd run: build model -> install policy stack -> lm-eval -> results.json (+ logger)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .hardware import HardwareConfig
from .registry import build_params

log = logging.getLogger("specmd")
GROUPS = ("routing", "miss", "eviction", "prefetch")


class Run:
    """A validated run specification (all config errors surface here, before any model is built)."""

    def __init__(self, cfg: DictConfig):
        from .eval.harness import EvalConfig
        from .models.loader import ModelConfig
        from .policies.eviction import EVICTION
        from .policies.miss import MISS
        from .policies.prefetch import PREFETCH
        from .policies.routing import ROUTING
        from .quant import QUANT

        c = OmegaConf.to_container(cfg, resolve=True)
        self.raw = c
        self.model = build_params(ModelConfig, dict(c["model"]), "model")
        self.hardware = build_params(HardwareConfig, dict(c["hardware"]), "hardware")
        self.eval = build_params(EvalConfig, dict(c.get("eval") or {}), "eval")
        self.enabled = bool((c.get("stack") or {}).get("enabled", True))
        self.save_trace = bool((c.get("trace") or {}).get("save", False))
        self.quant = QUANT.params(c.get("quant") or {"name": "none"})
        regs = {"routing": ROUTING, "miss": MISS, "eviction": EVICTION, "prefetch": PREFETCH}
        self.policies = {g: regs[g].params(c[g]) for g in GROUPS}  # (class, params), validated
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
        self.mirror = (c.get("data") or {}).get("mirror")
        self.device = c.get("device", "cpu")

    def build_stack(self, model):
        from .hook import install
        from .models.adapters import adapter_for

        (rcls, rp), (mcls, mp), (ecls, ep), (pcls, pp) = (self.policies[g] for g in GROUPS)
        qcls, qp = self.quant
        return install(model, adapter_for(self.model.family), rcls(rp), mcls(mp),
                       lambda keys: ecls(ep, keys), pcls(pp), self.hardware, qcls(qp))


def collect(run: Run, stack, tasks: dict, wall_s: float) -> dict:
    results = {"config": run.raw, "tasks": tasks, "wall_s": wall_s}
    if stack is None:
        results.update(cache=None, timing=None, routing={"fidelity": 1.0})
        return results
    stack.cache.finalize()
    st = stack.cache.stats
    cache = st.summary()
    g = stack.geom
    cache["capacity_bytes"] = sum(p.capacity for p in stack.cache.pools)
    cache["expert_bytes"] = g.expert_bytes
    cache["model_bytes"] = g.total_bytes
    cache["layers"] = g.layer_ids
    results.update(cache=cache, timing=st.timing(), routing={"fidelity": st.fidelity()})
    return results


def execute(cfg: DictConfig, run_dir: Optional[str] = None, group: Optional[str] = None) -> dict:
    """Run one configuration; writes ``results.json`` (atomically) into ``run_dir``."""
    from .eval.mirror import mirrored, require_hub_for, resolve_mirror, set_offline
    from .loggers import build_logger
    from .results import write_json_atomic, write_passes_csv, write_trace

    run = Run(cfg)
    logger = build_logger(run.raw.get("logger"), group)
    run_dir = Path(run_dir or os.getcwd())
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
    if stack is not None and run.save_trace:
        stack.trace = [[] for _ in range(stack.geom.num_layers)]
    tasks: dict = {}
    try:
        with mirrored(root):
            tasks = evaluate(model, tokenizer, run.eval, device=run.device)
    except BaseException as exc:
        # Keep what was computed: the cache/timing accounting so far, marked failed (never results.json).
        partial = collect(run, stack, tasks, time.perf_counter() - t0)
        partial["error"] = f"{type(exc).__name__}: {exc}"
        write_json_atomic(run_dir / "failed.json", partial)
        raise
    finally:
        if stack is not None:
            stack.remove()
    results = collect(run, stack, tasks, time.perf_counter() - t0)
    if stack is not None:
        write_passes_csv(run_dir / "passes.csv", stack.cache.stats.passes)
        if stack.trace is not None:
            write_trace(run_dir / "trace.npz", stack.trace)
    write_json_atomic(run_dir / "results.json", results)
    logger.log_run(results, str(run_dir))
    return results
