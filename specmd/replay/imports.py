"""Import routing traces exported by other engines into specmd's in-memory :class:`~specmd.replay.trace.Trace`.

``load_import(path, fmt, opts)`` with ``fmt`` one of:

``jsonl``
    One JSON object per (sequence, token, MoE layer) record, the shape vLLM/SGLang routing captures use.
    Keys (first alias present wins): sequence ``seq|sequence|seq_id|request_id`` (any JSON scalar; 0 when
    absent), token position ``token|pos|position|token_idx`` (int), layer ``layer|layer_id`` (int, the
    model's layer index), experts ``experts|expert_ids|topk_ids|ids`` (list of ints), optional weights
    ``weights|topk_weights`` (list of floats, same length) and optional full router logits
    ``logits|router_logits`` (list of E floats). A record without experts but with logits takes the top-k of
    its logits, k = ``ImportOptions.top_k`` (or the k of the records before it). Blank lines are skipped.
    ``orjson`` is used when installed, else ``json``.

``llama_csv``
    What was found: upstream ggml-org/llama.cpp has no ``moe-trace`` tool (the stored snapshot holds no
    ``tools/moe-trace``); ``llama-moe-trace`` exists in several forks as ``tools/moe-trace/moe-trace.cpp``,
    e.g. thecodacus/llama.cpp @0bc799a0, graydini/beellama.cpp @d687a0d8, rcarmo/llama-cpp @6421468b and
    jasonlnheath/llama-cpp-turboquant @384ed22b. Those write, through the ``ffn_moe_topk-<il>`` eval callback,
    a CSV **without a header**, one row per (token, layer) in execution order::

        pos,layer,id0,id1,...,id{k-1}

    ``layer`` is the model layer index; prompt (prefill) rows carry *negative* ``pos`` and decode rows carry
    the decode step ``0, 1, 2, ...``. The negative encoding differs between forks (``-(pos + n_tokens - j)``
    in most, ``-(pos + j + 1)`` in one), so the sign and magnitude of ``pos`` are not used for ordering: a
    ``pos`` value is only a token's key, and tokens are ordered by their first appearance in the file (a
    prefill ubatch emits layer 0 for all its tokens in order before layer 1, then decode steps follow).
    One tool run is one sequence. Assumed for files holding several runs concatenated: a new sequence
    starts at a prompt row (``pos < 0``) that follows a decode row, or at a (pos, layer) pair already seen
    in the current sequence. Some other forks write different, incompatible files under the same tool name
    (a space-separated ``layer token id[:score] ...`` text, a binary ``MOETRACE`` file, a JSONL of routed
    expert inputs); those are not read here.

    A file whose first non-blank line is not all integers is read as a **header-driven CSV** (``csv``
    module, comma-delimited): the header names columns with the same aliases as JSONL (plus ``pos``); the
    experts are either one column holding a list joined by ``;``, ``|``, space (or comma inside quotes;
    surrounding ``[ ]`` are ignored) or indexed columns ``expert_0..expert_{k-1}`` (also ``expert0``,
    ``id_0``/``id0``, ``topk_id_0``, ``expert_id_0``); weights likewise (``weights``/``topk_weights`` or
    ``weight_0..``, ``topk_weight_0..``, ``score_0..``) and logits (``logits``/``router_logits`` or
    ``logit_0..``). In this layout tokens are ordered by their numeric position, as in JSONL.

``npy``
    A plain integer array ``[tokens, layers, k]``: one sequence, decode order, MoE layers ``0..L-1``.

``vllm``
    The routing stock vLLM returns with ``--enable-return-routed-experts``: per request,
    ``prompt_routed_experts`` (the prompt's tokens) and ``routed_experts`` (the generated tokens the model
    ran), each an integer array ``[tokens, MoE layers, top_k]`` (int16 in vLLM). Two containers: a ``.npz``
    holding ``prompt_routed_experts`` / ``routed_experts`` for one request, or ``<request>/prompt_routed_experts``
    and ``<request>/routed_experts`` for several (``np.savez(f, **arrays)``); or JSON Lines, one object per
    request with ``request_id`` (optional) and the two fields as nested lists (``.tolist()`` of the arrays).
    Either field may be absent (a prompt-only or decode-only capture), not both. Unlike the per-token formats
    the prompt is **one prefill pass** of its tokens, as vLLM ran it (a chunked prefill is still replayed as
    one pass), followed by one decode pass per generated token; context counts the prompt.

Semantics (all formats but ``vllm``'s prompt): every (sequence, token) becomes one one-token forward pass, kind 0 (prefill) for
the first token of its sequence and 1 (decode) for the others, context = the token's ordinal within its
sequence + 1 (the tokens present, so a capture starting at position 100 still has context 1 for its first
token; a note says so). Passes are ordered by sequence (first appearance in the file), then token
(position; first appearance for the headerless llama.cpp layout); within a pass, layers ascending. The
sorted distinct layer ids become MoE ordinals ``0..L-1`` (``geometry["layer_ids"]`` keeps the originals).
A (sequence, token) lacking a layer that others have is a missing cell: up to ``ImportOptions.max_missing``
of all cells they are skipped (the pass has fewer calls) with a note in ``Trace.notes`` and a warning;
above it a :class:`~specmd.errors.ConfigError`. Every input error is a ``ConfigError`` naming the file and
the line (or record) number.

Degenerate captures (all formats) are flagged before anything replays, with what looks wrong: every token
of the file routed identically in every layer (a logging hook that wrote one buffer over and over: an
error from 16 tokens on, a warning below); a layer id absent from every token (a gap in the ids: a layer
the hook never saw); decode tokens lacking layers that prompt tokens have (hooks skipped under CUDA-graph
replay: capture with ``enforce_eager=True``) and sequences whose last token lacks layers (a capture that
stopped mid-forward), both named in the missing-cells note or error.
"""

