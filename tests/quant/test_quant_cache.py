"""The on-disk cache of HQQ-quantized expert copies (issue 10, safe caches): concurrent writers share one
quantization, a damaged or swapped file is detected, named in a warning and recomputed, and the cache key
covers every expert's weights."""

import copy
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from tests.conftest import ROOT, tiny

from specmd.quant import QUANT
from specmd.quant.base import (
    BadCacheFile,
    model_fingerprint,
    read_cache_file,
    write_cache_file,
)
from specmd.quant.hqq import HQQ

TAG = "tiny-olmoe"


def _experts():
    model = tiny("olmoe")
    return [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")], model.config.num_experts


def _build(precs):
    experts, E = _experts()
    # optimize=false: fast on random weights; the cache path is the same
    q = QUANT.build({"name": "hqq", "precisions": precs, "optimize": False})
    return q, q.build(experts, E, TAG)


def _dequant(store, prec):
    E = _experts()[1]
    return {(l, e): store.weights(l, e, prec) for l in range(4) for e in (0, 5, E - 1)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def _path(q, prec):
    experts, E = _experts()
    fp = model_fingerprint(experts, E, TAG)
    return q.cache_path(prec, fp), q.cache_key(prec, fp)


def _count_quantizations(monkeypatch):
    calls = []
    orig = HQQ._quantize_all

    def counted(self, *a, **k):
        calls.append(a[2])
        return orig(self, *a, **k)

    monkeypatch.setattr(HQQ, "_quantize_all", counted)
    return calls


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "specmd" and r.levelno == logging.WARNING]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path))
    return tmp_path / "quant"


def _damaged_file_recomputed(cache, monkeypatch, caplog, damage, reason):
    """Build int4+int8, damage the int8 file, rebuild: one warning naming the file and ``reason``, one
    re-quantization, numbers equal to the fresh ones, a valid file afterwards and a quiet third build."""
    q, store = _build(["int4", "int8"])
    ref = _dequant(store, "int8")
    path, key = _path(q, "int8")
    damage(path, _path(q, "int4")[0])
    calls = _count_quantizations(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="specmd"):
        _, again = _build(["int8"])
    msgs = _warnings(caplog)
    # (the reason is matched after the path: pytest's tmp_path holds the test's name)
    assert len(msgs) == 1 and f"{path} is unusable: {reason}" in msgs[0], msgs
    assert calls == ["int8"]
    assert _same(_dequant(again, "int8"), ref)
    read_cache_file(path, key)  # valid again
    assert len(list(cache.glob(path.name + ".bad-*"))) == 1  # the damaged file, moved aside
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specmd"):
        _, third = _build(["int8"])
    assert calls == ["int8"] and not _warnings(caplog)
    assert _same(_dequant(third, "int8"), ref)
    return ref, _dequant(store, "int4")


def test_truncated_file_is_named_and_recomputed(cache, monkeypatch, caplog):
    def truncate(path, _):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    _damaged_file_recomputed(cache, monkeypatch, caplog, truncate, "truncated")


def test_swapped_precision_file_is_a_key_mismatch(cache, monkeypatch, caplog):
    def swap(path, int4_path):
        path.write_bytes(int4_path.read_bytes())

    ref8, ref4 = _damaged_file_recomputed(cache, monkeypatch, caplog, swap, "key mismatch: holds int4, expected int8")
    assert not _same(ref8, ref4)


def test_flipped_payload_byte_is_a_checksum_mismatch(cache, monkeypatch, caplog):
    def flip(path, _):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40  # inside the packed weights: torch alone would read wrong numbers
        path.write_bytes(bytes(data))

    _damaged_file_recomputed(cache, monkeypatch, caplog, flip, "checksum mismatch")


def test_temporary_names_are_unique(tmp_path, monkeypatch):
    moves = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moves.append((str(src), str(dst))), real(src, dst)))
    path = tmp_path / "x.pt"
    for _ in range(2):
        write_cache_file(path, {"k": 1}, {"t": torch.arange(3)})
    (a, dst), (b, _) = moves
    assert dst == str(path) and a != b and str(os.getpid()) in a and str(os.getpid()) in b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt"]
    assert torch.equal(read_cache_file(path, {"k": 1})["t"], torch.arange(3))


@pytest.mark.parametrize("content, reason", [(b"", "truncated"), (b"SPECMD", "truncated"),
                                             (b"PK\x03\x04 an old torch.save file", "not a specmd cache file")])
