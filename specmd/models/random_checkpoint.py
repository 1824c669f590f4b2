"""Random-weight checkpoints shaped like a real model, for benchmarks of models larger than memory.

:func:`write_random_checkpoint` learns every tensor's name, shape and dtype from the model built on the meta
device (nothing is allocated), then writes ``config.json`` and the weights shard by shard in transformers'
sharded safetensors format (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``), never
holding more than about one shard of tensors in memory.

Values: normal(0, 0.02) for matrices, ones for norm weights, zeros for biases. Every tensor is cut into
*pieces* (a whole tensor, or one expert's gate / up / down block of a fused expert tensor), and each piece is
drawn from its own ``torch.Generator`` seeded from (``seed``, the parameter's index in the model's state
dict, the expert, the part). The values therefore depend neither on the sharding nor on the layout: a
``hub`` and a ``transformers`` checkpoint of the same config and seed load to the same model.

Layouts:

* ``hub``: the names and shapes of the family's Hugging Face hub checkpoints, which ``from_pretrained``
  converts from (and ``save_pretrained`` converts back to), as the family's adapter declares them
  (:class:`~specmd.models.adapters.HubLayout`): the fused experts ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I] are stored per expert, e.g. ``mlp.experts.{e}.gate_proj.weight``
  [I, H], ``...up_proj.weight`` [I, H], ``...down_proj.weight`` [H, I], and the block and router under the
  hub's names.
* ``transformers``: the names transformers itself uses (fused experts), loaded without conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from ..errors import ConfigError
from .adapters import ADAPTERS

log = logging.getLogger(__name__)

LAYOUTS = ("hub", "transformers")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MARKER = "specmd-random.json"
INDEX = "model.safetensors.index.json"
WRITER_VERSION = 1  # bump when the values or the names written change: older checkpoints are then rewritten
STD = 0.02
CHUNK = 1 << 24  # float32 elements drawn at a time (64 MiB)
# config fields that are not architecture: the dtype is the writer's argument, the version is transformers'
_DROP_FIELDS = ("transformers_version", "dtype", "torch_dtype")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def checkpoints_dir() -> Path:
    """Where random checkpoints go by default: ``$SPECMD_CACHE/checkpoints``, default
    ``~/.cache/specmd/checkpoints`` (beside the quantized-expert cache)."""
    from ..quant.base import cache_dir

    return cache_dir().parent / "checkpoints"


def _hub_of(family: str):
    """The family's :class:`~specmd.models.adapters.HubLayout` (what transformers' conversion mapping declares,
    :meth:`~specmd.models.family.Adapter.hub_layout`), or None (not mapped, or a family that does not run: the
    ``transformers`` layout writes any family)."""
    from .adapters import adapter_for

    try:
        return adapter_for(family).hub_layout()
    except ConfigError:
        return None


# ---- the tensors -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """A block of one tensor drawn from its own generator: ``index`` of the parameter in the state dict,
    ``expert`` (-1: the whole tensor), ``part`` (0 gate / whole, 1 up)."""

    index: int
    expert: int
    part: int
    kind: str  # "normal" | "ones" | "zeros" | "hash:<E>" (a token -> k distinct experts of E table)


@dataclass
class _Entry:
    name: str
    shape: tuple
    dtype: torch.dtype
    # (view builder, piece): the view is taken of the tensor being filled
    pieces: list

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _kind(name: str, shape: tuple, dtype: torch.dtype, experts: int = 0) -> str:
    if name.endswith("tid2eid") and len(shape) == 2 and experts >= shape[1]:  # DeepSeek-V4's hash routing table:
        return f"hash:{experts}"  # zeros would route every token k times to expert 0 (contract.random_fill)
    if not dtype.is_floating_point:
        return "zeros"
    if len(shape) == 1 and name.endswith("norm.weight"):  # also ...layernorm.weight, q_norm/k_norm
        return "ones"
    if name.endswith("bias"):  # ...proj.bias, layernorm bias, e_score_correction_bias
        return "zeros"
    return "normal"


def _whole(t):
    return t


def _expert_rows(e: int, lo: int, hi: int):
    return lambda t: t[e, lo:hi]


def _expert(e: int):
    return lambda t: t[e]


def _state_entries(model) -> list[tuple[str, tuple, torch.dtype]]:
    """The model's persistent tensors (parameters and buffers) in state-dict order; tied ones once."""
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, tuple(t.shape), t.dtype))
    return out


