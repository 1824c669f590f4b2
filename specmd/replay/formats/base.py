"""What every import format shares: the registry of formats, the options, the records a parser returns, and
the helpers that read text records into numpy columns. :mod:`.build` turns any format's records into a
:class:`~specmd.replay.trace.Trace`."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from ...errors import ConfigError
from ...registry import import_modules

SEQ_KEYS = ("seq", "sequence", "seq_id", "request_id")
TOKEN_KEYS = ("token", "pos", "position", "token_idx")
LAYER_KEYS = ("layer", "layer_id")
EXPERT_KEYS = ("experts", "expert_ids", "topk_ids", "ids")
WEIGHT_KEYS = ("weights", "topk_weights")
LOGIT_KEYS = ("logits", "router_logits")
BIG = 1 << 62  # integers in a file must fit int64 (with room to spare)


@dataclass
class ImportOptions:
    num_experts: Optional[int] = None
    expert_bytes: Optional[int] = None
    model_bytes: Optional[int] = None
    top_k: Optional[int] = None  # only used when the file cannot tell (logits without expert lists, SGLang's flat ids)
    layers: Optional[int] = None  # the model's decoder layers, dense ones too (SGLang's flat ids)
    max_missing: float = 0.01  # fraction of (token, layer) cells that may be missing (skipped, with a note)


@dataclass
class Records:
    """What a format's parser returns: its records in file order, one per (sequence, token, layer)."""

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


Parser = Callable[[Path, ImportOptions, list], Records]  # parse(path, opts, notes) -> Records


class Formats:
    """The import formats by name: each maps to a parser ``parse(path, opts, notes) -> Records`` (``notes``: a
    list the parser may append lines to, shown with the trace). The built-in formats are the modules of
    ``package``, imported on first use like the policy registries', so a new one is one module there; a
    format defined elsewhere registers itself when its module is imported, before ``load_import`` runs."""

    RESERVED = ("specmd",)  # replay.format=specmd is a specmd trace directory, not an import

    def __init__(self, package: str):
        self.package = package
        self._parsers: dict = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[Parser], Parser]:
        """``@FORMATS.register("name")`` on a parser function."""

        def deco(parse: Parser) -> Parser:
            self._load()  # a name the built-in formats take is refused here, not when they load later
            if name in self.RESERVED:
                raise ValueError(f"import format name {name!r} is reserved")
            if self._parsers.get(name, parse) is not parse:
                raise ValueError(f"import format {name!r} registered twice")
            self._parsers[name] = parse
            return parse

        return deco

    def unregister(self, name: str) -> None:
        del self._parsers[name]

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # first: the modules' own registrations come back here
            try:
                import_modules(self.package)
            except BaseException:
                self._loaded = False
                raise

    def names(self) -> list:
        self._load()
        return sorted(self._parsers)

    def parser(self, fmt: str) -> Parser:
        self._load()
        if fmt not in self._parsers:
            raise ConfigError(f"replay.format={fmt!r} is not a supported import format; valid choices: "
                              f"{', '.join(self.names())}")
        return self._parsers[fmt]

    def choices(self, *first: str) -> "Choices":
        """``first`` then every registered format, read at each use (``in``, iteration)."""
        return Choices(first, self)


class Choices:
    def __init__(self, first: tuple, formats: Formats):
        self.first, self.formats = first, formats

    def __iter__(self) -> Iterator[str]:
        return iter((*self.first, *self.formats.names()))

    def __contains__(self, name) -> bool:
        return name in self.first or name in self.formats.names()

    def __repr__(self) -> str:
        return repr(tuple(self))


FORMATS = Formats(__name__.rpartition(".")[0])
register_format = FORMATS.register


# ------------------------------------------------------------------------------------ reading helpers

def _json_loads():
    try:
        import orjson

        return orjson.loads
    except ImportError:
        import json

        return json.loads


BOMS = {b"\xff\xfe\x00\x00": "UTF-32 LE", b"\x00\x00\xfe\xff": "UTF-32 BE", b"\xff\xfe": "UTF-16 LE",
        b"\xfe\xff": "UTF-16 BE"}


def not_utf8(path: Path, e: Optional[UnicodeDecodeError] = None) -> Optional[str]:
    """Why the text file ``path`` is not UTF-8 (a UTF-16/32 byte-order mark, or the byte ``e`` failed on) and
    how to convert it; None when it starts as UTF-8 text may. Every text format reads UTF-8 (a UTF-8 BOM is
    skipped): :func:`~.build.load_import` turns the decode error into one error naming the file."""
    with open(path, "rb") as f:
        head = f.read(4)
    for bom, name in BOMS.items():
        if head.startswith(bom):
            return f"it starts with a {name} byte-order mark; convert it: iconv -f {name.split()[0]} -t UTF-8 {path} " \
                   f"> {path}.utf8"
    if e is None:
        return None
    return f"a byte 0x{e.object[e.start]:02x} is not UTF-8; convert it to UTF-8 (iconv -f <its encoding> -t UTF-8)"


def json_objects(path: Path):
    """(line number, object) for each non-blank line of a JSON Lines file; a line that is not valid JSON or
    not an object is a ConfigError naming it (a file in UTF-16 or UTF-32 is a UnicodeDecodeError, named by
    :func:`~.build.load_import`)."""
    if not_utf8(path):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "a byte-order mark of another encoding")
    loads = _json_loads()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows editors)
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                d = loads(raw)
            except ValueError as e:
                raise ConfigError(f"{path}, line {lineno}: malformed JSON ({e})") from None
            if not isinstance(d, dict):
                raise ConfigError(f"{path}, line {lineno}: expected a JSON object, got {type(d).__name__}")
            yield lineno, d