def test_foreign_or_empty_file_is_bad(tmp_path, content, reason):
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(BadCacheFile, match=reason):
        read_cache_file(path, {"k": 1})


def test_fingerprint_covers_every_expert():
    experts, E = _experts()
    other = copy.deepcopy(experts)
    base = model_fingerprint(experts, E, TAG)
    assert model_fingerprint(other, E, TAG) == base
    assert model_fingerprint(other, E, TAG + "x") != base
    with torch.no_grad():
        other[2].down_proj[E - 1, 3, 4] += 1e-3  # neither expert 0 nor layer 0
    assert model_fingerprint(other, E, TAG) != base
    with torch.no_grad():
        other[2].down_proj[E - 1, 3, 4] = experts[2].down_proj[E - 1, 3, 4]
    assert model_fingerprint(other, E, TAG) == base


_WORKER = r"""
import sys, time
from pathlib import Path
import torch
from specmd.models.loader import build_tiny
from specmd.quant import QUANT
from specmd.quant.hqq import HQQ

out, ready, go = map(Path, sys.argv[1:4])
calls = []
orig = HQQ._quantize_fused
def slow(self, *a, **k):  # widen the window in which both processes would quantize
    calls.append(1)
    time.sleep(0.1)
    return orig(self, *a, **k)
HQQ._quantize_fused = slow
model = build_tiny("olmoe")
experts = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
E = model.config.num_experts
q = QUANT.build({"name": "hqq", "precisions": ["int4"], "optimize": False})
ready.touch()
while not go.exists():
    time.sleep(0.005)
store = q.build(experts, E, "tiny-olmoe")
w = {(l, e): store.weights(l, e, "int4") for l in range(4) for e in (0, 5, E - 1)}
torch.save({"quantized_tensors": len(calls), "w": w}, out)
"""


def test_concurrent_processes_quantize_once(cache, tmp_path, monkeypatch):
    env = {**os.environ, "SPECMD_CACHE": str(tmp_path)}
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        args = [str(tmp_path / f"out{i}.pt"), str(tmp_path / f"ready{i}"), str(go)]
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()  # both start building at the same moment
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    res = [torch.load(tmp_path / f"out{i}.pt", weights_only=True) for i in range(2)]
    # exactly one process quantized (4 layers x 2 fused tensors); the other waited and loaded its file
    assert sorted(r["quantized_tensors"] for r in res) == [0, 8]
    assert _same(res[0]["w"], res[1]["w"])
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].endswith(".pt"), files  # no stray temporary or bad files
    q = QUANT.build({"name": "hqq", "precisions": ["int4"], "optimize": False})
    read_cache_file(*_path(q, "int4"))
    # the same numbers as a fresh quantization in this process
    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path / "fresh"))
    _, store = _build(["int4"])
    assert _same(_dequant(store, "int4"), res[0]["w"])


def test_a_cached_copy_is_three_tensors_per_layer_weight_and_each_expert_is_its_own_quantization():
    """The file holds each layer's weight as ``wq``/``scale``/``zero`` ``[E, ...]`` tensors, not three per expert
    (torch.load spends ~15 us a tensor: the tiny model's 1,536 per-expert tensors loaded slower than they
    quantize); row ``e`` is expert ``e``'s copy, equal to HQQ quantizing that expert alone (optimize off)."""
    from hqq.core.quantize import Quantizer

    from specmd.quant.base import expert_params
    from specmd.quant.hqq import dequantize

    q, store = _build(["int4"])
    layers = read_cache_file(*_path(q, "int4"))
    experts, E = _experts()
    assert len(layers) == len(experts)
    for layer in layers:
        for w in layer.values():
            assert sorted(w) == ["meta", "scale", "wq", "zero"] and all(w[k].shape[0] == E for k in ("wq", "scale", "zero"))
    name, p = expert_params(experts[1], E)[0]
    for e in (0, 5, E - 1):
        wq, meta = Quantizer.quantize(p[e].detach().float(), nbits=4, group_size=64, optimize=False, axis=1,
                                      compute_dtype=torch.float32, device="cpu")
        meta["scale"], meta["zero"] = meta["scale"].half().float(), meta["zero"].half().float()  # stored as fp16
        alone = Quantizer.dequantize(wq, meta).reshape(p.shape[1:])
        w = layers[1][name]
        assert torch.equal(dequantize(w["wq"][e], w["scale"][e], w["zero"][e], w["meta"], "cpu").reshape(p.shape[1:]),
                           alone)
        assert torch.equal(store.weights(1, e, "int4")[name].float(), alone.to(p.dtype).float())