from __future__ import annotations

import csv
import re
import warnings
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..errors import ConfigError
from .trace import FORMAT, VERSION, Trace, index_dtype

FORMATS = ("jsonl", "llama_csv", "npy", "vllm")
IDENTICAL_ERROR = 16  # tokens all routed identically from which an import is refused

SEQ_KEYS = ("seq", "sequence", "seq_id", "request_id")
TOKEN_KEYS = ("token", "pos", "position", "token_idx")
LAYER_KEYS = ("layer", "layer_id")
EXPERT_KEYS = ("experts", "expert_ids", "topk_ids", "ids")
WEIGHT_KEYS = ("weights", "topk_weights")
LOGIT_KEYS = ("logits", "router_logits")
LIST_SHOWN = 10  # missing cells listed in a note / error
_BIG = 1 << 62  # integers in a file must fit int64 (with room to spare)


@dataclass
class ImportOptions:
    num_experts: Optional[int] = None
    expert_bytes: Optional[int] = None
    model_bytes: Optional[int] = None
    top_k: Optional[int] = None  # only used when the file cannot tell (logits without expert lists)
    max_missing: float = 0.01  # fraction of (token, layer) cells that may be missing (skipped, with a note)


@dataclass
class _Records:
    """Parsed records in file order (one per (sequence, token, layer))."""

    seq: np.ndarray  # int64 sequence ordinal (first appearance)
    tok: np.ndarray  # int64 token sort key within the sequence
    layer: np.ndarray  # int64 model layer id
    experts: np.ndarray  # int64 [R, k]
    weights: Optional[np.ndarray]  # [R, k] float or None
    logits: Optional[np.ndarray]  # float32 [R, E] or None
    loc: Callable[[int], str]  # record index -> "line N" (or "record N (...)")
    seq_names: list  # sequence ordinal -> the id in the file
    path: str = ""
    tok_names: Optional[np.ndarray] = None  # record -> token label for messages (default ``tok``)
    token_order: str = "position"  # or "appearance"
    prompt_len: Optional[np.ndarray] = None  # sequence ordinal -> its first tokens that form one prefill pass

    def where(self, i: int) -> str:
        return f"{self.path}, {self.loc(i)}"


