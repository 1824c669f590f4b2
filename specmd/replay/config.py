"""The ``replay`` config group (:class:`ReplayConfig`, its keys checked before any trace is read) and the trace it
names (:func:`open_trace`): read or imported, at a model config's geometry (``replay.model``), composed into verify
steps (``replay.speculative_tokens``) or batches (``replay.batch``, ``replay.concurrency``). What the replay driver
(:mod:`.driver`) is given; nothing here runs per layer call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..engine.store import StoreSizes
from ..errors import ConfigError, DamagedFile
from ..readers import read_results
from .formats import FORMATS as IMPORT_FORMATS
from .trace import Trace, read_trace

FORMATS = IMPORT_FORMATS.choices("specmd")  # read at each use: a format registered later is a valid choice


MIN_ARRIVAL_RATE = 1e-9  # replay.arrival_rate's floor (mean arrivals per engine step)
MAX_COUNT = 2**31  # the most requests per static batch or slots a replay takes (C longs stay far from overflow)

@dataclass
class ReplayConfig:
    """The ``replay`` config group: ``trace`` (a specmd trace directory or an import file; null = live run;
    ``record`` = record this run's model and tasks once into ``cache`` and replay that: :mod:`.record`),
    ``format``, and for imports the geometry the file lacks: ``num_experts``, ``expert_bytes``,
    ``model_bytes``, or ``model`` (a ``model`` config name, e.g. ``olmoe``: its geometry -- expert and model
    bytes, the roofline's dense parameters -- is read from its config without loading weights).
    ``reuse_horizon``: also measure the trace's reuse probability by score rank (:mod:`.analysis`).
    ``oracle``: also replay Belady on the same requests (``cache.oracle``: :func:`.driver.oracle_rates`).
    ``batch`` / ``concurrency`` (with ``arrival_rate`` and ``seed``): replay the batch-1 trace's requests as
    a static batch of that size or continuously batched over that many slots (:mod:`.batching`)."""

    trace: Optional[str] = None
    format: str = "specmd"
    cache: str = "outputs/traces"
    reuse_horizon: Optional[int] = None
    num_experts: Optional[int] = None
    expert_bytes: Optional[int] = None
    model_bytes: Optional[int] = None
    model: Optional[str] = None
    oracle: bool = True
    batch: int = 1
    concurrency: Optional[int] = None
    arrival_rate: Optional[float] = None
    seed: int = 0
    speculative_tokens: int = 0
    acceptance: Optional[float] = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ConfigError(f"replay.format={self.format!r}; valid choices: {', '.join(FORMATS)}")
        if self.reuse_horizon is not None and self.reuse_horizon < 1:
            raise ConfigError(f"replay.reuse_horizon={self.reuse_horizon} must be >= 1 or null")
        for key in ("num_experts", "expert_bytes", "model_bytes"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"replay.{key}={v} must be >= 1")
        self.check_batching()
        self.check_speculation()

    def check_speculation(self) -> None:
        """``speculative_tokens`` and ``acceptance`` (:mod:`.speculative`), before any trace is read. An acceptance
        with ``speculative_tokens=0`` is no error: a sweep's K = 0 row (no speculation) shares the grid's."""
        import math

        from .speculative import MAX_TOKENS

        K, p = self.speculative_tokens, self.acceptance
        if isinstance(K, bool) or not isinstance(K, int) or not 0 <= K <= MAX_TOKENS:
            raise ConfigError(f"replay.speculative_tokens={K!r}: valid choices are whole numbers in 0..{MAX_TOKENS} "
                              f"(drafts per verify step; 0 = no speculation)")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
                              or not 0.0 <= p <= 1.0):
            raise ConfigError(f"replay.acceptance={p!r}: valid choices are a probability in [0, 1] (each draft's) or "
                              f"null")
        if K and p is None:
            raise ConfigError(f"replay.speculative_tokens={K} needs replay.acceptance (the probability each draft is "
                              f"accepted, e.g. 0.7)")
        if K and not self.trace:
            raise ConfigError(f"replay.speculative_tokens={K} composes verify steps from a batch-1 trace, and "
                              f"replay.trace is null")

    def check_batching(self) -> None:
        """The batching keys, before any trace is read (:mod:`.batching`)."""
        import math

        if not 1 <= self.batch <= MAX_COUNT:  # (numpy's aranges take C longs: 2**63 overflowed in the replay)
            raise ConfigError(f"replay.batch={self.batch}: valid choices are whole numbers in 1..{MAX_COUNT} "
                              f"(requests per static batch; 1 = the trace as recorded)")
        if self.concurrency is not None and self.concurrency > MAX_COUNT:
            raise ConfigError(f"replay.concurrency={self.concurrency}: valid choices are null or whole numbers in "
                              f"1..{MAX_COUNT} (slots)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"replay.concurrency={self.concurrency}: valid choices are null (no continuous "
                              f"batching) or whole numbers >= 1 (slots)")
        if self.concurrency is not None and self.batch > 1:
            raise ConfigError(f"replay.batch={self.batch} and replay.concurrency={self.concurrency}: a replay is "
                              f"either statically batched (replay.batch > 1) or continuously batched "
                              f"(replay.concurrency), not both; set the other to its default (1 / null)")
        if not 0 <= self.seed <= 2**32 - 1:  # (numpy's generators take seeds >= 0; eval.seed's range)
            raise ConfigError(f"replay.seed={self.seed}: valid choices are whole numbers in 0..{2**32 - 1}")
        if self.arrival_rate is not None:
            # (at least MIN_ARRIVAL_RATE: a mean gap of 1e9 engine steps keeps a million requests' arrival steps
            # inside int64; 1e-300 overflowed them to its minimum)
            if not math.isfinite(self.arrival_rate) or self.arrival_rate < MIN_ARRIVAL_RATE:
                raise ConfigError(f"replay.arrival_rate={self.arrival_rate}: valid choices are null (every request "
                                  f"waiting at the start) or a finite number >= {MIN_ARRIVAL_RATE:g} (mean arrivals "
                                  f"per engine step)")
            if self.concurrency is None:
                raise ConfigError(f"replay.arrival_rate={self.arrival_rate} needs replay.concurrency (arrivals "
                                  f"are continuous batching's; replay.concurrency is null)")
        if self.composes and not self.trace:
            what = f"replay.batch={self.batch}" if self.batch > 1 else f"replay.concurrency={self.concurrency}"
            raise ConfigError(f"{what} composes a replay from a batch-1 trace, and replay.trace is null (a live "
                              f"run batches with eval.batch_size)")

    @property
    def composes(self) -> bool:
        """Whether the replay is composed from the trace's requests (:mod:`.batching`)."""
        return self.batch > 1 or self.concurrency is not None


def open_trace(rc: ReplayConfig) -> Trace:
    """The trace ``rc`` names, read or imported, and composed at ``rc``'s batch or concurrency."""
    trace = _open(rc)
    if rc.speculative_tokens:
        trace = _speculated(trace, rc)
    if not rc.composes:
        return trace
    from .batching import compose_trace

    recorded_batch = _recorded_batch_size(trace)
    if recorded_batch is None and not trace.meta.imported:
        raise ConfigError(f"replay.batch={rc.batch}, replay.concurrency={rc.concurrency}: the trace {trace.path} does "
                          f"not say which eval.batch_size it was recorded at (an older specmd's, and its run's "
                          f"results.json is not beside it), so whether its passes are single requests cannot be "
                          f"told; record it again (it then says so in its meta.json)")
    refuse_batched(trace, f"replay.batch={rc.batch}, replay.concurrency={rc.concurrency}",
                   ", so its passes are batches already, not single requests; composition needs a trace recorded at "
                   "eval.batch_size=1")
    return compose_trace(trace, rc.batch, rc.concurrency, rc.arrival_rate, rc.seed)


def _speculated(trace: Trace, rc: ReplayConfig) -> Trace:
    """``trace`` as speculative verify steps (:mod:`.speculative`): a batch-1 recording's, or an import's."""
    from .speculative import speculate

    refuse_batched(trace, f"replay.speculative_tokens={rc.speculative_tokens}",
                   "; verify steps are composed from one sequence's tokens (record at eval.batch_size=1; replay.batch "
                   "then batches the speculating sequences)")
    return speculate(trace, rc.speculative_tokens, rc.acceptance, rc.seed)


def refuse_batched(trace: Trace, setting: str, why: str) -> None:
    """``setting`` needs a trace of single sequences: one recorded at ``eval.batch_size > 1`` is refused naming it,
    ``why`` (formatted with ``batch``) saying what such a trace lacks and how to record one."""
    batch = _recorded_batch_size(trace)
    if batch is not None and batch > 1:
        raise ConfigError(f"{setting}: the trace {trace.path} was recorded at eval.batch_size={batch}"
                          + why.format(batch=batch))


def _recorded_batch_size(trace: Trace) -> Optional[int]:
    """``eval.batch_size`` of the live run that recorded ``trace``: its ``meta.json``'s (``source.batch_size``,
    written since issue 57: a stopped run's trace has no results.json), 1 for ``record_routing``'s (one sequence
    per pass), else its run's ``results.json`` beside the trace directory (an older trace); None when that is not
    known (an import; an older trace moved away from its run)."""
    if trace.meta.imported:
        return None
    src = trace.meta.source
    size = src.get("batch_size")
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    if size is not None:
        raise ConfigError(f"{trace.path}/meta.json: source.batch_size is {size!r}, not a whole number >= 1 (the "
                          f"eval.batch_size it was recorded at)")
    if "recorded_by" in src:  # record_routing's (tests/data/record_embedded_trace.py and the recorder's)
        return 1
    try:
        size = read_results(Path(trace.path).parent / "results.json")["config"].get("eval", {}).get("batch_size")
    except (FileNotFoundError, DamagedFile, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _open(rc: ReplayConfig) -> Trace:
    import os

    if not os.path.exists(rc.trace):
        raise ConfigError(f"replay.trace={rc.trace!r}: no such file or directory")
    if rc.format == "specmd":
        return read_trace(rc.trace)
    from .imports import ImportOptions, load_import

    geom = model_geometry(rc.model) if rc.model else None
    trace = load_import(rc.trace, rc.format, ImportOptions(
        num_experts=rc.num_experts or (geom.num_experts if geom else None), expert_bytes=rc.expert_bytes,
        model_bytes=rc.model_bytes, top_k=geom.top_k if geom else None,
        layers=(sum(geom.attn_layers) + geom.tail_attn_layers) if geom else None))
    if geom is not None:
        g = trace.meta.geometry
        have = (g.num_layers, g.num_experts, g.top_k)
        want = (geom.num_layers, geom.num_experts, geom.top_k)
        if have != want:
            raise ConfigError(f"replay.model={rc.model}: the model has (MoE layers, experts, top-k) = {want}, the "
                              f"trace {rc.trace} has {have}")
        trace.meta.geometry = geom
        trace.meta.store = StoreSizes.native_only(geom)
        trace.notes.append(f"geometry (expert bytes, dense compute) of model config {rc.model!r}")
    return trace


def model_geometry(name: str):
    """The geometry of the model config ``specmd/conf/model/<name>.yaml`` (no weights are loaded)."""
    from omegaconf import OmegaConf

    from .. import CONF_DIR
    from ..models.loader import ModelConfig, model_geometry as geometry
    from ..registry import build_params

    path = Path(CONF_DIR) / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"replay.model={name!r}: no such model config; valid choices: {', '.join(names)}")
    return geometry(build_params(ModelConfig, dict(OmegaConf.to_container(OmegaConf.load(path))), "model"))
