"""specmd trace format v1: the routing of a live run, enough to replay its cache and timing exactly.

A trace is a directory::

    meta.json          format "specmd-trace", version 1 (2 where the selection rule has version 2's fields:
                       V2_RULE), geometry, scoring (with the selection rule: bias [L, E], groups), expert bytes per stored
                       precision, signal depth, dtypes, the model and run it came from
    passes.bin         int64 [P, 3]: kind (0 prefill, 1 decode), tokens, context, one row per complete pass
    index.bin          [R, k]    the router's own top-k per (pass, MoE layer, token) row (uint8/int16/int32)
    weights.bin        [R, k]    fp16, the router's own top-k weights
    logits.bin         [R, E]    router logits (fp32 by default, fp16, or absent with trace.logits=none)
    signal_index.bin   [R, D, k] prefetch signal: MoE layer l+d+1's router on layer l's router input, its top-k
    signal_logits.bin  [R, D, E] ... and its logits (same dtype as logits.bin); zero where l+d+1 >= L

Rows are ordered pass-major, then MoE layer, then token: pass p has ``L * tokens_p`` rows. The writer
appends a pass's rows to the data files, flushes them, then appends the pass's row to ``passes.bin``: a
killed run leaves a trace whose complete passes are all readable (trailing partial data is ignored).
Bytes per token per MoE layer: ``k*(b_i + 2) + E*b_l + D*(k*b_i + E*b_l)`` (b_i index bytes, b_l logit
bytes): 544 B for the embedded model (E=64, k=8, fp32 logits, depth 1), 288 B with fp16 logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..engine.geometry import Geometry
from ..engine.record import Scoring
from ..engine.store import StoreSizes
from ..readers import Opt, one_of, whole

FORMAT = "specmd-trace"
VERSION = 3  # what this specmd writes where the rule needs it: an older reader would misread the selection
READS = (1, 2, 3)
# rule fields of version 2 (probabilities given, a per-expert weight scale, a group fill, a bias on the logits), and
# of version 3 (sqrt-softplus probabilities, hash-routed layers; or identity experts in the geometry): a version-2
# reader drops fields it does not know, so a trace that needs them says 3; one that needs none is written as 1
V2_RULE = ("given", "expert_scale", "group_fill", "on_logits")
V3_RULE = ("sqrt_softplus", "hashed")
KINDS = ("prefill", "decode")
LOGIT_DTYPES = {"fp32": np.float32, "fp16": np.float16, "none": None}


def index_dtype(num_experts: int):
    return np.uint8 if num_experts <= 256 else np.int16 if num_experts <= 32768 else np.int32


@dataclass
class TraceMeta:
    """``meta.json`` of a trace, typed: everything a replay needs besides the arrays.

    ``geometry`` (the engine's :class:`~specmd.engine.geometry.Geometry`: layers, experts, bytes, roofline
    parameters), ``store`` (:class:`~specmd.engine.store.StoreSizes`: an expert's bytes per stored
    precision), ``scoring`` (:class:`~specmd.engine.record.Scoring`: probabilities and weights from the
    logits, and the family's selection rule -- its per-layer selection bias and group limit -- so a replay's
    policies rank as the live run's did), ``depth`` (layers of prefetch signal per row), ``logits`` (``fp32`` | ``fp16`` | ``none``),
    ``index_dtype``, and ``source``: what produced it -- a live run's model config, run directory, stack,
    device and ``exact`` (its stack computed what the unhooked model computes), or an importer's
    ``format``, file and counts. On disk it is JSON (:meth:`to_dict` / :meth:`from_dict`)."""

    geometry: Geometry
    store: StoreSizes
    scoring: Scoring = field(default_factory=lambda: Scoring(False, True, 1.0))
    depth: int = 0
    logits: str = "none"
    index_dtype: str = "uint8"
    source: dict = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def model(self) -> Optional[str]:
        """The name of the model the routing was recorded on, however ``source`` records it: a live run's model
        config (a mapping with ``name``) or a bare name (an older recording, a hand-written meta.json); None for
        an import. Every check comparing a trace's model with a run's reads it here, so both spellings are
        checked alike (tune compared only the mapping: a trace naming ``tiny`` passed for ``model=deep_olmoe``)."""
        model = self.source.get("model")
        model = model.get("name") if isinstance(model, dict) else model
        return str(model) if model not in (None, "") else None

    @property
    def imported(self) -> Optional[str]:
        """The import format this trace came from, or None for a specmd recording."""
        return self.source.get("format")

    def to_dict(self) -> dict:
        scoring = self.scoring.to_dict()
        version = (3 if any(k in scoring for k in V3_RULE) or self.geometry.identity_experts
                   else 2 if any(k in scoring for k in V2_RULE) else 1)
        return {"format": self.format, "version": version, "geometry": self.geometry.to_dict(),
                "scoring": scoring,
                "store": {"native_bits": self.store.native_bits, "bytes_of": dict(self.store.bytes_of)},
                "depth": self.depth, "logits": self.logits, "index_dtype": self.index_dtype, "source": self.source}

    @classmethod
    def from_dict(cls, meta: dict, where: str) -> "TraceMeta":
        """From ``meta.json``'s mapping; a wrong format or version, or a missing field, is a ConfigError
        naming ``where``."""
        from ..errors import ConfigError

        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in READS:
            got = meta if isinstance(meta, dict) else {}
            raise ConfigError(f"{where}: format {got.get('format')!r} version {got.get('version')!r}; this specmd "
                              f"reads {FORMAT} versions {', '.join(map(str, READS))}")
        from ..readers import check

        try:  # the fields read below, each its type (a hand-edited meta.json: one line naming the key)
            check(meta, META, where)
            g = meta["geometry"]
            if g.get("expert_bytes") and g.get("total_bytes") and \
                    g["expert_bytes"] * g["num_experts"] * g["num_layers"] > g["total_bytes"]:
                raise ConfigError(f"{where}: geometry.expert_bytes={g['expert_bytes']} x {g['num_experts']} experts x "
                                  f"{g['num_layers']} layers exceeds geometry.total_bytes={g['total_bytes']}")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (a specmd trace's meta.json)") from None
        try:
            g = meta["geometry"]
            geometry = Geometry.from_dict(g)
            out = cls(geometry=geometry, store=StoreSizes.from_meta(meta["store"]),
                      scoring=Scoring.from_dict(meta.get("scoring") or {}, geometry.num_layers, geometry.router_width),
                      depth=int(meta["depth"]), logits=meta["logits"], index_dtype=meta["index_dtype"],
                      source=meta.get("source") or {})
            np.dtype(out.index_dtype)
            LOGIT_DTYPES[out.logits]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: missing or invalid field {exc} (a specmd v1 trace has geometry, store, "
                              f"depth, index_dtype and logits)") from None
        return out


def _index_dtype(v):
    try:
        ok = isinstance(v, str) and np.dtype(v).kind in "iu"
    except TypeError:
        ok = False
    return None if ok else "an integer dtype name (int16, int32 ...)"


# meta.json's fields as TraceMeta.from_dict reads them (specmd.readers.check: a damaged one named by its key)
META = {"geometry": {"num_layers": whole(1), "num_experts": whole(1), "top_k": whole(1),
                     "expert_bytes": Opt(whole(1)), "total_bytes": Opt(whole(1))},
        "store": {"bytes_of": Opt({"native": whole(1)})}, "depth": whole(0), "source": Opt(dict),
        "scoring": Opt(dict), "logits": one_of(tuple(LOGIT_DTYPES)), "index_dtype": _index_dtype}


@dataclass
class Trace:
    """A routing trace in memory (arrays may be memory-mapped). What the replay driver reads.

    ``passes`` int64 [P, 3] (kind 0/1, tokens, context). ``calls`` int64 [C, 4] (pass, layer, first row,
    tokens): the layer calls in execution order (a specmd trace has every MoE layer in every pass; an
    import may lack some). ``index`` [R, k] the router's own top-k per row; ``weights`` [R, k] or None;
    ``logits`` [R, E] or None; ``signal_index`` [R, D, k] / ``signal_logits`` [R, D, E] or None (depth 0).
    ``meta``: :class:`TraceMeta` (geometry, store, scoring, depth, logits, source). ``batching``: set on a
    trace composed at a batch size or concurrency (:mod:`specmd.replay.batching`), else None.
    """

    meta: TraceMeta
    passes: np.ndarray
    calls: np.ndarray
    index: np.ndarray
    weights: Optional[np.ndarray] = None
    logits: Optional[np.ndarray] = None
    signal_index: Optional[np.ndarray] = None
    signal_logits: Optional[np.ndarray] = None
    path: str = ""
    notes: list = field(default_factory=list)  # what an importer skipped or assumed (reported in results)
    # how the passes were composed from a batch-1 trace's requests (:mod:`specmd.replay.batching`: the
    # results' ``replay.batching``); None: the passes as recorded
    batching: Optional[dict] = None
    # each pass's live sequences' own contexts (what their KV cache holds: hardware.memory_gb), as
    # (ptr int64 [P + 1], contexts int64 [M]): pass p's are contexts[ptr[p]:ptr[p + 1]] (a composed trace's
    # members); None: each pass is one sequence of its ``context`` (a batch-1 trace)
    contexts: Optional[tuple] = None
    # the speculative composition's totals (:mod:`specmd.replay.speculative`: the results' ``replay.speculative``);
    # None: no speculation
    speculative: Optional[dict] = None

    @property
    def depth(self) -> int:
        return 0 if self.signal_index is None else int(self.signal_index.shape[1])

    @property
    def requests(self) -> int:
        """Expert requests of the router's own selection (distinct experts per layer call, summed)."""
        return int(sum(len(np.unique(self.index[r0:r0 + n])) for _, _, r0, n in self.calls))


def select_passes(trace: Trace, start: int, stop: Optional[int] = None) -> Trace:
    """The passes ``start:stop`` of ``trace`` as a trace of their own (views of its arrays, rows re-based):
    what a replay of that part alone sees (``specmd.commands.train_eviction``'s held-out passes)."""
    P = len(trace.passes)
    stop = P if stop is None else stop
    if not 0 <= start < stop <= P:
        raise ValueError(f"passes {start}:{stop} of a trace of {P} passes")
    calls = trace.calls[(trace.calls[:, 0] >= start) & (trace.calls[:, 0] < stop)].copy()
    r0 = int(calls[0, 2])
    r1 = int(calls[-1, 2] + calls[-1, 3])
    calls[:, 0] -= start
    calls[:, 2] -= r0

    def part(a):
        return None if a is None else a[r0:r1]

    return Trace(meta=trace.meta, passes=trace.passes[start:stop], calls=calls, index=trace.index[r0:r1],
                 weights=part(trace.weights), logits=part(trace.logits), signal_index=part(trace.signal_index),
                 signal_logits=part(trace.signal_logits), path=f"{trace.path}[passes {start}:{stop}]",
                 notes=list(trace.notes))


def full_calls(passes: np.ndarray, num_layers: int) -> np.ndarray:
    """The calls table of a trace where every pass runs every MoE layer: rows pass-major, layer, token."""
    out = np.zeros((len(passes) * num_layers, 4), dtype=np.int64)
    row = 0
    c = 0
    for p, (_, tokens, _) in enumerate(passes):
        for layer in range(num_layers):
            out[c] = (p, layer, row, tokens)
            row += tokens
            c += 1
    return out


class TraceWriter:
    """Writes a live run's gate records incrementally (see the module docstring)."""

    def __init__(self, path, geom, scoring, store, depth: int = 1, logits: str = "fp32", source: Optional[dict] = None):
        from ..errors import ConfigError

        if logits not in LOGIT_DTYPES:
            raise ConfigError(f"trace.logits={logits!r}; valid choices: {', '.join(LOGIT_DTYPES)}")
        if depth > max(1, geom.num_layers - 1):  # checked before the trace directory exists
            raise ConfigError(f"trace.depth={depth} looks past the model's last MoE layer: it has {geom.num_layers}, "
                              f"so at most {max(1, geom.num_layers - 1)} later layers")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.geom = geom
        self.depth = int(depth)
        self.logit_dtype = LOGIT_DTYPES[logits]
        self.idx_dtype = index_dtype(geom.router_width)
        meta = TraceMeta(geometry=geom, store=store, scoring=scoring, depth=self.depth, logits=logits,
                         index_dtype=np.dtype(self.idx_dtype).name, source=source or {})
        from ..results import write_json_atomic

        self.meta = meta
        write_json_atomic(self.path / "meta.json", meta.to_dict())
        names = ["passes", "index", "weights"]
        if self.logit_dtype is not None:
            names.append("logits")
        if self.depth:
            names.append("signal_index")
            if self.logit_dtype is not None:
                names.append("signal_logits")
        self.files = {n: open(self.path / f"{n}.bin", "wb") for n in names}
        self._pass = None
        self._rows: dict[str, list] = {n: [] for n in names if n != "passes"}

    def begin_pass(self, kind: str, tokens: int, context: int) -> None:
        self._pass = (KINDS.index(kind), tokens, context)
        for rows in self._rows.values():
            rows.clear()

    def layer(self, rec) -> None:
        """Record one live layer call (the router's own selection, before any routing policy)."""
        rows = self._rows
        rows["index"].append(rec.original.detach().cpu().numpy().astype(self.idx_dtype))
        rows["weights"].append(rec.original_weights.detach().float().cpu().numpy().astype(np.float16))
        T, k = rec.original.shape
        if "logits" in rows:
            rows["logits"].append(rec.logits.detach().float().cpu().numpy().astype(self.logit_dtype))
        if self.depth:
            E, L = self.geom.router_width, self.geom.num_layers
            sidx = np.zeros((T, self.depth, k), dtype=self.idx_dtype)
            slog = np.zeros((T, self.depth, E), dtype=self.logit_dtype) if "signal_logits" in rows else None
            for d in range(self.depth):
                target = rec.layer + d + 1
                if target >= L:
                    break
                logits, index = rec.prefetch_signal(target)
                sidx[:, d] = index.detach().cpu().numpy()
                if slog is not None:
                    slog[:, d] = logits.detach().float().cpu().numpy()
            rows["signal_index"].append(sidx)
            if slog is not None:
                rows["signal_logits"].append(slog)

    def end_pass(self) -> None:
        if self._pass is None:
            return
        want = self._pass[1] * self.geom.num_layers
        got = sum(len(a) for a in self._rows["index"])
        if got != want:  # every later row would shift: refuse rather than write a wrong trace
            raise RuntimeError(f"trace writer: a {KINDS[self._pass[0]]} pass of {self._pass[1]} tokens recorded {got} "
                               f"rows, expected {want} (tokens x {self.geom.num_layers} MoE layers)")
        name = "passes"
        try:
            for name, rows in self._rows.items():
                f = self.files[name]
                for a in rows:
                    f.write(np.ascontiguousarray(a).tobytes())
                f.flush()
            name = "passes"
            f = self.files[name]
            f.write(np.asarray(self._pass, dtype=np.int64).tobytes())
            f.flush()
        except OSError as exc:  # a full disk: the file named (a write names none); the passes before stay readable
            raise OSError(exc.errno, f"{exc.strerror or exc} (the trace being recorded: its complete passes so far "
                          "stay readable)", str(self.path / f"{name}.bin")) from exc
        self._pass = None

    def annotate(self, **source) -> None:
        """``source`` added to ``meta.json``'s ``source`` (rewritten atomically): what the run learned by its end
        (a speculative run's accepted tokens), which a replay of the trace reads."""
        from ..results import write_json_atomic

        self.meta.source.update(source)
        write_json_atomic(self.path / "meta.json", self.meta.to_dict())

    def close(self) -> None:
        """Every file closed (their buffers flushed); the first that could not be -- a full disk -- named."""
        failed = None
        for name, f in self.files.items():
            try:
                f.close()
            except OSError as exc:
                failed = failed or OSError(exc.errno, f"{exc.strerror or exc} (the trace being recorded)",
                                           str(self.path / f"{name}.bin"))
        if failed is not None:
            raise failed


def read_trace(path) -> Trace:
    """Open a specmd v1 trace directory (memory-mapped; complete passes only)."""
    from ..errors import ConfigError

    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        from .formats.base import FORMATS as IMPORTS  # the registry alone: formats.build imports this module

        raise ConfigError(f"replay.trace={str(path)!r} is not a specmd trace directory (no meta.json); for other "
                          f"files set replay.format ({', '.join(IMPORTS.names())})")
    try:
        raw = json.loads(meta_path.read_text())
    except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise ConfigError(f"{meta_path}: not valid JSON ({type(exc).__name__}: {exc})") from None
    meta = TraceMeta.from_dict(raw, str(meta_path))
    g = meta.geometry
    L, E, k, D = g.num_layers, g.router_width, g.top_k, meta.depth  # (logits: every router column)
    idt = np.dtype(meta.index_dtype)
    ldt = LOGIT_DTYPES[meta.logits]
    if not (path / "passes.bin").is_file():
        raise ConfigError(f"{path}: no passes.bin (the run stopped before writing any pass)")
    passes = np.fromfile(path / "passes.bin", dtype=np.int64)
    passes = passes[: len(passes) // 3 * 3].reshape(-1, 3)
    if not len(passes):
        raise ConfigError(f"{path}: the trace holds no complete forward pass")
    rows = int(passes[:, 1].sum()) * L

    def mm(name, dtype, shape):
        f = path / f"{name}.bin"
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not f.is_file() or f.stat().st_size < need:
            raise ConfigError(f"{f}: holds {f.stat().st_size if f.is_file() else 0} bytes, the {len(passes)} "
                              f"complete passes need {need}")
        if need == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(f, dtype=dtype, mode="c", shape=shape)

    trace = Trace(
        meta=meta, passes=passes, calls=full_calls(passes, L), index=mm("index", idt, (rows, k)),
        weights=mm("weights", np.float16, (rows, k)),
        logits=mm("logits", ldt, (rows, E)) if ldt is not None else None,
        signal_index=mm("signal_index", idt, (rows, D, k)) if D else None,
        signal_logits=mm("signal_logits", ldt, (rows, D, E)) if D and ldt is not None else None,
        path=str(path),
    )
    for name in ("weights", "logits", "signal_logits"):
        check_finite_rows(getattr(trace, name), path / f"{name}.bin")
    return trace


def check_finite_rows(a: Optional[np.ndarray], where, chunk: int = 1 << 16) -> None:
    """Every value of ``a`` (rows first) is finite, checked a chunk of rows at a time (a memory map is read
    once, never copied whole): a NaN or inf weight or logit in a trace (a model that overflowed float16, a
    damaged file) would reach every score-based policy as a number that sorts anywhere."""
    from ..errors import ConfigError

    if a is None:
        return
    for start in range(0, len(a), chunk):
        ok = np.isfinite(a[start:start + chunk]).reshape(min(chunk, len(a) - start), -1).all(axis=1)
        if not ok.all():
            row = start + int(np.argmin(ok))
            raise ConfigError(f"{where}: row {row} holds a value that is not a finite number "
                              f"({np.asarray(a[row]).ravel()[~np.isfinite(np.asarray(a[row]).ravel())][0]}); "
                              f"rows are (pass, layer, token) in pass order")