def load_import(path, fmt: str, opts: Optional[ImportOptions] = None) -> Trace:
    """Read a routing trace exported by another engine (see the module docstring) as a :class:`Trace`."""
    opts = opts or ImportOptions()
    if fmt not in FORMATS:
        raise ConfigError(f"replay.format={fmt!r} is not a supported import format; valid choices: "
                          f"{', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"replay.trace={str(path)!r}: no such file")
    notes: list = []
    if fmt == "jsonl":
        rec = _parse_jsonl(path, opts)
    elif fmt == "llama_csv":
        rec = _parse_csv(path, notes)
    elif fmt == "vllm":
        rec = _parse_vllm(path)
    else:
        rec = _parse_npy(path)
    return _build(rec, fmt, path, opts, notes)


# ----------------------------------------------------------------------------------------------- helpers

def _json_loads():
    try:
        import orjson

        return orjson.loads
    except ImportError:
        import json

        return json.loads


def _json_objects(path: Path):
    """(line number, object) for each non-blank line of a JSON Lines file; a line that is not valid JSON or
    not an object is a ConfigError naming it."""
    loads = _json_loads()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                d = loads(raw)
            except ValueError as e:
                raise ConfigError(f"{path}, line {lineno}: malformed JSON ({e})") from None
            if not isinstance(d, dict):
                raise ConfigError(f"{path}, line {lineno}: expected a JSON object, got {type(d).__name__}")
            yield lineno, d


def _ints() -> array:
    """A compact growable int64 column (8 B a value, where a list of ints costs ~36)."""
    return array("q")


def _lines_where(path: Path, lines: list) -> Callable[[int], str]:
    return lambda i: f"{path}, line {lines[i]}"


def _lines_loc(lines: list) -> Callable[[int], str]:
    return lambda i: f"line {lines[i]}"


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _int_matrix(rows: list, where: Callable[[int], str], what: str, dtype=np.int64) -> np.ndarray:
    """Lists of equal length (checked by the caller) -> int64 [R, k]; a non-integer names its record."""
    try:
        a = np.asarray(rows)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is not None and a.ndim == 2 and a.dtype.kind in "iu":
        return a.astype(dtype, copy=False)
    for i, r in enumerate(rows):
        for v in r:
            if not _is_int(v):
                raise ConfigError(f"{where(i)}: {what} {v!r} is not an integer")
            if not -_BIG < v < _BIG:
                raise ConfigError(f"{where(i)}: {what} {v} is out of range")
    return np.asarray(rows, dtype=dtype).reshape(len(rows), -1)


def _float_matrix(rows: list, where: Callable[[int], str], what: str, dtype) -> np.ndarray:
    try:
        a = np.asarray(rows, dtype=np.float64)
    except (ValueError, TypeError):
        a = None
    if a is not None and a.ndim == 2:
        return a.astype(dtype)
    for i, r in enumerate(rows):
        for v in r:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{where(i)}: {what} value {v!r} is not a number")
    raise ConfigError(f"{where(0)}: {what} could not be read as numbers")


class _Rows:
    """Rows appended one record at a time, turned into numpy every ``CHUNK`` rows (Python lists of floats
    cost ~32 B a value; a 1M-record file with 64 logits each would otherwise hold 2 GB of them)."""

    CHUNK = 1 << 15

    def __init__(self, convert, where: Callable[[int], str], what: str, dtype):
        self.convert, self.where, self.what, self.dtype = convert, where, what, dtype
        self.buf: list = []
        self.parts: list = []
        self.n0 = 0

    def append(self, row) -> None:
        self.buf.append(row)
        if len(self.buf) >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            n0 = self.n0
            self.parts.append(self.convert(self.buf, lambda i: self.where(n0 + i), self.what, self.dtype))
            self.n0 += len(self.buf)
            self.buf = []

    def array(self) -> np.ndarray:
        self.flush()
        return np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]


def _topk_of_logits(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int64)


# ------------------------------------------------------------------------------------------------ JSONL

