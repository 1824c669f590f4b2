"""``sglang``: the routing SGLang returns with ``--enable-return-routed-experts`` and a request's
``"return_routed_experts": true``.

SGLang puts it in each response's ``meta_info["routed_experts"]``: the base64 of an int32 array (little
endian) flattened from ``[tokens, num_hidden_layers, top_k]``, which its docs restore with
``np.frombuffer(b64decode(s), dtype=np.int32).reshape(-1, layer_num, topk)`` (SGLang's
``RoutedExpertsCapturer``: a host buffer of every decoder layer, zeros where a layer routes nothing). The
file is JSON Lines, one response per line -- the ``/generate`` response (``{"text": ..., "meta_info": {...}}``),
or its ``meta_info`` alone -- or one JSON array of them. A response's tokens are its prompt's and the
generated ones it ran (``meta_info["prompt_tokens"]`` of them form the prompt: **one prefill pass**, as SGLang
ran it, then one decode pass per token, as ``vllm``); a nested list ``[tokens, layers, top_k]`` in place of
the string is read too.

A flat array does not say its shape: ``num_hidden_layers`` and ``top_k`` come from ``replay.model`` (the
model config whose routing it is; every decoder layer counted, dense ones too), or the import stops naming
that setting. Dense layers' all-zero rows are dropped with a note (:func:`~.base.drop_dense_layers`), the MoE
layers keep their layer ids. Bad input is a ConfigError naming the line and request: a string that is not
base64, a byte count that is not whole int32 rows of ``layers x top_k``.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

import numpy as np

from ...errors import ConfigError
from .base import ImportOptions, Records, drop_dense_layers, json_objects, not_utf8, register_format, routing_array

FIELD = "routed_experts"


@register_format("sglang")
def parse(path: Path, opts: ImportOptions, notes: list) -> Records:
    responses = list(_responses(path))
    if not responses:
        raise ConfigError(f"{path}: empty file, no responses")
    arrays, prompts, names, wheres = [], [], [], []
    for where, obj in responses:
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else obj
        if FIELD not in meta:
            raise ConfigError(f"{path}, {where}: no meta_info.{FIELD} (start SGLang with "
                              f"--enable-return-routed-experts and send \"return_routed_experts\": true)")
        name = meta.get("id", obj.get("rid", len(names)))
        a = _array(path, where, name, meta[FIELD], opts)
        if a.shape[0] == 0:
            continue
        arrays.append(a)
        prompts.append(_prompt_tokens(path, where, meta, a.shape[0]))
        names.append(name)
        wheres.append(where)
    if not arrays:
        raise ConfigError(f"{path}: every response's {FIELD} is empty")
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise ConfigError(f"{path}: responses of different [layers, top_k] {sorted(shapes)}: one model per file")
    tokens, layer_ids = drop_dense_layers(np.concatenate(arrays).astype(np.int64), notes, "sglang routed_experts")
    L, k = len(layer_ids), tokens.shape[2]
    lengths = [len(a) for a in arrays]
    seq_of_token = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
    first = np.concatenate(([0], np.cumsum(lengths)))[:-1]
    tok = np.arange(len(tokens), dtype=np.int64) - first[seq_of_token]

    def loc(r: int) -> str:
        t, layer = divmod(r, L)
        q = int(seq_of_token[t])
        return f"{wheres[q]}: response {names[q]!r} token {int(tok[t])} layer {int(layer_ids[layer])}"

    return Records(seq=np.repeat(seq_of_token, L), tok=np.repeat(tok, L), layer=np.tile(layer_ids, len(tokens)),
                   experts=tokens.reshape(-1, k), weights=None, logits=None, loc=loc, path=str(path),
                   seq_names=names, prompt_len=np.asarray(prompts, dtype=np.int64))


def _responses(path: Path):
    """(where, response object): JSON Lines, or one JSON array (or object) in the whole file."""
    if not_utf8(path):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "a byte-order mark of another encoding")
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith("["):
        try:
            items = json.loads(path.read_text(encoding="utf-8-sig"))
        except ValueError as e:
            raise ConfigError(f"{path}: malformed JSON ({e})") from None
        for i, obj in enumerate(items):
            if not isinstance(obj, dict):
                raise ConfigError(f"{path}, item {i}: expected a JSON object, got {type(obj).__name__}")
            yield f"item {i}", obj
        return
    try:
        objects = list(json_objects(path))
    except ConfigError:  # one response pretty-printed over several lines (json.dump(..., indent=2)): the whole file
        try:
            whole = json.loads(path.read_text(encoding="utf-8-sig"))
        except ValueError:
            raise ConfigError(f"{path}: neither JSON Lines (one response a line) nor one JSON object or array") from None
        if not isinstance(whole, dict):
            raise ConfigError(f"{path}: expected JSON objects (responses), got {type(whole).__name__}")
        objects = [(1, whole)]
    for lineno, obj in objects:
        yield f"line {lineno}", obj


def _array(path: Path, where: str, name, value, opts: ImportOptions) -> np.ndarray:
    """A response's routing as int64 ``[tokens, layers, top_k]``."""
    if isinstance(value, list):  # nested lists, checked as vllm's are
        a = routing_array(path, where, name, FIELD, value)
        return np.zeros((0, 1, 1), dtype=np.int64) if a is None else a
    if not isinstance(value, str):
        raise ConfigError(f"{path}, {where}: {FIELD} of response {name!r} is a {type(value).__name__}, not SGLang's "
                          f"base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ConfigError(f"{path}, {where}: {FIELD} of response {name!r} is not base64 ({e})") from None
    if opts.layers is None or opts.top_k is None:
        raise ConfigError(f"{path}: SGLang's {FIELD} is a flat int32 array of [tokens, num_hidden_layers, top_k], "
                          f"whose shape the file does not say: set replay.model=<the model config> (its decoder "
                          f"layers and top-k)")
    row = int(opts.layers) * int(opts.top_k) * 4
    if len(raw) % row:
        raise ConfigError(f"{path}, {where}: {FIELD} of response {name!r} holds {len(raw)} bytes, not whole tokens "
                          f"of {opts.layers} layers x top-{opts.top_k} int32 ids ({row} bytes each): another model's "
                          f"routing?")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, int(opts.layers), int(opts.top_k))


def _prompt_tokens(path: Path, where: str, meta: dict, n: int) -> int:
    """The response's prompt tokens among its ``n`` routed ones (all of them when it does not say)."""
    p = meta.get("prompt_tokens")
    if p is None:
        return n
    if isinstance(p, bool) or not isinstance(p, int) or p < 0:
        raise ConfigError(f"{path}, {where}: meta_info.prompt_tokens={p!r} is not a token count")
    return min(p, n)
