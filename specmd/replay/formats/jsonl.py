"""``jsonl``: one JSON object per (sequence, token, MoE layer) record, the shape vLLM/SGLang routing captures use.

Keys (first alias present wins): sequence ``seq|sequence|seq_id|request_id`` (any JSON scalar; 0 when absent),
token position ``token|pos|position|token_idx`` (int), layer ``layer|layer_id`` (int, the model's layer
index), experts ``experts|expert_ids|topk_ids|ids`` (list of ints), optional weights ``weights|topk_weights``
(list of floats, same length) and optional full router logits ``logits|router_logits`` (list of E floats). A
record without experts but with logits takes the top-k of its logits, k = ``ImportOptions.top_k`` (or the k
of the records before it). Blank lines are skipped. ``orjson`` is used when installed, else ``json``.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from .base import (EXPERT_KEYS, LAYER_KEYS, LOGIT_KEYS, SEQ_KEYS, TOKEN_KEYS, WEIGHT_KEYS, Columns,
                   ImportOptions, Records, json_objects, register_format, topk_of_logits)

ALIASES = {"seq": SEQ_KEYS, "tok": TOKEN_KEYS, "layer": LAYER_KEYS, "exp": EXPERT_KEYS, "w": WEIGHT_KEYS,
           "log": LOGIT_KEYS}
MISSING = object()


@register_format("jsonl")
def parse(path: Path, opts: ImportOptions, notes: list) -> Records:
    return _Reader(path, opts).read()


class _Reader:
    """One file's reading: the columns, and what the records so far fix (top-k, logit count, whether records
    carry weights and logits)."""

    def __init__(self, path: Path, opts: ImportOptions):
        self.path, self.opts = path, opts
        self.cols = Columns(path)
        self.derive: list = []  # record indices whose experts come from their logits
        self.k, self.k_line = None, 0
        self.n_logits, self.n_logits_line = opts.num_experts, 0
        self.has_w = self.has_l = None  # set by the first record
        self.first_line = 0
        self.hot = {f: a[0] for f, a in ALIASES.items()}  # the alias that matched last is tried first

    def read(self) -> Records:
        c, get = self.cols, self.get
        seq_ids, lines = c.seq_ids, c.lines
        for lineno, d in json_objects(self.path):
            i = len(lines)
            lines.append(lineno)
            s = get(d, "seq")
            if s is MISSING:
                s = 0
            try:
                so = seq_ids.get(s)
            except TypeError:
                raise ConfigError(f"{self.path}, line {lineno}: sequence id {s!r} is not a scalar") from None
            if so is None:
                so = seq_ids[s] = len(seq_ids)
            t = get(d, "tok")
            if type(t) is not int:
                self._not_int(lineno, t, "token position", TOKEN_KEYS)
            lay = get(d, "layer")
            if type(lay) is not int:
                self._not_int(lineno, lay, "layer", LAYER_KEYS)
            c.experts.append(self.routing(lineno, get(d, "exp"), get(d, "w"), get(d, "log"), i))
            c.add(lineno, so, t, lay)
        rec = c.records(self.has_w, self.has_l)
        if self.derive:
            rec.experts[self.derive] = topk_of_logits(rec.logits[self.derive], self.k)
        return rec

    def get(self, d: dict, field: str):
        """A field's value (MISSING when absent); the alias that matched last is tried first."""
        v = d.get(self.hot[field], MISSING)
        if v is not MISSING:
            return v
        for a in ALIASES[field]:
            if a in d:
                self.hot[field] = a
                return d[a]
        return MISSING

    def _not_int(self, lineno: int, v, what: str, keys: tuple):
        if v is MISSING:
            raise ConfigError(f"{self.path}, line {lineno}: no {what} (keys {'|'.join(keys)})")
        raise ConfigError(f"{self.path}, line {lineno}: {what} {v!r} is not an integer")

    # ------------------------------------------------------------------ experts, weights, logits

    def routing(self, lineno: int, e, w, lg, i: int) -> list:
        """Record ``i``'s expert list (a placeholder when it comes from the logits); keeps its weights and
        logits."""
        if w is None:
            w = MISSING
        if lg is None:
            lg = MISSING
        if self.has_w is None:
            self.has_w, self.has_l, self.first_line = w is not MISSING, lg is not MISSING, lineno
        if (w is not MISSING) != self.has_w:
            self._presence(lineno, "weights", self.has_w)
        if (lg is not MISSING) != self.has_l:
            self._presence(lineno, "logits", self.has_l)
        if self.has_l:
            if type(lg) is not list or len(lg) != self.n_logits:
                self._logits_shape(lineno, lg)
            self.cols.logits.append(lg)
        if e is MISSING or e is None:
            return self._derived(lineno, i)
        if type(e) is not list or len(e) != self.k:
            self._experts_shape(lineno, e)
        if self.has_w:
            if type(w) is not list or len(w) != len(e):
                self._weights_shape(lineno, w, e)
            self.cols.weights.append(w)
        return e

    def _presence(self, lineno: int, what: str, first: bool):
        raise ConfigError(f"{self.path}, line {lineno}: {what} {'absent' if first else 'present'} here but "
                          f"{'present' if first else 'absent'} on line {self.first_line}; every record must "
                          f"have them or none")

    def _logits_shape(self, lineno: int, lg) -> None:
        """The first record's logits fix their count (unless replay.num_experts did); a mismatch raises."""
        if type(lg) is not list:
            raise ConfigError(f"{self.path}, line {lineno}: logits must be a list of floats")
        if self.n_logits is None:
            self.n_logits, self.n_logits_line = len(lg), lineno
            return
        src = f"line {self.n_logits_line} has" if self.n_logits_line else "replay.num_experts is"
        raise ConfigError(f"{self.path}, line {lineno}: {len(lg)} logits, but {src} {self.n_logits}")

    def _experts_shape(self, lineno: int, e) -> None:
        """The first expert list fixes top-k (unless replay.top_k did, for logits-only records before it)."""
        if type(e) is not list:
            raise ConfigError(f"{self.path}, line {lineno}: experts must be a list of ints, got {e!r}")
        if self.k is None:
            self.k, self.k_line = len(e), lineno
            if self.k == 0:
                raise ConfigError(f"{self.path}, line {lineno}: empty expert list")
            return
        src = f"line {self.k_line}" if self.k_line else "replay.top_k"
        raise ConfigError(f"{self.path}, line {lineno}: {len(e)} experts, but {src} has {self.k}: mixed top-k "
                          f"is not supported")

    def _weights_shape(self, lineno: int, w, e: list):
        if type(w) is not list:
            raise ConfigError(f"{self.path}, line {lineno}: weights must be a list of floats")
        raise ConfigError(f"{self.path}, line {lineno}: {len(w)} weights for {len(e)} experts")

    def _derived(self, lineno: int, i: int) -> list:
        """A record with logits and no expert list: its experts are the top-k of its logits (filled in once
        they are all read)."""
        if not self.has_l:
            raise ConfigError(f"{self.path}, line {lineno}: no expert list (keys {'|'.join(EXPERT_KEYS)}) "
                              f"and no router logits to take the top-k of")
        if self.has_w:
            raise ConfigError(f"{self.path}, line {lineno}: weights without an expert list")
        if self.k is None:
            if self.opts.top_k is None:
                raise ConfigError(f"{self.path}, line {lineno}: no expert list, only logits; set "
                                  f"replay.top_k to take their top-k")
            self.k, self.k_line = int(self.opts.top_k), 0
        self.derive.append(i)
        return [0] * self.k  # placeholder
