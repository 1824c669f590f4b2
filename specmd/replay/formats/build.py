"""The one validator: any format's :class:`~.base.Records` checked and turned into a
:class:`~specmd.replay.trace.Trace` (the semantics are in the package docstring)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ...engine.store import StoreSizes
from ..trace import Trace, TraceMeta, index_dtype
from .base import FORMATS, ImportOptions, Records, not_utf8

IDENTICAL_ERROR = 16  # tokens all routed identically from which an import is refused
LIST_SHOWN = 10  # missing cells listed in a note / error


def load_import(path, fmt: str, opts: Optional[ImportOptions] = None) -> Trace:
    """Read a routing trace exported by another engine (see :mod:`specmd.replay.formats`) as a :class:`Trace`."""
    opts = opts or ImportOptions()
    parse = FORMATS.parser(fmt)
    path = Path(path)
    if not path.is_file():
        what = "a directory (a specmd trace? set replay.format=specmd)" if path.is_dir() else "no such file"
        raise ConfigError(f"replay.trace={str(path)!r} with replay.format={fmt}: {what}")
    notes: list = []
    try:
        rec = parse(path, opts, notes)
    except UnicodeDecodeError as e:  # every text format is read as UTF-8: one error for all of them, naming the file
        raise ConfigError(f"replay.trace={str(path)!r} with replay.format={fmt}: not UTF-8 text "
                          f"({not_utf8(path, e)})") from None
    return build_trace(rec, fmt, path, opts, notes)


@dataclass
class _Cells:
    """The records sorted by (sequence, token, layer) and grouped into (sequence, token) cells."""

    order: np.ndarray  # sorted position -> record index
    s: np.ndarray  # sorted records' sequence ordinals
    t: np.ndarray  # ... token keys
    lo: np.ndarray  # ... layer ordinals
    layer_ids: np.ndarray  # layer ordinal -> model layer id
    cell: np.ndarray  # sorted record -> its cell
    cell_start: np.ndarray  # cell -> sorted index of its first record
    cell_seq: np.ndarray  # cell -> sequence ordinal
    seq_start: np.ndarray  # sequence -> its first cell
    rank: np.ndarray  # cell -> its token's ordinal within the sequence

    @property
    def P(self) -> int:
        return len(self.cell_start)


MAX_EXPERTS = 1 << 20
MAX_BYTES = 1 << 60  # the largest model (bytes) an import may declare: the compiled cache counts bytes in int64


def build_trace(rec: Records, fmt: str, path: Path, opts: ImportOptions, notes: list) -> Trace:
    """Check ``rec`` (expert ids, duplicates, degenerate captures, missing cells) and lay it out as a trace."""
    from ...engine.geometry import Geometry

    R, k = rec.experts.shape
    E = _num_experts(rec, path, opts)
    _check_ids(rec, E)
    _check_finite(rec)
    if opts.top_k is not None and int(opts.top_k) != k:
        notes.append(f"replay.top_k={opts.top_k} ignored: the file's records select {k} experts")
    c = _cells(rec)
    passes, cell_pass = _passes(rec, c)
    _check_degenerate(rec, c, path, notes)
    _missing_cells(rec, c, path, opts, notes)
    _position_note(rec, c, notes)
    calls, index, weights, logits = _rows(rec, c, cell_pass, E)
    L = len(c.layer_ids)
    expert_bytes, total_bytes = _sizes(opts, E, L, notes)
    notes.append("imported trace: hidden_size and dense params are 0, so no dense/attention compute time is modelled")
    if rec.weights is None:
        notes.append("the file has no router weights")
    geom = Geometry(num_layers=L, num_experts=E, top_k=int(k), expert_bytes=expert_bytes, total_bytes=total_bytes,
                    hidden_size=0, layer_ids=[int(x) for x in c.layer_ids])
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, expert_bytes, {}), depth=0,
                     logits="fp32" if logits is not None else "none", index_dtype=np.dtype(index.dtype).name,
                     source={"format": fmt, "path": str(path), "records": int(R), "sequences": len(rec.seq_names)})
    return Trace(meta=meta, passes=passes, calls=calls, index=index, weights=weights, logits=logits,
                 signal_index=None, signal_logits=None, path=str(path), notes=notes)


def _num_experts(rec: Records, path: Path, opts: ImportOptions) -> int:
    E = opts.num_experts
    if rec.logits is not None:
        El = int(rec.logits.shape[1])
        if E is not None and int(E) != El:
            raise ConfigError(f"{path}: the router logits have {El} entries, replay.num_experts={E}")
        E = El
    if E is None:
        raise ConfigError(f"{path}: the number of experts is unknown (the file has no router logits); set "
                          f"replay.num_experts")
    E = int(E)
    if not 1 <= E <= MAX_EXPERTS:
        raise ConfigError(f"replay.num_experts={E} must be in 1..{MAX_EXPERTS:,} (the most experts any MoE layer has "
                          f"is a few hundred; the replay keeps a table per layer of that many entries)")
    return E


def _check_ids(rec: Records, E: int) -> None:
    x = rec.experts
    bad = (x < 0).any(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(f"{rec.where(i)}: negative expert id {int(x[i][x[i] < 0][0])} (ids must be in [0, {E}))")
    bad = (x >= E).any(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(f"{rec.where(i)}: expert id {int(x[i][x[i] >= E][0])} out of range [0, {E}) "
                          f"(num_experts={E}; set replay.num_experts if the model has more)")
    if x.shape[1] > 1:
        s = np.sort(x, axis=1)
        dup = (s[:, 1:] == s[:, :-1])
        bad = dup.any(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            v = int(s[i, 1:][dup[i]][0])
            raise ConfigError(f"{rec.where(i)}: expert id {v} appears twice in one record ({x[i].tolist()})")


def _check_finite(rec: Records) -> None:
    """Router weights and logits are finite numbers, and weights fit the trace's float16 (a NaN weight
    would scale an expert's output by NaN, a NaN logit sorts anywhere in every score-based policy): the
    first bad value is named with its record. JSON has no NaN, but Python's json and orjson read ``NaN``
    and ``Infinity``, and CSV and numpy files hold them."""
    for what, a, limit in (("router weight", rec.weights, float(np.finfo(np.float16).max)),
                           ("router logit", rec.logits, None)):
        if a is None:
            continue
        ok = np.isfinite(a) if limit is None else np.isfinite(a) & (np.abs(a) <= limit)
        bad = ~ok.all(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            v = float(a[i][~ok[i]][0])
            why = "not a finite number" if not np.isfinite(v) else f"beyond float16's range (|w| <= {limit:g})"
            raise ConfigError(f"{rec.where(i)}: {what} {v} is {why}")


def _cells(rec: Records) -> _Cells:
    """Sort the records and group them into (sequence, token) cells; a second record of a cell and layer
    raises."""
    layer_ids = np.unique(rec.layer)
    lord = np.searchsorted(layer_ids, rec.layer)
    order = np.lexsort((lord, rec.tok, rec.seq))
    s, t, lo = rec.seq[order], rec.tok[order], lord[order]

    same_cell = (s[1:] == s[:-1]) & (t[1:] == t[:-1])
    dup = same_cell & (lo[1:] == lo[:-1])
    if dup.any():
        j = int(np.argmax(dup))
        a, b = sorted((int(order[j]), int(order[j + 1])))
        raise ConfigError(f"{rec.where(b)}: duplicate record for {_cell_name(rec, a, layer_ids[lord[a]])} "
                          f"(first at {rec.loc(a)})")

    new_cell = np.concatenate(([True], ~same_cell))
    cell = np.cumsum(new_cell) - 1  # per sorted record
    cell_start = np.flatnonzero(new_cell)  # sorted-record index of each cell's first record
    P = len(cell_start)
    cell_seq = s[cell_start]
    seq_start = np.flatnonzero(np.concatenate(([True], cell_seq[1:] != cell_seq[:-1])))
    first_cell_of_seq = np.repeat(seq_start, np.diff(np.append(seq_start, P)))
    rank = np.arange(P) - first_cell_of_seq
    return _Cells(order, s, t, lo, layer_ids, cell, cell_start, cell_seq, seq_start, rank)


def _passes(rec: Records, c: _Cells) -> tuple:
    """(passes [kind, tokens, context], each cell's pass): one pass per token, except a sequence's prompt
    (``rec.prompt_len``), which is one prefill pass."""
    P = c.P
    starts = np.ones(P, dtype=bool)
    if rec.prompt_len is not None:
        starts = ~((c.rank < rec.prompt_len[c.cell_seq]) & (c.rank > 0))
    cell_pass = np.cumsum(starts) - 1
    pass_first = np.flatnonzero(starts)
    pass_tokens = np.diff(np.append(pass_first, P))
    passes = np.empty((len(pass_first), 3), dtype=np.int64)
    passes[:, 0] = (c.rank[pass_first] > 0).astype(np.int64)
    passes[:, 1] = pass_tokens
    passes[:, 2] = c.rank[pass_first] + pass_tokens
    return passes, cell_pass


def _check_degenerate(rec: Records, c: _Cells, path: Path, notes: list) -> None:
    """Flag captures whose routing cannot be a model's (see the package docstring)."""
    P, lo, layer_ids = c.P, c.lo, c.layer_ids
    if P >= 2:
        ex = np.sort(rec.experts[c.order], axis=1)  # records in (sequence, token, layer) order
        _, firsts = np.unique(lo, return_index=True)  # each layer's first record
        if (ex == ex[firsts][lo]).all():
            msg = (f"every one of the {P} tokens is routed to the same experts in every layer (layer "
                   f"{int(layer_ids[0])}: {ex[firsts[0]].tolist()}): not a model's routing; a logging hook that "
                   f"wrote one buffer for every token?")
            if P >= IDENTICAL_ERROR:
                raise ConfigError(f"{path}: {msg}")
            notes.append(msg)
            warnings.warn(f"{path}: {msg}", stacklevel=4)
    if len(layer_ids) > 2:
        steps = np.diff(layer_ids)
        stride = int(np.bincount(steps).argmax())
        if (steps != stride).any():
            expect = np.arange(int(layer_ids[0]), int(layer_ids[-1]) + 1, stride)
            absent = sorted(set(expect.tolist()) - set(layer_ids.tolist()))
            msg = (f"layer id(s) {absent[:LIST_SHOWN]} absent from every token (ids {int(layer_ids[0])}.."
                   f"{int(layer_ids[-1])}, step {stride}): a layer the capture never saw (a hook not registered "
                   f"there, or skipped under CUDA-graph replay)? Replay treats the {len(layer_ids)} layers present "
                   f"as the model's MoE layers")
            notes.append(msg)
            warnings.warn(f"{path}: {msg}", stacklevel=4)


def _missing_cells(rec: Records, c: _Cells, path: Path, opts: ImportOptions, notes: list) -> None:
    """(token, layer) cells absent from the file: skipped with a note and a warning up to
    ``opts.max_missing`` of all cells, an error above."""
    R, P, L = len(rec.experts), c.P, len(c.layer_ids)
    n_missing = P * L - R
    if not n_missing:
        return
    counts = np.diff(np.append(c.cell_start, R))
    short = np.flatnonzero(counts < L)
    hint = _missing_hint(short, c.rank, counts, c.seq_start, P)
    listed = _missing_listed(rec, c, short, counts)
    more = f", ... ({n_missing - len(listed)} more)" if n_missing > len(listed) else ""
    frac = n_missing / (P * L)
    if frac > opts.max_missing:
        raise ConfigError(f"{path}: {n_missing} of {P * L} (token, layer) cells are missing ({frac:.2%}, above "
                          f"replay.max_missing={opts.max_missing}): {', '.join(listed)}{more}{hint}")
    msg = (f"skipped {n_missing} missing (token, layer) cell{'s' if n_missing != 1 else ''}: "
           f"{', '.join(listed)}{more} ({frac:.2%} of {P * L} cells; replay.max_missing={opts.max_missing}){hint}")
    notes.append(msg)
    warnings.warn(f"{path}: {msg}", stacklevel=4)


def _missing_listed(rec: Records, c: _Cells, short, counts) -> list:
    """The first ``LIST_SHOWN`` missing cells by name, in (sequence, token, layer) order."""
    listed: list = []
    for cs in short:
        present = set(c.lo[c.cell_start[cs]:c.cell_start[cs] + counts[cs]].tolist())
        r0 = int(c.order[c.cell_start[cs]])
        listed += [_cell_name(rec, r0, c.layer_ids[m]) for m in range(len(c.layer_ids)) if m not in present]
        if len(listed) >= LIST_SHOWN:
            return listed[:LIST_SHOWN]
    return listed


def _missing_hint(short, rank, counts, seq_start, P: int) -> str:
    """What the pattern of missing cells suggests (appended to the missing-cells note or error)."""
    if not len(short):
        return ""
    seq_last = np.append(seq_start[1:], P) - 1
    if np.isin(short, seq_last).all():
        return ("; only sequences' last tokens lack layers: a capture that stopped before the last forward pass "
                "finished?")
    prompt_complete = (counts[rank == 0] == counts.max()).all()
    decode = int((rank > 0).sum())
    if (rank[short] > 0).all() and prompt_complete and 2 * len(short) >= decode:  # most decode tokens, systematically
        return ("; only decode tokens lack layers, the prompts have them all: hooks skipped under CUDA-graph replay? "
                "(capture with enforce_eager=True)")
    return ""


def _cell_name(rec: Records, r: int, layer_id) -> str:
    """'seq S token T layer L' for record r's (sequence, token) at model layer ``layer_id``."""
    tok = rec.tok_names[r] if rec.tok_names is not None else rec.tok[r]
    name = rec.seq_names[int(rec.seq[r])]
    return f"seq {name} token {int(tok)} layer {int(layer_id)}"


def _position_note(rec: Records, c: _Cells, notes: list) -> None:
    """A note when some sequence's token positions are not 0..n-1 (passes follow the tokens present)."""
    if rec.token_order != "position":
        return
    P, seq_start, t = c.P, c.seq_start, c.t
    first_tok = t[c.cell_start[seq_start]]
    n_tok = np.diff(np.append(seq_start, P))
    last_tok = t[c.cell_start[np.append(seq_start[1:], P) - 1]]
    odd = np.flatnonzero((first_tok != 0) | (last_tok - first_tok + 1 != n_tok))
    if len(odd):
        q = int(odd[0])
        notes.append(f"{len(odd)} sequence(s) have token positions other than 0..n-1 (first: seq "
                     f"{rec.seq_names[int(c.cell_seq[seq_start[q]])]!r}, positions {int(first_tok[q])}.."
                     f"{int(last_tok[q])} for {int(n_tok[q])} tokens); passes follow the tokens present and "
                     f"context counts them (ordinal + 1)")


def _rows(rec: Records, c: _Cells, cell_pass, E: int) -> tuple:
    """(calls, index, weights, logits) with rows in (pass, layer, token) order: a layer call of a multi-token
    pass is one contiguous block of rows."""
    R = len(rec.experts)
    rpass = cell_pass[c.cell]
    regroup = np.lexsort((c.t, c.lo, rpass))
    order, rpass, lo = c.order[regroup], rpass[regroup], c.lo[regroup]
    index = np.ascontiguousarray(rec.experts[order].astype(index_dtype(E)))
    weights = None if rec.weights is None else np.ascontiguousarray(rec.weights[order].astype(np.float16))
    logits = None if rec.logits is None else np.ascontiguousarray(rec.logits[order].astype(np.float32))
    call_first = np.flatnonzero(np.concatenate(([True], (rpass[1:] != rpass[:-1]) | (lo[1:] != lo[:-1]))))
    calls = np.empty((len(call_first), 4), dtype=np.int64)
    calls[:, 0] = rpass[call_first]
    calls[:, 1] = lo[call_first]
    calls[:, 2] = call_first
    calls[:, 3] = np.diff(np.append(call_first, R))
    return calls, index, weights, logits


def _sizes(opts: ImportOptions, E: int, L: int, notes: list) -> tuple:
    """(expert bytes, model bytes) from the options, else in expert units (with notes)."""
    if opts.expert_bytes:
        expert_bytes = int(opts.expert_bytes)
    else:
        expert_bytes = 1
        notes.append("replay.expert_bytes not set: expert_bytes=1, so byte capacities and traffic are in expert units")
    if opts.model_bytes:
        total_bytes = int(opts.model_bytes)
    else:
        total_bytes = expert_bytes * E * L
        notes.append(f"replay.model_bytes not set: total_bytes = expert_bytes * {E} experts * {L} layers (routed "
                     f"experts only), so capacity fractions are of the routed experts")
    routed = expert_bytes * E * L
    if max(routed, total_bytes) > MAX_BYTES:  # (the cache's byte counts are C long longs in the compiled engine)
        raise ConfigError(f"replay.expert_bytes={expert_bytes} x {E} experts x {L} layers = {routed:,} bytes"
                          + (f", replay.model_bytes={total_bytes:,}" if opts.model_bytes else "")
                          + f": at most {MAX_BYTES:,} bytes (2^60: an exabyte) a model the cache accounts for")
    if opts.model_bytes and total_bytes < routed:
        raise ConfigError(f"replay.model_bytes={total_bytes:,} is less than its routed experts' "
                          f"{routed:,} bytes (replay.expert_bytes={expert_bytes} x {E} experts x {L} layers)")
    return expert_bytes, total_bytes