def _parse_jsonl(path: Path, opts: ImportOptions) -> _Records:
    seq_ids: dict = {}
    seqs, toks, layers, lines = _ints(), _ints(), _ints(), _ints()
    where = _lines_where(path, lines)
    experts = _Rows(_int_matrix, where, "expert id", np.int64)
    weights = _Rows(_float_matrix, where, "weight", np.float32)
    logits = _Rows(_float_matrix, where, "logit", np.float32)
    derive: list = []  # record indices whose experts come from their logits
    k = None
    k_line = 0
    n_logits = opts.num_experts
    n_logits_line = 0
    has_w = has_l = None  # set by the first record
    first_line = 0
    # the alias that matched last is tried first (files use one spelling throughout)
    names = {"seq": SEQ_KEYS, "tok": TOKEN_KEYS, "layer": LAYER_KEYS, "exp": EXPERT_KEYS, "w": WEIGHT_KEYS,
             "log": LOGIT_KEYS}
    hot = {f: a[0] for f, a in names.items()}
    missing = object()

    def get(d, field):
        v = d.get(hot[field], missing)
        if v is not missing:
            return v
        for a in names[field]:
            if a in d:
                hot[field] = a
                return d[a]
        return missing

    for lineno, d in _json_objects(path):
        i = len(toks)
        s = get(d, "seq")
        if s is missing:
            s = 0
        try:
            so = seq_ids.get(s)
        except TypeError:
            raise ConfigError(f"{path}, line {lineno}: sequence id {s!r} is not a scalar") from None
        if so is None:
            so = seq_ids[s] = len(seq_ids)
        t = get(d, "tok")
        if t is missing:
            raise ConfigError(f"{path}, line {lineno}: no token position (keys {'|'.join(TOKEN_KEYS)})")
        if type(t) is not int:
            raise ConfigError(f"{path}, line {lineno}: token position {t!r} is not an integer")
        lay = get(d, "layer")
        if lay is missing:
            raise ConfigError(f"{path}, line {lineno}: no layer (keys {'|'.join(LAYER_KEYS)})")
        if type(lay) is not int:
            raise ConfigError(f"{path}, line {lineno}: layer {lay!r} is not an integer")
        e = get(d, "exp")
        w = get(d, "w")
        lg = get(d, "log")
        if w is None:
            w = missing
        if lg is None:
            lg = missing
        if has_w is None:
            has_w, has_l, first_line = w is not missing, lg is not missing, lineno
        if (w is not missing) != has_w:
            raise ConfigError(f"{path}, line {lineno}: weights {'absent' if has_w else 'present'} here but "
                              f"{'present' if has_w else 'absent'} on line {first_line}; every record must "
                              f"have them or none")
        if (lg is not missing) != has_l:
            raise ConfigError(f"{path}, line {lineno}: logits {'absent' if has_l else 'present'} here but "
                              f"{'present' if has_l else 'absent'} on line {first_line}; every record must "
                              f"have them or none")
        if has_l:
            if type(lg) is not list:
                raise ConfigError(f"{path}, line {lineno}: logits must be a list of floats")
            if n_logits is None:
                n_logits, n_logits_line = len(lg), lineno
            elif len(lg) != n_logits:
                src = f"line {n_logits_line} has" if n_logits_line else "replay.num_experts is"
                raise ConfigError(f"{path}, line {lineno}: {len(lg)} logits, but {src} {n_logits}")
            logits.append(lg)
        if e is missing or e is None:
            if not has_l:
                raise ConfigError(f"{path}, line {lineno}: no expert list (keys {'|'.join(EXPERT_KEYS)}) "
                                  f"and no router logits to take the top-k of")
            if has_w:
                raise ConfigError(f"{path}, line {lineno}: weights without an expert list")
            if k is None:
                if opts.top_k is None:
                    raise ConfigError(f"{path}, line {lineno}: no expert list, only logits; set "
                                      f"replay.top_k to take their top-k")
                k, k_line = int(opts.top_k), 0
            derive.append(i)
            e = [0] * k  # placeholder, filled from the logits below
        else:
            if type(e) is not list:
                raise ConfigError(f"{path}, line {lineno}: experts must be a list of ints, got {e!r}")
            if k is None:
                k, k_line = len(e), lineno
                if k == 0:
                    raise ConfigError(f"{path}, line {lineno}: empty expert list")
            elif len(e) != k:
                src = f"line {k_line}" if k_line else "replay.top_k"
                raise ConfigError(f"{path}, line {lineno}: {len(e)} experts, but {src} has {k}: mixed top-k "
                                  f"is not supported")
            if has_w:
                if type(w) is not list:
                    raise ConfigError(f"{path}, line {lineno}: weights must be a list of floats")
                if len(w) != len(e):
                    raise ConfigError(f"{path}, line {lineno}: {len(w)} weights for {len(e)} experts")
                weights.append(w)
        experts.append(e)
        seqs.append(so)
        if not (-_BIG < t < _BIG and -_BIG < lay < _BIG):
            raise ConfigError(f"{path}, line {lineno}: token position or layer out of the int64 range")
        toks.append(t)
        layers.append(lay)
        lines.append(lineno)
    if not toks:
        raise ConfigError(f"{path}: empty file, no routing records")
    lg_arr = logits.array() if has_l else None
    ex_arr = experts.array()
    if derive:
        ex_arr[derive] = _topk_of_logits(lg_arr[derive], k)
    return _Records(
        seq=np.asarray(seqs, dtype=np.int64), tok=np.asarray(toks, dtype=np.int64),
        layer=np.asarray(layers, dtype=np.int64), experts=ex_arr,
        weights=weights.array() if has_w else None, logits=lg_arr,
        loc=_lines_loc(lines), path=str(path), seq_names=list(seq_ids),
    )


# -------------------------------------------------------------------------------------------------- CSV

_INDEXED = {
    "exp": re.compile(r"^(?:expert|expert_id|topk_id|id)_?(\d+)$"),
    "w": re.compile(r"^(?:weight|topk_weight|score)_?(\d+)$"),
    "log": re.compile(r"^(?:logit|router_logit)_?(\d+)$"),
}
_SPLIT = re.compile(r"[;|,\s]+")


def _parse_csv(path: Path, notes: list) -> _Records:
    with open(path, newline="") as f:
        first = ""
        for line in f:
            if line.strip():
                first = line
                break
    if not first:
        raise ConfigError(f"{path}: empty file, no routing records")
    try:
        [int(x) for x in first.strip().split(",")]
        headerless = True
    except ValueError:
        headerless = False
    return _parse_llama_rows(path, notes) if headerless else _parse_header_csv(path)


