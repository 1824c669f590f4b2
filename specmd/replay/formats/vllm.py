"""``vllm``: the routing stock vLLM returns with ``--enable-return-routed-experts``.

Per request, ``prompt_routed_experts`` (the prompt's tokens) and ``routed_experts`` (the generated tokens the
model ran), each an integer array ``[tokens, MoE layers, top_k]`` (int16 in vLLM). Two containers: a ``.npz``
holding ``prompt_routed_experts`` / ``routed_experts`` for one request, or ``<request>/prompt_routed_experts``
and ``<request>/routed_experts`` for several (``np.savez(f, **arrays)``); or JSON Lines, one object per request
with ``request_id`` (optional) and the two fields as nested lists (``.tolist()`` of the arrays). Either field
may be absent (a prompt-only or decode-only capture), not both. A dense layer's rows are zeros (vLLM writes
the MoE layers of its ``[tokens, num_hidden_layers, top_k]`` buffer only): such layers are dropped with a
note, the MoE layers keep their ids (:func:`~.base.drop_dense_layers`). Unlike the per-token formats the prompt is
**one prefill pass** of its tokens, as vLLM ran it (a chunked prefill is still replayed as one pass),
followed by one decode pass per generated token; context counts the prompt.

The container is told by its first bytes, not its name: a zip is read as a ``.npz`` whatever it is called (a
renamed archive loses nothing), anything else as JSON Lines, except a file named ``.npz`` that is no zip (a
truncated download, another file renamed) and a bare ``.npy`` array (the ``npy`` format's file, which holds
no requests): both are refused naming what they are. Members are read with ``allow_pickle=False`` always:
an object array (``np.save`` of ``dtype=object``) is refused, never unpickled, and a member that cannot be
read (not a ``.npy``, truncated, failing its CRC) is a :class:`ConfigError` naming the file and the member:
a bad trace is the user's input, like every other bad file an import format reads (exit 2, one line), not
an internal error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import ConfigError
from .base import ImportOptions, Records, drop_dense_layers, json_objects, register_format, routing_array

VLLM_FIELDS = ("prompt_routed_experts", "routed_experts")
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first bytes (the second: an empty one), as np.load tells it
NPZ = f"a .npz (np.savez's zip) of {' / '.join(VLLM_FIELDS)} arrays"  # what the messages expect
MEMBER = "an integer .npy array [tokens, layers, top_k]"


@register_format("vllm")
def parse(path: Path, opts: ImportOptions, notes: list) -> Records:
    with open(path, "rb") as f:
        head = f.read(len(np.lib.format.MAGIC_PREFIX))
    if head == np.lib.format.MAGIC_PREFIX:
        raise ConfigError(f"{path}: a single .npy array, not a vllm container ({NPZ}, or JSON Lines); a bare "
                          f"[tokens, layers, top_k] array of one sequence is replay.format=npy")
    if head.startswith(ZIP_MAGIC):
        requests = _npz_requests(path)
    elif path.suffix == ".npz":
        raise ConfigError(f"{path}: not a .npz archive (it does not start with a zip's signature: truncated, or "
                          f"another file renamed?); expected {NPZ}")
    else:
        requests = _jsonl_requests(path)
    if not requests:
        raise ConfigError(f"{path}: empty file, no requests")
    L, k = _shape(path, requests)
    parts = [np.concatenate([a for a in (prompt, gen) if a is not None]).astype(np.int64)
             for _, prompt, gen, _ in requests]
    names = [name for name, *_ in requests]
    locs = [where for *_, where in requests]
    tokens, layer_ids = drop_dense_layers(np.concatenate(parts), notes, "vllm routed_experts")  # [T, L, k]
    L = len(layer_ids)
    seq_of_token = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(parts)])
    first = np.concatenate(([0], np.cumsum([len(x) for x in parts])))[:-1]
    tok = np.arange(len(tokens), dtype=np.int64) - first[seq_of_token]
    pl = np.asarray([0 if prompt is None else len(prompt) for _, prompt, _, _ in requests], dtype=np.int64)

    def loc(r: int) -> str:
        t, layer = divmod(r, L)
        layer = int(layer_ids[layer])
        q = int(seq_of_token[t])
        pos = int(tok[t])
        part = "prompt" if pos < pl[q] else "generated"
        return f"{locs[q]}: request {names[q]!r} token {pos} ({part}) layer {layer}"

    return Records(
        seq=np.repeat(seq_of_token, L), tok=np.repeat(tok, L), layer=np.tile(layer_ids, len(tokens)),
        experts=tokens.reshape(-1, k), weights=None, logits=None, loc=loc, path=str(path), seq_names=names,
        prompt_len=pl,
    )


def _shape(path: Path, requests: list) -> tuple:
    """(layers, top_k), the same for every array of every request."""
    shape = None
    for name, prompt, gen, where in requests:
        if prompt is None and gen is None:
            raise ConfigError(f"{path}, {where}: request {name!r} has no routing (neither {' nor '.join(VLLM_FIELDS)})")
        for field, a in zip(VLLM_FIELDS, (prompt, gen)):
            if a is None:
                continue
            shape = a.shape[1:] if shape is None else shape
            if a.shape[1:] != shape:
                raise ConfigError(f"{path}, {where}: {field} of request {name!r} has [layers, top_k] = "
                                  f"{list(a.shape[1:])}, the requests before it {list(shape)}")
    if shape[1] == 0:
        raise ConfigError(f"{path}: empty expert lists (top_k = 0)")
    return shape


def _npz_requests(path: Path) -> list:
    """[(request name, prompt array or None, generated array or None, where)] of a .npz, in archive order."""
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a user error here
        raise ConfigError(f"{path}: not a readable .npz archive ({type(e).__name__}: {e}; truncated?); "
                          f"expected {NPZ}") from None
    groups: dict = {}
    with z:
        for key in z.files:
            req, _, field = key.rpartition("/")
            if field not in VLLM_FIELDS:
                raise ConfigError(f"{path}: array {key!r} is not one of {', '.join(VLLM_FIELDS)} (optionally "
                                  f"prefixed '<request>/')")
            try:
                a = z[key]
            except Exception as e:  # noqa: BLE001 - truncated, CRC, object dtype, absurd header: the file's fault
                raise ConfigError(f"{path}: array {key!r} cannot be read ({type(e).__name__}: {e}); "
                                  f"expected {MEMBER}") from None
            if not isinstance(a, np.ndarray):  # np.load hands back the raw bytes of a member that is no .npy
                raise ConfigError(f"{path}: array {key!r} is not a .npy array ({len(a)} bytes of something "
                                  f"else); expected {MEMBER}")
            groups.setdefault(req, {})[field] = a
    out = []
    for req, g in groups.items():
        where = f"arrays {req + '/' if req else ''}*"
        out.append((req or 0, *(routing_array(path, where, req or 0, f, g.get(f)) for f in VLLM_FIELDS), where))
    return out


def _jsonl_requests(path: Path) -> list:
    """The same of a JSON Lines file, one request a line."""
    out = []
    for n, d in json_objects(path):
        name = d.get("request_id", len(out))
        where = f"line {n}"
        out.append((name, *(routing_array(path, where, name, f, d.get(f)) for f in VLLM_FIELDS), where))
    return out
