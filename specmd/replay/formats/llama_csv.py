"""``llama_csv``: the CSV of llama.cpp forks' ``llama-moe-trace``, or a header-driven CSV.

What was found: upstream ggml-org/llama.cpp has no ``moe-trace`` tool (the stored snapshot holds no
``tools/moe-trace``); ``llama-moe-trace`` exists in several forks as ``tools/moe-trace/moe-trace.cpp``, e.g.
thecodacus/llama.cpp @0bc799a0, graydini/beellama.cpp @d687a0d8, rcarmo/llama-cpp @6421468b and
jasonlnheath/llama-cpp-turboquant @384ed22b. Those write, through the ``ffn_moe_topk-<il>`` eval callback, a
CSV **without a header**, one row per (token, layer) in execution order::

    pos,layer,id0,id1,...,id{k-1}

``layer`` is the model layer index; prompt (prefill) rows carry *negative* ``pos`` and decode rows carry the
decode step ``0, 1, 2, ...``. The negative encoding differs between forks (``-(pos + n_tokens - j)`` in most,
``-(pos + j + 1)`` in one), so the sign and magnitude of ``pos`` are not used for ordering: a ``pos`` value is
only a token's key, and tokens are ordered by their first appearance in the file (a prefill ubatch emits
layer 0 for all its tokens in order before layer 1, then decode steps follow). One tool run is one sequence.
Assumed for files holding several runs concatenated: a new sequence starts at a prompt row (``pos < 0``) that
follows a decode row, or at a (pos, layer) pair already seen in the current sequence. Some other forks write
different, incompatible files under the same tool name (a space-separated ``layer token id[:score] ...``
text, a binary ``MOETRACE`` file, a JSONL of routed expert inputs); those are not read here.

A file whose first non-blank line is not all integers is read as a **header-driven CSV** (``csv`` module,
comma-delimited): the header names columns with the same aliases as JSONL (plus ``pos``); the experts are
either one column holding a list joined by ``;``, ``|``, space (or comma inside quotes; surrounding ``[ ]``
are ignored) or indexed columns ``expert_0..expert_{k-1}`` (also ``expert0``, ``id_0``/``id0``,
``topk_id_0``, ``expert_id_0``); weights likewise (``weights``/``topk_weights`` or ``weight_0..``,
``topk_weight_0..``, ``score_0..``) and logits (``logits``/``router_logits`` or ``logit_0..``). In this
layout tokens are ordered by their numeric position, as in JSONL.

A header with a ``rank`` column and one expert per row (``expert``, ``expert_id`` or ``id``) is the **long**
layout llama.cpp's expert-cache tooling writes, one row per (token, layer, rank)::

    phase,token,layer,rank,expert

Rows of one (sequence, phase, token, layer) form that token's top-k, ordered by ``rank`` (0 = the top-1; the
ranks of a cell must be 0..k-1, each once). ``phase`` (optional) says ``prefill``/``prompt``/``pp`` or
``decode``/``gen``/``tg``: a sequence's prefill tokens form **one prefill pass** (as vLLM's prompt), its decode
tokens one pass each, and tokens are ordered prefill first, then by ``token`` within each phase (so a tool that
numbers decode steps from 0 again is read right). Without ``phase`` every token is a one-token pass. An
optional ``seq`` column (or its aliases) separates sequences; ``weight``/``score`` a weight per row.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from ...errors import ConfigError
from .base import (BIG, EXPERT_KEYS, LAYER_KEYS, LOGIT_KEYS, SEQ_KEYS, TOKEN_KEYS, WEIGHT_KEYS, Columns,
                   ImportOptions, Records, ints, register_format)

_INDEXED = {
    "exp": re.compile(r"^(?:expert|expert_id|topk_id|id)_?(\d+)$"),
    "w": re.compile(r"^(?:weight|topk_weight|score)_?(\d+)$"),
    "log": re.compile(r"^(?:logit|router_logit)_?(\d+)$"),
}
_SPLIT = re.compile(r"[;|,\s]+")
_INT = re.compile(r"-?\d+")


@register_format("llama_csv")
def parse(path: Path, opts: ImportOptions, notes: list) -> Records:
    first = _first_line(path)
    if not first:
        raise ConfigError(f"{path}: empty file, no routing records")
    try:
        [int(x) for x in first.strip().split(",")]
        headerless = True
    except ValueError:
        headerless = False
    return _parse_llama_rows(path, notes) if headerless else _parse_header_csv(path, notes)


def _first_line(path: Path) -> str:
    with open(path, newline="", encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                return line
    return ""


# --------------------------------------------------------------------- headerless llama-moe-trace rows

def _parse_llama_rows(path: Path, notes: list) -> Records:
    """The headerless ``pos,layer,id0,...`` rows of the llama.cpp-fork ``llama-moe-trace`` tool."""
    cols = Columns(path)
    tok_pos = ints()
    runs = _Runs()
    for lineno, vals in _int_rows(path):
        cols.lines.append(lineno)
        pos, lay = vals[0], vals[1]
        seq, t = runs.token(pos, lay)
        if not (-BIG < pos < BIG and -BIG < lay < BIG):
            raise ConfigError(f"{path}, line {lineno}: pos or layer out of the int64 range")
        cols.seqs.append(seq)
        cols.toks.append(t)
        tok_pos.append(pos)
        cols.layers.append(lay)
        cols.experts.append(vals[2:])
    rec = cols.records(False, False, seq_names=list(range(runs.seq + 1)),
                       tok_names=np.asarray(tok_pos, dtype=np.int64), token_order="appearance")
    notes.append(f"llama.cpp moe-trace CSV (pos,layer,id0..): {runs.seq + 1} run(s), {runs.prompt_rows} prompt "
                 f"rows (negative pos) and {len(rec.tok) - runs.prompt_rows} decode rows; prompt tokens replay one "
                 f"token per pass (the prefill batching is not kept)")
    return rec


def _int_rows(path: Path):
    """(line number, the row's integers) for each non-blank line; every row as wide as the first."""
    ncols = ncols_line = None
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s:
                continue
            parts = s.split(",")
            if len(parts) != ncols:
                ncols, ncols_line = _width(path, lineno, len(parts), ncols, ncols_line)
            try:
                vals = [int(x) for x in parts]
            except ValueError:
                raise ConfigError(f"{path}, line {lineno}: non-integer field in {s[:80]!r} (llama.cpp moe-trace "
                                  f"rows are pos,layer,id0,...; a header-driven CSV needs a header row)") from None
            yield lineno, vals


def _width(path: Path, lineno: int, n: int, ncols, ncols_line) -> tuple:
    """The first row fixes the width (pos, layer and at least one expert); another width raises."""
    if ncols is None:
        if n < 3:
            raise ConfigError(f"{path}, line {lineno}: {n} columns; llama.cpp moe-trace rows are pos,layer,id0,...")
        return n, lineno
    raise ConfigError(f"{path}, line {lineno}: {n - 2} experts, but line {ncols_line} has {ncols - 2}: mixed top-k "
                      f"is not supported")


class _Runs:
    """Concatenated tool runs split into sequences, each run's tokens numbered by first appearance."""

    def __init__(self):
        self.seq = -1
        self.order: dict = {}  # pos -> token ordinal in the current sequence
        self.seen: set = set()  # (pos, layer) keys of the current sequence
        self.prev_decode = False
        self.prompt_rows = 0

    def token(self, pos: int, lay: int) -> tuple:
        """(sequence ordinal, token ordinal) of a row."""
        key = (pos, lay)
        if self.seq < 0 or (pos < 0 and self.prev_decode) or key in self.seen:
            self.seq += 1
            self.order = {}
            self.seen = set()
        self.seen.add(key)
        self.prev_decode = pos >= 0
        self.prompt_rows += pos < 0
        t = self.order.get(pos)
        if t is None:
            t = self.order[pos] = len(self.order)
        return self.seq, t


# ------------------------------------------------------------------------------------ long CSV (one row a rank)

LONG_EXPERT = ("expert", "expert_id", "id")
LONG_WEIGHT = ("weight", "score", "topk_weight")
PHASES = {"prefill": 0, "prompt": 0, "pp": 0, "decode": 1, "gen": 1, "generate": 1, "tg": 1}
PHASE_KEY = 1 << 40  # decode tokens sort after every prefill token of their sequence


def _parse_long(path: Path, header: list, reader, notes: list) -> Records:
    """One row per (token, layer, rank): cells grouped (:func:`_long_cells`), each cell's experts ordered by rank."""
    col = {name: next((header.index(a) for a in aliases if a in header), None) for name, aliases in (
        ("seq", SEQ_KEYS), ("phase", ("phase", "stage")), ("tok", TOKEN_KEYS), ("layer", LAYER_KEYS),
        ("rank", ("rank",)), ("exp", LONG_EXPERT), ("w", LONG_WEIGHT))}
    for need, what in (("tok", "token"), ("layer", "layer")):
        if col[need] is None:
            raise ConfigError(f"{path}, line {reader.line_num}: the header names no {what} column; header: "
                              f"{','.join(header)}")
    cells, first_line, seq_ids, prefill = _long_cells(path, header, reader, col)
    k = len(next(iter(cells.values())))
    # each sequence's tokens numbered 0, 1, ... in (phase, token) order; messages name the file's own numbers
    order: dict = {}
    for so, key_t, _ in sorted(cells):
        order.setdefault(so, {}).setdefault(key_t, len(order[so]))
    cols = Columns(path)
    cols.seq_ids = seq_ids
    raw = ints()
    for key, cell in cells.items():
        n, t = first_line[key], key[1] % PHASE_KEY
        if sorted(cell) != list(range(k)):
            raise ConfigError(f"{path}, line {n}: token {t} layer {key[2]} has ranks {sorted(cell)}; "
                              f"each (token, layer) needs ranks 0..{k - 1} (top-{k}) once")
        cols.lines.append(n)
        cols.experts.append([cell[r][0] for r in range(k)])
        if col["w"] is not None:
            cols.weights.append([cell[r][1] for r in range(k)])
        cols.add(n, key[0], order[key[0]][key[1]], key[2])
        raw.append(t)
    prompt_len = None
    if col["phase"] is not None:
        prompt_len = np.asarray([len(prefill.get(q, ())) for q in range(len(seq_ids))], dtype=np.int64)
        notes.append(f"long CSV (one row per rank): {len(cells)} (token, layer) cells of top-{k}; each sequence's "
                     f"prefill tokens are one prefill pass")
    return cols.records(col["w"] is not None, False, prompt_len=prompt_len,
                        tok_names=np.asarray(raw, dtype=np.int64))


def _long_cells(path: Path, header: list, reader, col: dict) -> tuple:
    """``(cells, first line, sequence ids, prefill tokens)``: ``cells[(seq, token key, layer)] = {rank: (expert,
    weight)}`` in first appearance, the token key ordering a sequence's prefill before its decode."""
    cells: dict = {}
    first_line: dict = {}
    seq_ids: dict = {}
    prefill: dict = {}  # seq ordinal -> its prefill tokens
    for row in reader:
        if not any(x.strip() for x in row):
            continue
        n = reader.line_num
        if len(row) != len(header):
            raise ConfigError(f"{path}, line {n}: {len(row)} columns, the header has {len(header)}")
        so = seq_ids.setdefault(row[col["seq"]].strip() if col["seq"] is not None else 0, len(seq_ids))
        phase = 1
        if col["phase"] is not None:
            p = row[col["phase"]].strip().lower()
            if p not in PHASES:
                raise ConfigError(f"{path}, line {n}: phase {p!r}; valid: {', '.join(PHASES)}")
            phase = PHASES[p]
        t, lay, rank, e = (_cell_int(path, n, row[col[c]], what) for c, what in (
            ("tok", "token"), ("layer", "layer"), ("rank", "rank"), ("exp", "expert id")))
        w = _cell_float(path, n, row[col["w"]]) if col["w"] is not None else None
        key = (so, phase * PHASE_KEY + t if col["phase"] is not None else t, lay)
        cell = cells.setdefault(key, {})
        first_line.setdefault(key, n)
        if rank in cell:
            raise ConfigError(f"{path}, line {n}: rank {rank} of token {t} layer {lay} given twice")
        cell[rank] = (e, w)
        if col["phase"] is not None and phase == 0:
            prefill.setdefault(so, set()).add(t)
    if not cells:
        raise ConfigError(f"{path}: empty file, no routing records (only a header)")
    return cells, first_line, seq_ids, prefill


def _cell_int(path: Path, lineno: int, cell: str, what: str) -> int:
    try:
        return int(cell)
    except ValueError:
        raise ConfigError(f"{path}, line {lineno}: {what} {cell!r} is not an integer") from None


def _cell_float(path: Path, lineno: int, cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        raise ConfigError(f"{path}, line {lineno}: weight {cell!r} is not a number") from None


# ------------------------------------------------------------------------------------ header-driven CSV

def _parse_header_csv(path: Path, notes: list) -> Records:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = None
        for row in reader:
            if any(c.strip() for c in row):
                header = [c.strip().lower() for c in row]
                break
        if header is not None and "rank" in header and any(c in header for c in LONG_EXPERT):
            return _parse_long(path, header, reader, notes)
        layout = _Layout(path, header, reader.line_num)
        return _HeaderRows(path, layout).read(reader)


class _Layout:
    """Which columns of the header hold what: sequence, token, layer, and the experts (weights, logits) as
    one list column or indexed columns."""

    def __init__(self, path: Path, header: list, hline: int):
        self.path, self.header, self.hline = path, header, hline
        self.c_seq = self.col(SEQ_KEYS, False, "sequence")
        self.c_tok = self.col(TOKEN_KEYS, True, "token position")
        self.c_lay = self.col(LAYER_KEYS, True, "layer")
        self.lists = {"exp": self.col(EXPERT_KEYS, False, ""), "w": self.col(WEIGHT_KEYS, False, ""),
                      "log": self.col(LOGIT_KEYS, False, "")}
        self.indexed = {field: self.numbered(field, rx) for field, rx in _INDEXED.items()}
        self.indexed = {field: c for field, c in self.indexed.items() if c}
        if self.lists["exp"] is None and "exp" not in self.indexed:
            raise ConfigError(f"{path}, line {hline}: the header names no experts column ({'|'.join(EXPERT_KEYS)} "
                              f"holding a list, or expert_0..expert_{{k-1}}); header: {','.join(header)}")
        self.has_w = self.lists["w"] is not None or "w" in self.indexed
        self.has_l = self.lists["log"] is not None or "log" in self.indexed

    def col(self, aliases: tuple, required: bool, what: str):
        for a in aliases:
            if a in self.header:
                return self.header.index(a)
        if required:
            raise ConfigError(f"{self.path}, line {self.hline}: the header names no {what} column ("
                              f"{'|'.join(aliases)}); header: {','.join(self.header)}")
        return None

    def numbered(self, field: str, rx) -> list:
        """The columns ``<name>_0..<name>_{n-1}`` of a field, in order (empty when there are none)."""
        found = {int(m.group(1)): j for j, m in enumerate(map(rx.match, self.header)) if m}
        if not found:
            return []
        if sorted(found) != list(range(len(found))):
            raise ConfigError(f"{self.path}, line {self.hline}: indexed columns for {field!r} must be numbered "
                              f"0..n-1, found {sorted(found)}")
        if self.lists[field] is not None:
            raise ConfigError(f"{self.path}, line {self.hline}: both a list column and indexed columns for "
                              f"{self.header[self.lists[field]]!r}")
        return [found[i] for i in range(len(found))]

    def values(self, row: list, field: str):
        """A row's values of a field (strings), or None when the header has no such column."""
        if field in self.indexed:
            return [row[j].strip() for j in self.indexed[field] if row[j].strip() != ""]
        c = self.lists[field]
        return None if c is None else _split_cell(row[c])


def _split_cell(cell: str) -> list:
    cell = cell.strip().strip("[]").strip()
    return [x for x in _SPLIT.split(cell) if x] if cell else []


class _HeaderRows:
    """The rows of a header-driven CSV read into columns; the first row fixes top-k and the logit count."""

    def __init__(self, path: Path, layout: _Layout):
        self.path, self.layout = path, layout
        self.cols = Columns(path)
        self.k = self.n_log = None
        self.k_line = self.n_log_line = 0

    def read(self, reader) -> Records:
        c, layout = self.cols, self.layout
        width, c_tok, c_lay, c_seq = len(layout.header), layout.c_tok, layout.c_lay, layout.c_seq
        seq_ids = c.seq_ids
        for row in reader:
            lineno = reader.line_num
            if not any(x.strip() for x in row):
                continue
            c.lines.append(lineno)
            if len(row) != width:
                raise ConfigError(f"{self.path}, line {lineno}: {len(row)} columns, the header has {width}")
            t = _cell_int(self.path, lineno, row[c_tok], "token position")
            lay = _cell_int(self.path, lineno, row[c_lay], "layer")
            s = row[c_seq].strip() if c_seq is not None else 0
            if isinstance(s, str) and _INT.fullmatch(s):
                s = int(s)
            so = seq_ids.get(s)
            if so is None:
                so = seq_ids[s] = len(seq_ids)
            c.experts.append(self.routing(lineno, row))
            c.add(lineno, so, t, lay)
        return c.records(layout.has_w, layout.has_l, empty="empty file, no routing records (only a header)")

    def routing(self, lineno: int, row: list) -> list:
        """The row's expert ids; keeps its weights and logits."""
        e = self._experts(lineno, row)
        if self.layout.has_w:
            self._weights(lineno, row, e)
        if self.layout.has_l:
            self._logits(lineno, row)
        return e

    def _experts(self, lineno: int, row: list) -> list:
        e = self.layout.values(row, "exp")
        try:
            e = [int(x) for x in e]
        except ValueError:
            raise ConfigError(f"{self.path}, line {lineno}: expert ids {e!r} are not all integers") from None
        if self.k is None:
            self.k, self.k_line = len(e), lineno
            if self.k == 0:
                raise ConfigError(f"{self.path}, line {lineno}: empty expert list")
        elif len(e) != self.k:
            raise ConfigError(f"{self.path}, line {lineno}: {len(e)} experts, but line {self.k_line} has {self.k}: "
                              f"mixed top-k is not supported")
        return e

    def _weights(self, lineno: int, row: list, e: list) -> None:
        w = self.layout.values(row, "w")
        if len(w) != len(e):
            raise ConfigError(f"{self.path}, line {lineno}: {len(w)} weights for {len(e)} experts")
        try:
            self.cols.weights.append([float(x) for x in w])
        except ValueError:
            raise ConfigError(f"{self.path}, line {lineno}: weights {w!r} are not all numbers") from None

    def _logits(self, lineno: int, row: list) -> None:
        lg = self.layout.values(row, "log")
        if self.n_log is None:
            self.n_log, self.n_log_line = len(lg), lineno
        elif len(lg) != self.n_log:
            raise ConfigError(f"{self.path}, line {lineno}: {len(lg)} logits, but line {self.n_log_line} has "
                              f"{self.n_log}")
        try:
            self.cols.logits.append([float(x) for x in lg])
        except ValueError:
            raise ConfigError(f"{self.path}, line {lineno}: logits are not all numbers") from None
