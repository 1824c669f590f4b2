"""``npy``: a plain integer array ``[tokens, layers, k]``: one sequence, decode order, MoE layers ``0..L-1``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import ConfigError
from .base import ImportOptions, Records, register_format


@register_format("npy")
def parse(path: Path, opts: ImportOptions, notes: list) -> Records:
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
    return Records(
        seq=np.zeros(T * L, dtype=np.int64), tok=np.repeat(np.arange(T, dtype=np.int64), L),
        layer=np.tile(np.arange(L, dtype=np.int64), T), experts=a.reshape(T * L, k).astype(np.int64),
        weights=None, logits=None,
        loc=lambda i: f"record {i} (token {i // L}, layer {i % L})", path=str(path), seq_names=[0],
    )