def _parse_llama_rows(path: Path, notes: list) -> _Records:
    """The headerless ``pos,layer,id0,...`` rows of the llama.cpp-fork ``llama-moe-trace`` tool."""
    seqs, toks, tok_pos, layers, lines = _ints(), _ints(), _ints(), _ints(), _ints()
    experts = _Rows(_int_matrix, _lines_where(path, lines), "expert id", np.int64)
    ncols = None
    ncols_line = 0
    seq = -1
    order: dict = {}  # pos -> token ordinal in the current sequence
    seen: set = set()  # (pos, layer) keys of the current sequence
    prev_decode = False
    prompt_rows = 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s:
                continue
            parts = s.split(",")
            if ncols is None:
                ncols, ncols_line = len(parts), lineno
                if ncols < 3:
                    raise ConfigError(f"{path}, line {lineno}: {ncols} columns; llama.cpp moe-trace rows are "
                                      f"pos,layer,id0,...")
            elif len(parts) != ncols:
                raise ConfigError(f"{path}, line {lineno}: {len(parts) - 2} experts, but line {ncols_line} has "
                                  f"{ncols - 2}: mixed top-k is not supported")
            try:
                vals = [int(x) for x in parts]
            except ValueError:
                raise ConfigError(f"{path}, line {lineno}: non-integer field in {s[:80]!r} (llama.cpp moe-trace "
                                  f"rows are pos,layer,id0,...; a header-driven CSV needs a header row)") from None
            pos, lay = vals[0], vals[1]
            key = (pos, lay)
            if seq < 0 or (pos < 0 and prev_decode) or key in seen:
                seq += 1
                order = {}
                seen = set()
            seen.add(key)
            prev_decode = pos >= 0
            prompt_rows += pos < 0
            t = order.get(pos)
            if t is None:
                t = order[pos] = len(order)
            seqs.append(seq)
            if not (-_BIG < pos < _BIG and -_BIG < lay < _BIG):
                raise ConfigError(f"{path}, line {lineno}: pos or layer out of the int64 range")
            toks.append(t)
            tok_pos.append(pos)
            layers.append(lay)
            experts.append(vals[2:])
            lines.append(lineno)
    if not toks:
        raise ConfigError(f"{path}: empty file, no routing records")
    notes.append(f"llama.cpp moe-trace CSV (pos,layer,id0..): {seq + 1} run(s), {prompt_rows} prompt rows (negative "
                 f"pos) and {len(toks) - prompt_rows} decode rows; prompt tokens replay one token per pass (the "
                 f"prefill batching is not kept)")
    return _Records(
        seq=np.asarray(seqs, dtype=np.int64), tok=np.asarray(toks, dtype=np.int64),
        layer=np.asarray(layers, dtype=np.int64), experts=experts.array(),
        weights=None, logits=None, loc=_lines_loc(lines), path=str(path), seq_names=list(range(seq + 1)),
        tok_names=np.asarray(tok_pos, dtype=np.int64), token_order="appearance",
    )


def _split_cell(cell: str) -> list:
    cell = cell.strip().strip("[]").strip()
    return [x for x in _SPLIT.split(cell) if x] if cell else []


