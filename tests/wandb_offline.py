"""Read back what a W&B offline run wrote (``<dir>/wandb/offline-run-*/run-*.wandb``), for tests.

wandb >= 0.19 writes runs from its Go core and ships no Python reader; the file is a LevelDB-style log
(``:W&B`` header, 32 KiB blocks, records split FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record``s.
"""

import glob
import json
import struct


def _chunks(data: bytes):
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", ident
    pos, block, buf = 7, 32768, b""
    while pos < len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def read_offline_run(root, timeout_s: float = 30.0) -> dict:
    """{"run": {name, group, job_type, tags}, "config": {...}, "history": [{...}], "summary": {...}}.

    wandb's core process may still be writing the file when ``finish`` returns on a loaded machine (seen in
    full-suite runs: no ``run`` record yet); read again until the run record and a summary are there."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = _read_offline_run(root)
        if (got["run"] and got["summary"]) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _read_offline_run(root) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"run": {}, "config": {}, "history": [], "summary": {}}
    paths = glob.glob(f"{root}/wandb/offline-run-*/run-*.wandb")
    if len(paths) != 1:
        assert len(paths) < 2, paths
        return out  # not written yet
    (path,) = paths
    val = lambda item: json.loads(item.value_json)  # noqa: E731
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    for raw in _chunks(open(path, "rb").read()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out["run"] = {"name": r.display_name, "group": r.run_group, "job_type": r.job_type, "tags": list(r.tags)}
            out["config"].update({key(i): val(i) for i in r.config.update})
        elif kind == "config":
            out["config"].update({key(i): val(i) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({key(i): val(i) for i in rec.history.item if not key(i).startswith("_")})
        elif kind == "summary":
            out["summary"].update({key(i): val(i) for i in rec.summary.update})
    return out