_FUSED = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.mlp\.experts\.(?P<what>gate_up_proj|down_proj)$")


def _plan(tensors: list[tuple[str, tuple, torch.dtype]], layout: str, family: str, hidden: int,
          experts: int = 0) -> list[_Entry]:
    hub = _hub_of(family)
    entries = []
    for k, (name, shape, dtype) in enumerate(tensors):
        kind = _kind(name, shape, dtype, experts)
        fused = _FUSED.match(name)
        if fused is not None and hub is None:  # transformers layout, fused experts of unknown form
            fused = None
        if layout == "transformers" and fused is not None:
            # one piece per expert (and per gate / up half), as in the hub layout: the same values
            entries.append(_Entry(name, shape, dtype, _fused_pieces(k, fused["what"], shape, kind, name, hidden)))
            continue
        if fused is None:
            if layout == "hub":
                name = hub.to_hub(name)
            entries.append(_Entry(name, shape, dtype, [(_whole, _Piece(k, -1, 0, kind))]))
            continue
        pre = f"{fused['pre']}.{hub.block}.experts"
        _check_fused(fused["what"], shape, name, hidden)
        parts = hub.expert_parts(fused["what"])  # gate_up_proj: (gate, up), rows split in halves; down_proj: (down,)
        n_exp, rows, cols = shape
        for e in range(n_exp):
            for part, suffix in enumerate(parts):
                entries.append(_Entry(f"{pre}.{e}.{suffix}", (rows // len(parts), cols), dtype,
                                      [(_whole, _Piece(k, e, part, kind))]))
    return entries


def _check_fused(what: str, shape: tuple, name: str, hidden: int) -> None:
    """The hub split assumes gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    ok = len(shape) == 3 and (shape[2] == hidden and shape[1] % 2 == 0 if what == "gate_up_proj" else shape[1] == hidden)
    if not ok:
        raise ValueError(f"{name} has shape {list(shape)}; the hub layout expects "
                         f"{'[E, 2I, H]' if what == 'gate_up_proj' else '[E, H, I]'} with H={hidden}")


def _fused_pieces(k: int, what: str, shape: tuple, kind: str, name: str, hidden: int) -> list:
    _check_fused(what, shape, name, hidden)
    if what == "gate_up_proj":
        n_exp, two_i, _ = shape
        half = two_i // 2
        return [p for e in range(n_exp) for p in ((_expert_rows(e, 0, half), _Piece(k, e, 0, kind)),
                                                   (_expert_rows(e, half, two_i), _Piece(k, e, 1, kind)))]
    return [(_expert(e), _Piece(k, e, 0, kind)) for e in range(shape[0])]


def _piece_seed(seed: int, piece: _Piece) -> int:
    key = f"specmd-random/{seed}/{piece.index}/{piece.expert}/{piece.part}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _fill(view: torch.Tensor, piece: _Piece, seed: int, buf: torch.Tensor) -> None:
    if piece.kind == "ones":
        view.fill_(1)
        return
    if piece.kind == "zeros":
        view.zero_()
        return
    gen = torch.Generator().manual_seed(_piece_seed(seed, piece))
    if piece.kind.startswith("hash:"):  # each row k distinct experts of E, uniformly (a chunk of rows at a time)
        E, k = int(piece.kind[5:]), view.shape[-1]
        for start in range(0, view.shape[0], 4096):
            rows = view[start:start + 4096]
            rows.copy_(torch.rand(rows.shape[0], E, generator=gen).argsort(dim=-1)[:, :k])
        return
    flat = view.view(-1)  # every piece is a contiguous block
    for start in range(0, flat.numel(), CHUNK):
        dst = flat[start:start + CHUNK]
        if dst.dtype == torch.float32:
            dst.normal_(0.0, STD, generator=gen)
        else:  # draw in float32, then round to the checkpoint's dtype
            src = buf[:dst.numel()]
            src.normal_(0.0, STD, generator=gen)
            dst.copy_(src)


_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _shard_tensors(shard: list[_Entry], arena: torch.Tensor, seed: int, pool, local) -> dict[str, torch.Tensor]:
    """The shard's tensors, carved out of ``arena`` (reused from shard to shard: its pages are touched once)
    and filled piece by piece on the pool's threads (each piece has its own generator: the values do not
    depend on which thread draws them)."""
    data, tasks, off = {}, [], 0
    for e in shard:
        t = arena[off:off + e.nbytes].view(e.dtype).view(e.shape)
        off = _aligned(off + e.nbytes)
        data[e.name] = t
        tasks += [(view(t), piece) for view, piece in e.pieces]

    def work(task):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty(CHUNK, dtype=torch.float32)
        _fill(task[0], task[1], seed, buf)

    tasks.sort(key=lambda task: -task[0].numel())  # the largest first: the threads finish together
    for _ in pool.map(work, tasks):
        pass
    return data


def _shards(entries: list[_Entry], shard_bytes: int) -> list[list[_Entry]]:
    """Greedy in order, like transformers: a new shard when the next tensor would overflow this one."""
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


# ---- the config --------------------------------------------------------------------------------------------

def _config_fields(name_or_config: Union[str, dict]) -> dict:
    """The config's fields (``model_type`` included), from a shipped config's name or a dict."""
    if isinstance(name_or_config, str):
        from ..errors import ConfigError
        from .loader import SHIPPED_CONFIGS

        path = SHIPPED_CONFIGS / f"{name_or_config}.json"
        if not path.is_file():
            names = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))
            raise ConfigError(f"{name_or_config!r}: no shipped model config; valid choices: {', '.join(names)}")
        raw = json.loads(path.read_text())
    elif isinstance(name_or_config, dict):
        raw = dict(name_or_config)
    else:
        raise TypeError(f"name_or_config: a shipped config's name or a dict of config fields, "
                        f"not {type(name_or_config).__name__}")
    fields = {k: v for k, v in raw.items() if not k.startswith("_") and k not in _DROP_FIELDS}
    if not fields.get("model_type"):
        raise ValueError("name_or_config: the config fields have no 'model_type' (it names the family)")
    return json.loads(json.dumps(fields, sort_keys=True, default=str))  # JSON-plain, for the marker


def _validate(family: str, dtype: str, layout: str, shard_bytes: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; valid choices: {', '.join(LAYOUTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid choices: {', '.join(DTYPES)}")
    if layout == "hub" and _hub_of(family) is None:
        mapped = sorted(f for f in ADAPTERS if _hub_of(f) is not None)
        raise ValueError(f"layout='hub' is not known for the {family!r} family (its hub checkpoints' names are not "
                         f"mapped); hub layouts: {', '.join(mapped)} and the derived families whose layout "
                         f"transformers declares (specmd models); layout='transformers' writes any family")
    if not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise ValueError(f"shard_bytes={shard_bytes!r}; a positive number of bytes")


def _is_complete(out: Path, spec: dict) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
        index = json.loads((out / INDEX).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("spec") != spec or not (out / "config.json").is_file():
        return False
    return all((out / f).is_file() for f in set(index.get("weight_map", {}).values()))


def _clean_stale(out: Path) -> None:
    """Remove partial directories beside ``out`` left by writers that died."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass


# ---- the writer --------------------------------------------------------------------------------------------

def _plan_checkpoint(fields: dict, dtype: str, layout: str, shard_bytes: int):
    """The checkpoint's config, its tensors' entries and their shards, learnt from the model built on the meta
    device."""
    from .adapters import adapter_for
    from .family import build_config

    family = fields["model_type"]
    kwargs = {k: v for k, v in fields.items() if k != "model_type"}
    config = build_config(family, kwargs)
    try:
        auto = adapter_for(family).auto_class()  # (a vision-language wrapper: its image-text-to-text class)
    except ConfigError:
        from transformers import AutoModelForCausalLM as auto  # a family specmd does not run: written all the same
    with torch.device("meta"):
        model = auto.from_config(config, dtype=DTYPES[dtype])
    tensors = _state_entries(model)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    del model
    from .tiny import E_FIELDS

    text = config.get_text_config(decoder=True)
    experts = next((int(getattr(text, f)) for f in E_FIELDS if isinstance(getattr(text, f, None), int)), 0)
    entries = _plan(tensors, layout, family, config.hidden_size, experts)
    shards = _shards(entries, shard_bytes)
    return config, entries, shards


def _write_shards(tmp: Path, name: str, shards: list, seed: int, workers: int) -> tuple[dict, int]:
    """Draw and write the shards' safetensors files into ``tmp``; (tensor name -> file name, total bytes)."""
    from safetensors.torch import save_file

    n = len(shards)
    arena = torch.empty(max(sum(_aligned(e.nbytes) for e in shard) for shard in shards), dtype=torch.uint8)
    weight_map, total = {}, 0
    torch.set_num_threads(1)  # the parallelism is the pool's: one piece per thread
    with ThreadPoolExecutor(workers, thread_name_prefix="specmd-random") as pool:
        local = threading.local()
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            data = _shard_tensors(shard, arena, seed, pool, local)
            save_file(data, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o666 & ~_UMASK)  # safetensors creates its files 0600
            del data
            for e in shard:
                weight_map[e.name] = fname
                total += e.nbytes
            log.info("random checkpoint %s: wrote %s (%d tensors)", name, fname, len(shard))
    del arena
    return weight_map, total