def _parse_header_csv(path: Path) -> _Records:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = None
        for row in reader:
            if any(c.strip() for c in row):
                header = [c.strip().lower() for c in row]
                break
        hline = reader.line_num

        def col(aliases, required, what):
            for a in aliases:
                if a in header:
                    return header.index(a)
            if required:
                raise ConfigError(f"{path}, line {hline}: the header names no {what} column ("
                                  f"{'|'.join(aliases)}); header: {','.join(header)}")
            return None

        c_seq = col(SEQ_KEYS, False, "sequence")
        c_tok = col(TOKEN_KEYS, True, "token position")
        c_lay = col(LAYER_KEYS, True, "layer")
        lists = {"exp": col(EXPERT_KEYS, False, ""), "w": col(WEIGHT_KEYS, False, ""),
                 "log": col(LOGIT_KEYS, False, "")}
        indexed = {}
        for field, rx in _INDEXED.items():
            found = {}
            for j, name in enumerate(header):
                m = rx.match(name)
                if m:
                    found[int(m.group(1))] = j
            if found:
                if sorted(found) != list(range(len(found))):
                    raise ConfigError(f"{path}, line {hline}: indexed columns for {field!r} must be numbered "
                                      f"0..n-1, found {sorted(found)}")
                if lists[field] is not None:
                    raise ConfigError(f"{path}, line {hline}: both a list column and indexed columns for "
                                      f"{header[lists[field]]!r}")
                indexed[field] = [found[i] for i in range(len(found))]
        if lists["exp"] is None and "exp" not in indexed:
            raise ConfigError(f"{path}, line {hline}: the header names no experts column ({'|'.join(EXPERT_KEYS)} "
                              f"holding a list, or expert_0..expert_{{k-1}}); header: {','.join(header)}")

        def values(row, field):
            if field in indexed:
                return [row[j].strip() for j in indexed[field] if row[j].strip() != ""]
            c = lists[field]
            return None if c is None else _split_cell(row[c])

        has_w = lists["w"] is not None or "w" in indexed
        has_l = lists["log"] is not None or "log" in indexed
        seq_ids: dict = {}
        seqs, toks, layers, lines = _ints(), _ints(), _ints(), _ints()
        where = _lines_where(path, lines)
        experts = _Rows(_int_matrix, where, "expert id", np.int64)
        weights = _Rows(_float_matrix, where, "weight", np.float32)
        logits = _Rows(_float_matrix, where, "logit", np.float32)
        k = n_log = None
        k_line = n_log_line = 0
        for row in reader:
            lineno = reader.line_num
            if not any(c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise ConfigError(f"{path}, line {lineno}: {len(row)} columns, the header has {len(header)}")
            try:
                t = int(row[c_tok])
            except ValueError:
                raise ConfigError(f"{path}, line {lineno}: token position {row[c_tok]!r} is not an "
                                  f"integer") from None
            try:
                lay = int(row[c_lay])
            except ValueError:
                raise ConfigError(f"{path}, line {lineno}: layer {row[c_lay]!r} is not an integer") from None
            s = row[c_seq].strip() if c_seq is not None else 0
            if isinstance(s, str) and re.fullmatch(r"-?\d+", s):
                s = int(s)
            so = seq_ids.get(s)
            if so is None:
                so = seq_ids[s] = len(seq_ids)
            e = values(row, "exp")
            try:
                e = [int(x) for x in e]
            except ValueError:
                raise ConfigError(f"{path}, line {lineno}: expert ids {e!r} are not all integers") from None
            if k is None:
                k, k_line = len(e), lineno
                if k == 0:
                    raise ConfigError(f"{path}, line {lineno}: empty expert list")
            elif len(e) != k:
                raise ConfigError(f"{path}, line {lineno}: {len(e)} experts, but line {k_line} has {k}: mixed top-k "
                                  f"is not supported")
            if has_w:
                w = values(row, "w")
                if len(w) != len(e):
                    raise ConfigError(f"{path}, line {lineno}: {len(w)} weights for {len(e)} experts")
                try:
                    weights.append([float(x) for x in w])
                except ValueError:
                    raise ConfigError(f"{path}, line {lineno}: weights {w!r} are not all numbers") from None
            if has_l:
                lg = values(row, "log")
                if n_log is None:
                    n_log, n_log_line = len(lg), lineno
                elif len(lg) != n_log:
                    raise ConfigError(f"{path}, line {lineno}: {len(lg)} logits, but line {n_log_line} has {n_log}")
                try:
                    logits.append([float(x) for x in lg])
                except ValueError:
                    raise ConfigError(f"{path}, line {lineno}: logits are not all numbers") from None
            seqs.append(so)
            if not (-_BIG < t < _BIG and -_BIG < lay < _BIG):
                raise ConfigError(f"{path}, line {lineno}: token position or layer out of the int64 range")
            toks.append(t)
            layers.append(lay)
            experts.append(e)
            lines.append(lineno)
    if not toks:
        raise ConfigError(f"{path}: empty file, no routing records (only a header)")
    return _Records(
        seq=np.asarray(seqs, dtype=np.int64), tok=np.asarray(toks, dtype=np.int64),
        layer=np.asarray(layers, dtype=np.int64), experts=experts.array(),
        weights=weights.array() if has_w else None, logits=logits.array() if has_l else None,
        loc=_lines_loc(lines), path=str(path),
        seq_names=list(seq_ids),
    )


# -------------------------------------------------------------------------------------------------- npy

def _parse_npy(path: Path) -> _Records:
    try:
        a = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a user error here
        raise ConfigError(f"{path}: not a readable .npy array ({e})") from None
    if not isinstance(a, np.ndarray) or a.ndim != 3:
        raise ConfigError(f"{path}: expected an integer array [tokens, layers, k], got shape "
                          f"{getattr(a, 'shape', None)}")
    if a.dtype.kind not in "iu":
        raise ConfigError(f"{path}: expected an integer array [tokens, layers, k], got dtype {a.dtype}")
    T, L, k = a.shape
    if T * L == 0:
        raise ConfigError(f"{path}: empty file, no routing records (shape {a.shape})")
    if k == 0:
        raise ConfigError(f"{path}: empty expert lists (shape {a.shape})")
    return _Records(
        seq=np.zeros(T * L, dtype=np.int64), tok=np.repeat(np.arange(T, dtype=np.int64), L),
        layer=np.tile(np.arange(L, dtype=np.int64), T), experts=a.reshape(T * L, k).astype(np.int64),
        weights=None, logits=None,
        loc=lambda i: f"record {i} (token {i // L}, layer {i % L})", path=str(path), seq_names=[0],
    )


# ------------------------------------------------------------------------------------------------- vllm

VLLM_FIELDS = ("prompt_routed_experts", "routed_experts")


def _vllm_array(path: Path, where: str, name, field: str, value) -> Optional[np.ndarray]:
    """One request's field as an integer array [tokens, layers, k] (None when absent or empty)."""
    if value is None:
        return None
    try:
        a = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ConfigError(f"{path}, {where}: {field} of request {name!r} is not a [tokens, layers, top_k] array ({e})") from None
    if a.size == 0:
        return None
    if a.ndim != 3:
        raise ConfigError(f"{path}, {where}: {field} of request {name!r} must be [tokens, layers, top_k], got shape "
                          f"{a.shape}")
    if a.dtype.kind not in "iu":
        raise ConfigError(f"{path}, {where}: {field} of request {name!r} must hold integer expert ids, got dtype {a.dtype}")
    return a


def _vllm_requests(path: Path) -> list:
    """[(request name, prompt array or None, generated array or None, where)] in file order."""
    out = []
    if path.suffix == ".npz":
        try:
            z = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a user error here
            raise ConfigError(f"{path}: not a readable .npz archive ({e})") from None
        groups: dict = {}
        with z:
            for key in z.files:
                req, _, field = key.rpartition("/")
                if field not in VLLM_FIELDS:
                    raise ConfigError(f"{path}: array {key!r} is not one of {', '.join(VLLM_FIELDS)} (optionally "
                                      f"prefixed '<request>/')")
                groups.setdefault(req, {})[field] = z[key]
        for req, g in groups.items():
            where = f"arrays {req + '/' if req else ''}*"
            out.append((req or 0, *(_vllm_array(path, where, req or 0, f, g.get(f)) for f in VLLM_FIELDS), where))
        return out
    for n, d in _json_objects(path):
        name = d.get("request_id", len(out))
        where = f"line {n}"
        out.append((name, *(_vllm_array(path, where, name, f, d.get(f)) for f in VLLM_FIELDS), where))
    return out


def _parse_vllm(path: Path) -> _Records:
    requests = _vllm_requests(path)
    if not requests:
        raise ConfigError(f"{path}: empty file, no requests")
    shape = None
    parts, seqs, prompt_len, names, locs = [], [], [], [], []
    for i, (name, prompt, gen, where) in enumerate(requests):
        if prompt is None and gen is None:
            raise ConfigError(f"{path}, {where}: request {name!r} has no routing (neither {' nor '.join(VLLM_FIELDS)})")
        for field, a in zip(VLLM_FIELDS, (prompt, gen)):
            if a is None:
                continue
            if shape is None:
                shape = a.shape[1:]
            elif a.shape[1:] != shape:
                raise ConfigError(f"{path}, {where}: {field} of request {name!r} has [layers, top_k] = "
                                  f"{list(a.shape[1:])}, the requests before it {list(shape)}")
        both = np.concatenate([a for a in (prompt, gen) if a is not None]).astype(np.int64)
        parts.append(both)
        seqs.append(np.full(len(both), i, dtype=np.int64))
        prompt_len.append(0 if prompt is None else len(prompt))
        names.append(name)
        locs.append(where)
    L, k = shape
    if k == 0:
        raise ConfigError(f"{path}: empty expert lists (top_k = 0)")
    tokens = np.concatenate(parts)  # [T, L, k]
    seq_of_token = np.concatenate(seqs)
    first = np.concatenate(([0], np.cumsum([len(x) for x in parts])))[:-1]
    tok = np.arange(len(tokens), dtype=np.int64) - first[seq_of_token]
    pl = np.asarray(prompt_len, dtype=np.int64)

    def loc(r: int) -> str:
        t, layer = divmod(r, L)
        q = int(seq_of_token[t])
        pos = int(tok[t])
        part = "prompt" if pos < pl[q] else "generated"
        return f"{locs[q]}: request {names[q]!r} token {pos} ({part}) layer {layer}"

    return _Records(
        seq=np.repeat(seq_of_token, L), tok=np.repeat(tok, L), layer=np.tile(np.arange(L, dtype=np.int64), len(tokens)),
        experts=tokens.reshape(-1, k), weights=None, logits=None, loc=loc, path=str(path), seq_names=names,
        prompt_len=pl,
    )


# ------------------------------------------------------------------------------------------------ build

def _num_experts(rec: _Records, path: Path, opts: ImportOptions) -> int:
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
    if E < 1:
        raise ConfigError(f"replay.num_experts={E} must be >= 1")
    return E


def _check_ids(rec: _Records, E: int) -> None:
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


def _build(rec: _Records, fmt: str, path: Path, opts: ImportOptions, notes: list) -> Trace:
    from ..engine.geometry import Geometry

    R, k = rec.experts.shape
    E = _num_experts(rec, path, opts)
    _check_ids(rec, E)
    if opts.top_k is not None and int(opts.top_k) != k:
        notes.append(f"replay.top_k={opts.top_k} ignored: the file's records select {k} experts")

    layer_ids = np.unique(rec.layer)
    L = len(layer_ids)
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
    P = int(cell[-1]) + 1
    cell_start = np.flatnonzero(new_cell)  # sorted-record index of each cell's first record
    cell_seq = s[cell_start]
    seq_start = np.flatnonzero(np.concatenate(([True], cell_seq[1:] != cell_seq[:-1])))
    first_cell_of_seq = np.repeat(seq_start, np.diff(np.append(seq_start, P)))
    rank = np.arange(P) - first_cell_of_seq
    # passes: one per token, except a sequence's prompt (rec.prompt_len) which is one prefill pass
    starts = np.ones(P, dtype=bool)
    if rec.prompt_len is not None:
        starts = ~((rank < rec.prompt_len[cell_seq]) & (rank > 0))
    cell_pass = np.cumsum(starts) - 1
    pass_first = np.flatnonzero(starts)
    pass_tokens = np.diff(np.append(pass_first, P))
    passes = np.empty((len(pass_first), 3), dtype=np.int64)
    passes[:, 0] = (rank[pass_first] > 0).astype(np.int64)
    passes[:, 1] = pass_tokens
    passes[:, 2] = rank[pass_first] + pass_tokens

    _check_degenerate(rec, order, lo, cell_start, layer_ids, path, notes)

    # missing (token, layer) cells
    n_missing = P * L - R
    if n_missing:
        counts = np.diff(np.append(cell_start, R))
        short = np.flatnonzero(counts < L)
        hint = _missing_hint(short, rank, counts, seq_start, P)
        listed = []
        for c in short:
            present = set(lo[cell_start[c]:cell_start[c] + counts[c]].tolist())
            r0 = int(order[cell_start[c]])
            for m in range(L):
                if m not in present:
                    listed.append(_cell_name(rec, r0, layer_ids[m]))
                    if len(listed) >= LIST_SHOWN:
                        break
            if len(listed) >= LIST_SHOWN:
                break
        more = f", ... ({n_missing - len(listed)} more)" if n_missing > len(listed) else ""
        frac = n_missing / (P * L)
        if frac > opts.max_missing:
            raise ConfigError(f"{path}: {n_missing} of {P * L} (token, layer) cells are missing ({frac:.2%}, above "
                              f"replay.max_missing={opts.max_missing}): {', '.join(listed)}{more}{hint}")
        msg = (f"skipped {n_missing} missing (token, layer) cell{'s' if n_missing != 1 else ''}: "
               f"{', '.join(listed)}{more} ({frac:.2%} of {P * L} cells; replay.max_missing={opts.max_missing}){hint}")
        notes.append(msg)
        warnings.warn(f"{path}: {msg}", stacklevel=3)

    if rec.token_order == "position":
        first_tok = t[cell_start[seq_start]]
        n_tok = np.diff(np.append(seq_start, P))
        last_tok = t[cell_start[np.append(seq_start[1:], P) - 1]]
        odd = np.flatnonzero((first_tok != 0) | (last_tok - first_tok + 1 != n_tok))
        if len(odd):
            q = int(odd[0])
            notes.append(f"{len(odd)} sequence(s) have token positions other than 0..n-1 (first: seq "
                         f"{rec.seq_names[int(cell_seq[seq_start[q]])]!r}, positions {int(first_tok[q])}.."
                         f"{int(last_tok[q])} for {int(n_tok[q])} tokens); passes follow the tokens present and "
                         f"context counts them (ordinal + 1)")

    # rows in (pass, layer, token) order: a layer call of a multi-token pass is one contiguous block of rows
    rpass = cell_pass[cell]
    regroup = np.lexsort((t, lo, rpass))
    order, rpass, lo = order[regroup], rpass[regroup], lo[regroup]
    idt = index_dtype(E)
    index = np.ascontiguousarray(rec.experts[order].astype(idt))
    weights = None if rec.weights is None else np.ascontiguousarray(rec.weights[order].astype(np.float16))
    logits = None if rec.logits is None else np.ascontiguousarray(rec.logits[order].astype(np.float32))
    call_first = np.flatnonzero(np.concatenate(([True], (rpass[1:] != rpass[:-1]) | (lo[1:] != lo[:-1]))))
    calls = np.empty((len(call_first), 4), dtype=np.int64)
    calls[:, 0] = rpass[call_first]
    calls[:, 1] = lo[call_first]
    calls[:, 2] = call_first
    calls[:, 3] = np.diff(np.append(call_first, R))

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
    notes.append("imported trace: hidden_size and dense params are 0, so no dense/attention compute time is modelled")
    if rec.weights is None:
        notes.append("the file has no router weights")
    geom = Geometry(num_layers=L, num_experts=E, top_k=int(k), expert_bytes=expert_bytes, total_bytes=total_bytes,
                    hidden_size=0, layer_ids=[int(x) for x in layer_ids])
    meta = {
        "format": FORMAT, "version": VERSION, "geometry": geom.to_dict(),
        "scoring": {"sigmoid": False, "renorm": True, "scale": 1.0},
        "store": {"native_bits": 16, "bytes_of": {"native": expert_bytes}},
        "depth": 0, "logits": "fp32" if logits is not None else "none", "index_dtype": np.dtype(idt).name,
        "source": {"format": fmt, "path": str(path), "records": int(R), "sequences": len(rec.seq_names)},
    }
    return Trace(meta=meta, passes=passes, calls=calls, index=index, weights=weights, logits=logits,
                 signal_index=None, signal_logits=None, path=str(path), notes=notes)


def _check_degenerate(rec: _Records, order, lo, cell_start, layer_ids, path: Path, notes: list) -> None:
    """Flag captures whose routing cannot be a model's (see the module docstring)."""
    P = len(cell_start)
    if P >= 2:
        ex = np.sort(rec.experts[order], axis=1)  # records in (sequence, token, layer) order
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


def _cell_name(rec: _Records, r: int, layer_id) -> str:
    """'seq S token T layer L' for record r's (sequence, token) at model layer ``layer_id``."""
    tok = rec.tok_names[r] if rec.tok_names is not None else rec.tok[r]
    name = rec.seq_names[int(rec.seq[r])]
    return f"seq {name} token {int(tok)} layer {int(layer_id)}"