def ints() -> array:
    """A compact growable int64 column (8 B a value, where a list of ints costs ~36)."""
    return array("q")


def lines_where(path: Path, lines: list) -> Callable[[int], str]:
    return lambda i: f"{path}, line {lines[i]}"


def lines_loc(lines: list) -> Callable[[int], str]:
    return lambda i: f"line {lines[i]}"


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def int_matrix(rows: list, where: Callable[[int], str], what: str, dtype=np.int64) -> np.ndarray:
    """Lists of equal length (checked by the caller) -> int64 [R, k]; a non-integer names its record."""
    try:
        a = np.asarray(rows)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is not None and a.ndim == 2 and a.dtype.kind in "iu":
        return a.astype(dtype, copy=False)
    for i, r in enumerate(rows):
        for v in r:
            if not is_int(v):
                raise ConfigError(f"{where(i)}: {what} {v!r} is not an integer")
            if not -BIG < v < BIG:
                raise ConfigError(f"{where(i)}: {what} {v} is out of range")
    return np.asarray(rows, dtype=dtype).reshape(len(rows), -1)


def float_matrix(rows: list, where: Callable[[int], str], what: str, dtype) -> np.ndarray:
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


class Rows:
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


class Columns:
    """The columns of a text format read one record at a time (a line each): sequence ordinals by first
    appearance of the file's ids, token keys, layer ids, line numbers, and the expert (weight, logit) rows."""

    def __init__(self, path: Path):
        self.path = path
        self.seq_ids: dict = {}  # the file's sequence id -> ordinal
        self.seqs, self.toks, self.layers, self.lines = ints(), ints(), ints(), ints()
        where = lines_where(path, self.lines)
        self.experts = Rows(int_matrix, where, "expert id", np.int64)
        self.weights = Rows(float_matrix, where, "weight", np.float32)
        self.logits = Rows(float_matrix, where, "logit", np.float32)

    def add(self, lineno: int, seq: int, tok: int, layer: int) -> None:
        """A record's sequence ordinal, token key and layer id (its line went into ``lines`` first, so that
        converting a chunk of rows can name every line of it; the caller appends its rows)."""
        if not (-BIG < tok < BIG and -BIG < layer < BIG):
            raise ConfigError(f"{self.path}, line {lineno}: token position or layer out of the int64 range")
        self.seqs.append(seq)
        self.toks.append(tok)
        self.layers.append(layer)

    def records(self, has_w: bool, has_l: bool, empty: str = "empty file, no routing records", **more) -> Records:
        """The records read (``more``: the other fields of :class:`Records`)."""
        if not self.toks:
            raise ConfigError(f"{self.path}: {empty}")
        logits = self.logits.array() if has_l else None
        return Records(
            seq=np.asarray(self.seqs, dtype=np.int64), tok=np.asarray(self.toks, dtype=np.int64),
            layer=np.asarray(self.layers, dtype=np.int64), experts=self.experts.array(),
            weights=self.weights.array() if has_w else None, logits=logits, loc=lines_loc(self.lines),
            path=str(self.path), **{"seq_names": list(self.seq_ids), **more},
        )


def drop_dense_layers(tokens: np.ndarray, notes: list, what: str) -> tuple:
    """``(tokens [T, L', k], model layer ids [L'])``: a serving engine's per-layer array ``tokens`` [T, L, k]
    (every decoder layer, MoE or not) without the rows of dense layers. vLLM's and SGLang's routing capture
    allocate ``[tokens, num_hidden_layers, top_k]`` and write only the MoE layers, so a dense layer
    (DeepSeek's and GLM's ``first_k_dense_replace``, Qwen's ``mlp_only_layers``) is all zeros: a layer whose
    every row is ``[0] * k`` (k > 1; a real router never selects one expert twice) is such a placeholder,
    dropped with a note naming it; the MoE layers keep their model layer ids."""
    T, L, k = tokens.shape
    ids = np.arange(L, dtype=np.int64)
    if k < 2 or T == 0:
        return tokens, ids
    dense = ~tokens.reshape(T, L, k).any(axis=(0, 2))  # [L]: every row of the layer all zeros
    if not dense.any() or dense.all():
        return tokens, ids
    gone = ids[dense].tolist()
    notes.append(f"{what}: layer(s) {gone} hold only zeros in every token (dense layers, which the engine's capture "
                 f"fills with placeholders): dropped; the {int((~dense).sum())} MoE layers keep their layer ids")
    return tokens[:, ~dense, :], ids[~dense]


def routing_array(path: Path, where: str, name, field: str, value) -> Optional[np.ndarray]:
    """One request's routing field (``vllm``'s ``routed_experts``, ``sglang``'s nested lists) as an integer array
    [tokens, layers, k]; None when absent or empty. A string is SGLang's base64: named as such."""
    if value is None:
        return None
    if isinstance(value, str):
        raise ConfigError(f"{path}, {where}: {field} of request {name!r} is a string (SGLang's base64 of int32, "
                          f"not vLLM's nested lists): read it with replay.format=sglang")
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


def topk_of_logits(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int64)