def _write_index_and_marker(tmp: Path, entries: list, weight_map: dict, total: int, spec: dict, shard_bytes: int,
                            n: int) -> None:
    """Write the sharded checkpoint's index and specmd's marker (what was written, and how) into ``tmp``."""
    params = sum(e.nbytes // e.dtype.itemsize for e in entries)
    (tmp / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total, "total_parameters": params},
         "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (tmp / MARKER).write_text(json.dumps(
        {"spec": spec, "shard_bytes": shard_bytes, "shards": n, "tensors": len(entries),
         "total_size": total, "total_parameters": params}, indent=2, sort_keys=True) + "\n")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the written checkpoint ``tmp`` to ``out``, swapping out a stale one there."""
    if out.exists():  # a stale checkpoint of ours (other spec, or incomplete): swap it out
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def write_random_checkpoint(name_or_config: Union[str, dict], out_dir, dtype: str = "bfloat16", seed: int = 0,
                            shard_bytes: int = 2 * 1024 ** 3, layout: str = "hub") -> Path:
    """Write a random-weight checkpoint of the model ``name_or_config`` into ``out_dir`` and return its path.

    ``name_or_config``: the name of a config shipped in ``specmd/assets/configs`` (``"qwen2_moe"``) or a dict of
    config fields with ``model_type`` (e.g. ``tiny_config("olmoe").to_dict()``). ``dtype``: float32, bfloat16 or
    float16. ``layout``: ``"hub"`` (the family's hub checkpoint names, per-expert tensors) or
    ``"transformers"`` (transformers' own, fused, names). Shards hold at most ``shard_bytes`` (a larger tensor
    gets a shard of its own).

    Idempotent: the checkpoint is written into a directory beside ``out_dir`` and renamed into place when
    complete; when ``out_dir`` already holds a complete checkpoint written with the same config, dtype, seed
    and layout (its ``specmd-random.json`` says so) nothing is written. A ``out_dir`` that holds anything else
    than one of these checkpoints is left alone (FileExistsError).
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    fields = _config_fields(name_or_config)
    family = fields["model_type"]
    _validate(family, dtype, layout, shard_bytes)
    out = Path(out_dir).expanduser().absolute()
    spec = {"writer": WRITER_VERSION, "config": fields, "dtype": dtype, "seed": int(seed), "layout": layout}
    if _is_complete(out, spec):
        log.info("random checkpoint %s is up to date", out)
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise FileExistsError(f"{out} exists and is not a random checkpoint written by specmd "
                              f"(no {MARKER}); not overwriting it")

    config, entries, shards = _plan_checkpoint(fields, dtype, layout, shard_bytes)
    n = len(shards)

    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    threads = torch.get_num_threads()
    workers = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    try:
        config.save_pretrained(tmp)
        weight_map, total = _write_shards(tmp, out.name, shards, seed, workers)
        _write_index_and_marker(tmp, entries, weight_map, total, spec, shard_bytes, n)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out
