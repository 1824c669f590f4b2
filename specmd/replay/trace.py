"""specmd trace format v1: the routing of a live run, enough to replay its cache and timing exactly.

A trace is a directory::

    meta.json          format "specmd-trace", version 1, geometry, scoring, expert bytes per stored
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

FORMAT = "specmd-trace"
VERSION = 1
KINDS = ("prefill", "decode")
LOGIT_DTYPES = {"fp32": np.float32, "fp16": np.float16, "none": None}


def index_dtype(num_experts: int):
    return np.uint8 if num_experts <= 256 else np.int16 if num_experts <= 32768 else np.int32


@dataclass
class Trace:
    """A routing trace in memory (arrays may be memory-mapped). What the replay driver reads.

    ``passes`` int64 [P, 3] (kind 0/1, tokens, context). ``calls`` int64 [C, 4] (pass, layer, first row,
    tokens): the layer calls in execution order (a specmd trace has every MoE layer in every pass; an
    import may lack some). ``index`` [R, k] the router's own top-k per row; ``weights`` [R, k] or None;
    ``logits`` [R, E] or None; ``signal_index`` [R, D, k] / ``signal_logits`` [R, D, E] or None (depth 0).
    ``meta``: geometry (a dict of :class:`~specmd.engine.geometry.Geometry`), scoring, store
    (``native_bits``, ``bytes_of``), ``source`` (what produced it), ``format``/``version``.
    """

    meta: dict
    passes: np.ndarray
    calls: np.ndarray
    index: np.ndarray
    weights: Optional[np.ndarray] = None
    logits: Optional[np.ndarray] = None
    signal_index: Optional[np.ndarray] = None
    signal_logits: Optional[np.ndarray] = None
    path: str = ""
    notes: list = field(default_factory=list)  # what an importer skipped or assumed (reported in results)

    @property
    def depth(self) -> int:
        return 0 if self.signal_index is None else int(self.signal_index.shape[1])

    @property
    def requests(self) -> int:
        """Expert requests of the router's own selection (distinct experts per layer call, summed)."""
        return int(sum(len(np.unique(self.index[r0:r0 + n])) for _, _, r0, n in self.calls))


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
        if logits not in LOGIT_DTYPES:
            from ..errors import ConfigError

            raise ConfigError(f"trace.logits={logits!r}; valid choices: {', '.join(LOGIT_DTYPES)}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.geom = geom
        self.depth = int(depth)
        self.logit_dtype = LOGIT_DTYPES[logits]
        self.idx_dtype = index_dtype(geom.num_experts)
        meta = {
            "format": FORMAT, "version": VERSION, "geometry": geom.to_dict(), "scoring": scoring.to_dict(),
            "store": {"native_bits": store.native_bits, "bytes_of": dict(store.bytes_of)},
            "depth": self.depth, "logits": logits, "index_dtype": np.dtype(self.idx_dtype).name,
            "source": source or {},
        }
        from ..results import write_json_atomic

        write_json_atomic(self.path / "meta.json", meta)
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
            E, L = self.geom.num_experts, self.geom.num_layers
            sidx = np.zeros((T, self.depth, k), dtype=self.idx_dtype)
            slog = np.zeros((T, self.depth, E), dtype=self.logit_dtype) if "signal_logits" in rows else None
            for d in range(self.depth):
                target = rec.layer + d + 1
                if target >= L:
                    break
                logits, index = rec._signal.raw(target)
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
        for name, rows in self._rows.items():
            f = self.files[name]
            for a in rows:
                f.write(np.ascontiguousarray(a).tobytes())
            f.flush()
        f = self.files["passes"]
        f.write(np.asarray(self._pass, dtype=np.int64).tobytes())
        f.flush()
        self._pass = None

    def close(self) -> None:
        for f in self.files.values():
            f.close()


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
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{meta_path}: not valid JSON ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}; this specmd "
                          f"reads {FORMAT} version {VERSION}")
    try:
        g = meta["geometry"]
        L, E, k, D = g["num_layers"], g["num_experts"], g["top_k"], int(meta["depth"])
        idt = np.dtype(meta["index_dtype"])
        ldt = LOGIT_DTYPES[meta["logits"]]
        meta["store"]["bytes_of"]["native"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{meta_path}: missing or invalid field {exc} (a specmd v1 trace has geometry, store, depth, "
                          f"index_dtype and logits)") from None
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

    return Trace(
        meta=meta, passes=passes, calls=full_calls(passes, L), index=mm("index", idt, (rows, k)),
        weights=mm("weights", np.float16, (rows, k)),
        logits=mm("logits", ldt, (rows, E)) if ldt is not None else None,
        signal_index=mm("signal_index", idt, (rows, D, k)) if D else None,
        signal_logits=mm("signal_logits", ldt, (rows, D, E)) if D and ldt is not None else None,
        path=str(path),
    )

