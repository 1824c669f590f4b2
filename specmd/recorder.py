"""Recording routing: ``replay.trace=record`` (a sweep's model and tasks recorded once, every job replayed on
it) and :func:`record_routing` (a model's routing on given tokens, for training and model cards).

A sweep over eviction, prefetch or capacity on one model and one task asks the same live question in every
job: which experts does the router pick? ``replay.trace=record`` answers it once. The first job to need a
trace runs the model live with the lossless recording stack (standard routing, ``miss=fetch`` at native
precision, LRU, no prefetch, ``trace.save=true``) into ``<replay.cache>/<model>-<key>``; every other job of
the sweep -- in this process, in a parallel launcher's workers, or a later sweep -- waits on a file lock and
replays the same trace. The key hashes everything that decides the routing and nothing that does not:

* the model config and the fingerprint of its weight files (a retrained checkpoint gets a new trace; a hub
  id not downloaded here is keyed by name and revision, with a warning);
* the ``eval`` and ``data`` sections (tasks, limit, few-shot, generation length, seed, the mirror; a replay
  composed at ``replay.batch`` > 1 or a ``replay.concurrency`` records at ``eval.batch_size=1``, the trace
  its composition needs: :mod:`specmd.replay.batching`);
* the ``quant`` section as resolved for the run's miss policy (a cascade needs the quantized byte sizes,
  so ``quant=auto`` with precisions records as ``hqq`` with them);
* ``trace.depth`` and ``trace.logits`` (what the prefetch and routing policies read); the device;
* the versions of specmd, torch, transformers and lm-eval (their kernels and task definitions).

The hardware, the policies and the logger are not in the key: under the recording stack they do not change
which experts the model routes to. Nor is the specmd git commit (every commit would record anew): after a
change to the hook or an adapter, delete ``replay.cache``. A recording that failed leaves ``failed.json``
and no ``results.json``; the next job records again. A recorded run whose stack is lossless is the unhooked model's
computation, so an exact replay also reports the recording's task scores (``replay.tasks_from``).

Both are orchestration (a composed stack on the live driver, a trace writer, a cache with a lock), so this
module sits beside the app, not in a driver package: the drivers import nothing of it
(``tests/system/test_layering.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from .replay.trace import Trace, TraceWriter, read_trace

log = logging.getLogger("specmd")
KEYWORD = "record"
# the stack the trace is recorded under: computes what the unhooked model computes (DESIGN "exact replay")
RECORDING_STACK = {"routing": {"name": "standard"}, "miss": {"name": "fetch", "precision": "native"},
                   "eviction": {"name": "lru"}, "prefetch": {"name": "none"}}


def recording_config(raw: dict) -> dict:
    """The live run that records the trace ``raw`` (a resolved run config with replay.trace=record) needs."""
    tr = raw.get("trace") or {}
    cfg = {k: v for k, v in raw.items() if k not in ("replay", "logger", "hydra", "report")}
    cfg.update(RECORDING_STACK)
    cfg["stack"] = {"enabled": True, "measure": "all"}
    cfg["trace"] = {"save": True, "depth": int(tr.get("depth", 1)), "logits": str(tr.get("logits", "fp32"))}
    quant = dict(raw.get("quant") or {"name": "none"})
    if quant.get("name") == "auto" and quant.get("precisions"):
        # auto resolved for the run's miss policy (a cascade's precisions); under the recording's miss=fetch
        # it would store none of them, and the replay needs their byte sizes: store them explicitly
        quant["name"] = "hqq"
    cfg["quant"] = quant
    rp = raw.get("replay") or {}
    if int(rp.get("batch") or 1) > 1 or rp.get("concurrency") is not None:
        # a batched or continuous replay composes the recording's requests (specmd.replay.batching), which
        # needs one request per pass: recorded at batch 1, whatever batch the live runs use
        cfg["eval"] = {**(cfg.get("eval") or {}), "batch_size": 1}
    cfg["replay"] = {"trace": None}
    cfg["logger"] = {"name": "none"}
    return cfg


def trace_key(run, cfg: dict) -> str:
    """16 hex digits naming the routing a recording of ``cfg`` produces (module docstring: what counts)."""
    from .provenance import model_identity, versions

    weights = model_identity(run.model)
    if run.model.pretrained is not None and not weights.get("fingerprint"):
        log.warning("replay.trace=record: %s is not on disk here, so the recording is keyed by its name and "
                    "revision only", run.model.pretrained)
    ident = {"model": cfg["model"], "weights": weights, "eval": cfg.get("eval"), "data": cfg.get("data"),
             "quant": cfg.get("quant"), "trace": cfg["trace"], "device": cfg.get("device", "cpu"),
             "versions": versions()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recorded_trace(run, record: Callable[[dict, Path], None]) -> str:
    """The trace directory for ``run`` (``replay.trace=record``): recorded now unless the cache holds it.
    ``record(config, run_dir)`` runs the recording live (the app's ``execute``: the app orchestrates
    record-then-replay, and this module imports nothing of it)."""
    from filelock import FileLock

    cfg = recording_config(run.raw)
    name = str((cfg["model"] or {}).get("name") or "model").replace("/", "_")
    root = Path(run.replay.cache).expanduser().resolve()
    out = root / f"{name}-{trace_key(run, cfg)}"
    if root.exists() and not root.is_dir():
        from .errors import ConfigError

        raise ConfigError(f"replay.cache={run.replay.cache} is a file, not a directory for the recordings")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "results.json").exists():  # results.json is written last: its presence means complete
            log.warning("replay.trace=record: recording the routing of %s on %s into %s (once; later jobs "
                        "replay it)", name, (cfg.get("eval") or {}).get("tasks"), out)
            (out / "config.json").parent.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
            record(cfg, out)
    return str(out / "trace")


@torch.no_grad()
def record_routing(model, ids: list, path, window: int = 512, token_by_token: bool = False, depth: int = 0,
                   logits: str = "none", source: Optional[dict] = None) -> Trace:
    """Record the routing ``model`` chooses on the token ids ``ids`` into a specmd trace at ``path`` and
    return it: the live driver (the lossless :data:`RECORDING_STACK`, which computes what the unhooked
    model computes) with a :class:`~specmd.replay.trace.TraceWriter`, the one recorder of specmd outside
    a run's ``trace.save=true``.

    The ids are cut into sequences of ``window`` tokens; each is one prefill pass, or with
    ``token_by_token`` one pass per token (a one-token prefill, then decode steps over the KV cache, as
    generation runs): one layer call per token, the step ``eviction=ml`` and the token-to-token statistics
    count. ``depth`` / ``logits``: the prefetch signal and router logits to keep (``trace.depth`` /
    ``trace.logits``; none by default: the index and weights are what routing statistics read)."""
    from .compose import stack_spec
    from .hardware import HardwareConfig
    from .hook import install

    stack = install(model, stack_spec(RECORDING_STACK, HardwareConfig()))
    stack.writer = TraceWriter(path, stack.geom, stack.scoring, stack.store, depth, logits,
                               {"exact": True, "stack": stack.spec.names(), "batch_size": 1, **(source or {})})
    try:
        for start in range(0, len(ids), window):
            chunk = torch.tensor(ids[start:start + window]).unsqueeze(0)
            if not token_by_token:
                model(chunk)
                continue
            past = None
            for t in range(chunk.shape[1]):
                past = model(chunk[:, t:t + 1], past_key_values=past, use_cache=True).past_key_values
    finally:
        stack.remove()
        stack.writer.close()
    return read_trace(path)
