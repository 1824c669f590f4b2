"""Build the model named by the ``model`` config group: a real checkpoint or a seeded tiny one."""

from __future__ import annotations

import os
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Optional

from .. import ASSETS  # specmd:<name> resolves here (re-exported)
from ..errors import ConfigError
from .adapters import adapter_for, families

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # model.family: the family the checkpoint's config.json names (model=hf)


@dataclass
class ModelConfig:
    name: str = "tiny_olmoe"
    family: str = "olmoe"
    # Hub id, local directory, or specmd:<name> (a checkpoint shipped in specmd/assets/<name>);
    # null builds a seeded random model from `tiny`.
    pretrained: Optional[str] = None
    revision: Optional[str] = None
    dtype: str = "float32"
    seed: int = 0
    # Config overrides for the random model (merged over the family's tiny defaults).
    tiny: dict = field(default_factory=dict)
    tokenizer: Optional[str] = None  # defaults to `pretrained`; random models use the built-in byte tokenizer
    trust_remote_code: bool = False

    def __post_init__(self):
        if self.family == AUTO:
            if not self.pretrained:
                raise ConfigError(f"model.family={AUTO} reads the family from a checkpoint's config.json, and "
                                  f"model.pretrained is null: set model.pretrained=DIR_OR_HUB_ID, or name a family "
                                  f"for a random model ({', '.join(families())})")
        else:
            from .derive import text_family

            self.family = text_family(self.family)  # (a wrapper whose causal LM is its text model runs as that)
            adapter_for(self.family)  # validates the family
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r}; valid choices: {', '.join(DTYPES)}")


def tiny_config(family: str, overrides: Optional[dict] = None):
    """``family``'s tiny config: its record's ``tiny`` with ``overrides`` set (a wrapper's sub-config given as a
    mapping, ``text_config``, merged key by key)."""
    from .family import build_config

    kwargs = dict(adapter_for(family).tiny)
    for k, v in (overrides or {}).items():
        kwargs[k] = dict(kwargs[k], **v) if isinstance(v, dict) and isinstance(kwargs.get(k), dict) else v
    return build_config(family, kwargs)


def _adopt(model) -> None:
    from .contract import adopt  # (torch: imported with the model, not with the configuration checks)

    adopt(model)


def build_tiny(family: str, overrides: Optional[dict] = None, seed: int = 0, dtype: str = "float32"):
    """A seeded random model shaped like ``family`` (transformers' own initialisation, seeded)."""
    import torch

    cfg = tiny_config(family, overrides)
    torch.manual_seed(seed)
    model = adapter_for(family).auto_class().from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    _adopt(model)
    from .contract import random_fill

    random_fill(model, seed)
    return model


ASSET_PREFIX = "specmd:"


def resolve_pretrained(path: str) -> str:
    """``specmd:<name>`` names a checkpoint shipped in ``specmd/assets/<name>``; anything else is a hub id
    or a local directory."""
    if path.startswith(ASSET_PREFIX):
        name = path[len(ASSET_PREFIX):]
        local = ASSETS / name
        if not (local / "config.json").is_file():
            shipped = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file()) if ASSETS.is_dir() else []
            raise ConfigError(f"model.pretrained={path}: no shipped checkpoint {name!r}; shipped: {', '.join(shipped) or 'none'}")
        return str(local)
    return path


def check_tiny(cfg: "ModelConfig") -> None:
    """``model.tiny`` (overrides of a random model's config) before any model work: it applies only to a random
    model (``model.pretrained=null``: a checkpoint's own config wins, so the keys would be ignored), each key
    is a field of the family's config, each number finite, and the model it describes is an MoE model
    (built on the meta device: at least one MoE layer, experts >= 1, top-k in 1..experts). transformers
    accepts unknown keys silently and fails late, with a traceback, on the others."""
    import math

    from transformers import AutoConfig

    if not cfg.tiny:
        return
    if cfg.pretrained is not None:
        raise ConfigError(f"model.tiny={cfg.tiny} configures a random model, and model.pretrained={cfg.pretrained} "
                          f"loads a checkpoint with its own config: set model.pretrained=null or drop model.tiny")
    known = set(AutoConfig.for_model(cfg.family).to_dict())
    unknown = sorted(set(cfg.tiny) - known)
    if unknown:
        raise ConfigError(f"model.tiny: unknown key(s) {unknown} for family {cfg.family}; the family's tiny "
                          f"defaults set {', '.join(sorted(adapter_for(cfg.family).tiny))}")
    for key, v in cfg.tiny.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"model.tiny.{key}={v} must be a finite number")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ConfigError(f"model.tiny.{key}={v} must be >= 0")
    try:
        geom = _meta_geometry(tiny_config(cfg.family, dict(cfg.tiny)), cfg.family, cfg.dtype)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- transformers' own validation: the message names the field
        raise ConfigError(f"model.tiny={cfg.tiny}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not 1 <= geom.top_k <= geom.num_experts:
        raise ConfigError(f"model.tiny={cfg.tiny}: top-k {geom.top_k} must be in 1..{geom.num_experts} (the "
                          f"experts per MoE layer)")


def check_checkpoint(pretrained: str) -> None:
    """Before the model loads: a local checkpoint (a path: it starts with ``/``, ``.`` or ``~``, or exists)
    must be a directory with a readable ``config.json``; the error names the path. A hub id (``org/name``)
    is left to the hub."""
    import json

    path = resolve_pretrained(pretrained)
    local = os.path.expanduser(path)
    if not (path.startswith(("/", ".", "~")) or os.path.exists(local)):
        return
    if not os.path.isdir(local):
        raise ConfigError(f"model.pretrained={pretrained}: no such directory ({os.path.abspath(local)})")
    cfg = Path(local) / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"model.pretrained={pretrained}: {cfg} not found (a checkpoint directory holds config.json "
                          f"and the weights)")
    try:
        json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.pretrained={pretrained}: {cfg} is not valid JSON ({exc})") from None


def checkpoint_config(pretrained: str, revision: Optional[str] = None, hub: bool = False) -> Optional[dict]:
    """The ``config.json`` of checkpoint ``pretrained`` as a mapping, read alone -- no weight is touched: a
    local directory's file, the shipped copy of a hub checkpoint's (``specmd/assets/configs``), the copy in
    the local Hugging Face cache, or (``hub``) the hub's file. None where none of them is at hand."""
    import json

    path = resolve_pretrained(pretrained)
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return json.loads((Path(local) / "config.json").read_text())  # (check_checkpoint: it is readable JSON)
    if revision is None:
        shipped = shipped_config_of(path)
        if shipped is not None:
            return json.loads((SHIPPED_CONFIGS / f"{shipped}.json").read_text())
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 -- not a repo id the cache knows: the hub, or nothing
        cached = None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    if not hub:
        return None
    from transformers import PretrainedConfig

    from ..eval.mirror import require_hub_for

    require_hub_for(f"the config.json of model.pretrained={path}", path)
    return PretrainedConfig.get_config_dict(path, revision=revision)[0]


def resolve_family(cfg: ModelConfig) -> None:
    """Before any weight loads: the family of ``cfg``'s checkpoint from its ``config.json`` (``model_type``)
    -- ``model.family=auto`` takes it, a named family must match it -- and a family specmd does not run is
    refused here, in a second, naming the family and the ones that run (a 106 B checkpoint used to load
    fully before a one-line refusal). A hub checkpoint with a named family is checked where its config is at
    hand without the hub (shipped, cached), else when it loads. Errors: ConfigError."""
    if not cfg.pretrained:
        return
    config = checkpoint_config(cfg.pretrained, cfg.revision, hub=cfg.family == AUTO)
    if config is None:
        return
    model_type = config.get("model_type") if isinstance(config, dict) else None
    where = f"model.pretrained={cfg.pretrained}"
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{where}: its config.json names no model_type, so its family is unknown")
    from .derive import text_family

    named, model_type = model_type, text_family(model_type)  # Qwen3.5-MoE's checkpoints run as its text model
    try:
        adapter_for(model_type)  # a record, or one derived from transformers' own classes
    except ConfigError as exc:
        raise ConfigError(f"{where} is a {named!r} model: {exc}") from None
    if cfg.family not in (AUTO, model_type):
        raise ConfigError(f"{where} is a {model_type!r} model (its config.json) but model.family={cfg.family!r}: "
                          f"set model.family={model_type}, or use model=hf to take the checkpoint's own family")
    cfg.family = model_type


def _is_local(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(path))


def model_geometry(cfg: ModelConfig):
    """The :class:`~specmd.engine.geometry.Geometry` of a model without loading its weights (built on the meta
    device from its config): what an imported routing trace lacks (expert bytes, roofline parameters)."""
    from transformers import AutoConfig

    if cfg.family == AUTO:  # (a config built outside a run: the run's checks resolved it already)
        resolve_family(cfg)
    if cfg.pretrained is None:
        config = tiny_config(cfg.family, dict(cfg.tiny))
    else:
        from ..eval.mirror import require_hub_for

        path = resolve_pretrained(cfg.pretrained)
        if not _is_local(path):
            shipped = shipped_config_of(path) if cfg.revision is None else None
            if shipped is not None:  # the architecture fields ship with specmd: no hub needed
                return shipped_geometry(shipped, cfg.dtype)
            require_hub_for(f"the geometry of model.pretrained={path}", path)
        config = AutoConfig.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    return _meta_geometry(config, cfg.family, cfg.dtype, cfg.trust_remote_code)


def _meta_geometry(config, family: str, dtype: str, trust_remote_code: bool = False):
    """The adapter's geometry of ``config``'s model built on the meta device (no weights are allocated)."""
    import torch

    adapter = adapter_for(family)
    with torch.device("meta"):
        model = adapter.auto_class().from_config(config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    _adopt(model)  # (what an expert is: LongCat-Flash's up projection has rows for its identity experts too)
    return adapter.geometry(model)


SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "configs"


def configured_model(name: str) -> "ModelConfig":
    """The model config ``specmd/conf/model/<name>.yaml`` (``model=<name>``), validated: what a command given
    ``--model <name>`` loads (calibrate, fidelity, the benchmarks)."""
    from omegaconf import OmegaConf

    from .. import CONF_DIR
    from ..registry import build_params

    raw = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{name}.yaml"))
    return build_params(ModelConfig, dict(raw), "model")


def load_configured(name: str):
    """``(model, its ModelConfig)`` of :func:`configured_model` ``name``, loaded."""
    cfg = configured_model(name)
    return load_model(cfg)[0], cfg


def shipped_geometry(name: str, dtype: str = "bfloat16"):
    """The geometry of a real model from the architecture fields of its config.json shipped in
    ``specmd/assets/configs/<name>.json`` (built on the meta device: no weights, no hub), at ``dtype``; or,
    for ``name`` a family specmd runs, of its transformers config class's defaults -- the real model that
    class documents (``specmd models`` names it: GLM-4.5-Air for ``glm4_moe``, Qwen3-Next-80B-A3B for
    ``qwen3_next``)."""
    import json

    from transformers import AutoConfig

    path = SHIPPED_CONFIGS / f"{name}.json"
    if not path.is_file():
        family = _runnable(name)
        if family is not None:  # the defaults of transformers' config class: the real model they instantiate
            try:
                return _meta_geometry(AutoConfig.for_model(family), family, dtype)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 -- defaults that build no model specmd can measure
                raise ConfigError(f"{name!r}: the defaults of transformers' {family} config class do not build a "
                                  f"model to take sizes from ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})") \
                    from None
        names = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))
        raise ConfigError(f"{name!r}: no shipped model config; valid choices: {', '.join(names)}, or a family "
                          f"that runs (its transformers config class's defaults: specmd models)")
    fields = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    family = fields.pop("model_type")
    return _meta_geometry(AutoConfig.for_model(family, **fields), family, dtype)


def _runnable(name: str) -> Optional[str]:
    """``name`` when it is a model family specmd runs (a record, or derived), else None."""
    from .derive import moe_families

    if name not in families() and name not in moe_families():
        return None
    try:
        adapter_for(name)
    except ConfigError:
        return None
    return name


def shipped_config_of(repo: str) -> Optional[str]:
    """The name of the shipped config (``specmd/assets/configs/<name>.json``) taken from hub checkpoint
    ``repo`` (its ``_source`` field starts with the repo id), or None."""
    import json

    for path in sorted(SHIPPED_CONFIGS.glob("*.json")):
        if json.loads(path.read_text()).get("_source", "").split(" ")[0] == repo:
            return path.stem
    return None


def checkpoint_of(model) -> Optional[str]:
    """One identity of a model however it is named: a model config (a mapping or :class:`ModelConfig`: its
    ``pretrained``), a model config's name (``specmd/conf/model/<name>.yaml``: its ``pretrained``), or a
    checkpoint id or path (itself); None for a seeded random model or nothing. ``tiny``, ``{"name": "tiny",
    ...}`` and ``specmd:tiny-olmoe`` are one model (tune compared a trace's checkpoint with a config's name)."""
    from ..shipped import CONF, load

    if model is None or model == "":
        return None
    if isinstance(model, dict):
        return model.get("pretrained") if model.get("pretrained") else checkpoint_of(model.get("name"))
    if isinstance(model, ModelConfig):
        return model.pretrained
    model = str(model)
    if "/" not in model and ":" not in model and (CONF / "model" / f"{model}.yaml").is_file():
        return load("model", model).get("pretrained")
    return model


def model_override(checkpoint: str) -> str:
    """The override that runs ``checkpoint``: ``model=<name>`` of the shipped model config that loads it, else
    ``model=hf model.pretrained=<checkpoint>``."""
    from ..shipped import CONF, load

    names = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if load("model", p.stem).get("pretrained") == checkpoint)
    return f"model={names[0]}" if names else f"model=hf model.pretrained={checkpoint}"


def local_checkpoint(pretrained: str) -> Optional[str]:
    """The local directory ``pretrained`` names (``specmd:<name>`` or a path), or None for a hub id."""
    path = os.path.expanduser(resolve_pretrained(pretrained))
    return path if os.path.isdir(path) else None


def load_model(cfg: ModelConfig, experts_on_meta: bool = False):
    """Returns (model, tokenizer). ``experts_on_meta``: the routed experts' weights are never materialised
    (they stay on the meta device; ``execution=offload execution.host=disk`` reads them from the checkpoint
    per expert), only the dense weights load -- how a model larger than host memory runs."""
    import torch
    from transformers import AutoTokenizer

    from .tokenizer import byte_tokenizer

    if cfg.family == AUTO:  # (a config built outside a run: the run's checks resolved it already)
        resolve_family(cfg)
    if experts_on_meta:
        path = local_checkpoint(cfg.pretrained) if cfg.pretrained else None
        if path is None:
            raise ConfigError(f"model.pretrained={cfg.pretrained}: reading experts from disk needs a local checkpoint")
        model = load_dense(path, cfg)
        tok = AutoTokenizer.from_pretrained(resolve_pretrained(cfg.tokenizer or cfg.pretrained), revision=cfg.revision)
        return model, tok
    if cfg.pretrained is None:
        return build_tiny(cfg.family, dict(cfg.tiny), cfg.seed, cfg.dtype), byte_tokenizer()
    from ..eval.mirror import require_hub_for

    path = resolve_pretrained(cfg.pretrained)
    local = _is_local(path)
    if not local:
        require_hub_for(f"model.pretrained={path}", path)
    try:
        model = adapter_for(cfg.family).auto_class().from_pretrained(
            path, revision=cfg.revision, dtype=getattr(torch, cfg.dtype),
            trust_remote_code=cfg.trust_remote_code,
        )
    except Exception as exc:
        if not local:
            raise
        from ..errors import DataError  # a local checkpoint's files are the user's data: name them

        files = ", ".join(sorted(p.name for p in Path(os.path.expanduser(path)).iterdir()))
        raise DataError(f"model.pretrained={cfg.pretrained}: the checkpoint in {os.path.abspath(os.path.expanduser(path))} "
                        f"could not be loaded ({type(exc).__name__}: {exc}); its files: {files}") from exc
    if model.config.model_type != cfg.family:
        raise ConfigError(
            f"model.pretrained={cfg.pretrained} is a {model.config.model_type!r} model but model.family={cfg.family!r}"
        )
    model.eval()
    _adopt(model)
    tok = AutoTokenizer.from_pretrained(resolve_pretrained(cfg.tokenizer or cfg.pretrained), revision=cfg.revision)
    return model, tok


def _build_experts_on_meta(config, cfg: ModelConfig, adapter):
    """The model of ``config`` built with its experts class's ``__init__`` under ``torch.device("meta")``."""
    import contextlib

    import torch
    from transformers.initialization import no_init_weights

    auto = adapter.auto_class()
    with torch.device("meta"):
        skeleton = auto.from_config(config, dtype=getattr(torch, cfg.dtype),
                                                    trust_remote_code=cfg.trust_remote_code)
    experts_cls = type(adapter.experts(skeleton, adapter.moe_layers(skeleton)[0]))
    del skeleton
    original = experts_cls.__init__

    def meta_init(self, *args, **kwargs):
        with torch.device("meta"):
            original(self, *args, **kwargs)

    experts_cls.__init__ = meta_init
    try:
        with no_init_weights() if callable(no_init_weights) else contextlib.nullcontext():
            model = auto.from_config(config, dtype=getattr(torch, cfg.dtype), trust_remote_code=cfg.trust_remote_code)
    finally:
        experts_cls.__init__ = original
    return model


def load_dense(path: str, cfg: ModelConfig):
    """The model of the checkpoint in ``path`` with its dense weights loaded and its routed experts left on
    the meta device (no bytes): the experts class's ``__init__`` runs under ``torch.device("meta")`` while the
    model is built, then every non-expert tensor of the checkpoint's safetensors files is loaded (names as
    transformers uses them, or the hub's renamed by the adapter's :meth:`~.adapters.HubLayout.from_hub`). A dense weight the
    checkpoint lacks is a DataError naming it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from ..errors import DataError

    from .derive import text_family

    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if text_family(config.model_type) != cfg.family:
        raise ConfigError(f"model.pretrained={cfg.pretrained} is a {config.model_type!r} model but model.family={cfg.family!r}")
    adapter = adapter_for(cfg.family)
    model = _build_experts_on_meta(config, cfg, adapter)
    wanted = {n for n, p in model.named_parameters() if not p.is_meta}
    wanted |= {n for n, b in model.named_buffers() if not b.is_meta and n in model.state_dict()}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DataError(f"model.pretrained={cfg.pretrained}: no *.safetensors files in {path}")
    loaded = set()
    for f in files:
        try:
            part = _dense_tensors(f, adapter, wanted, safe_open)
        except Exception as exc:  # a truncated or corrupt shard: the user's data, named
            raise DataError(f"model.pretrained={cfg.pretrained}: {f} could not be read ({type(exc).__name__}: "
                            f"{exc})") from exc
        model.load_state_dict(part, strict=False)
        loaded |= set(part)
        del part
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        loaded |= {n for n in wanted if n.startswith(adapter.head_path + ".")}
    missing = sorted(n for n in wanted - loaded if not n.endswith("inv_freq"))
    if missing:
        raise DataError(f"model.pretrained={cfg.pretrained}: {path} lacks dense weights {missing[:6]}"
                        f"{' ...' if len(missing) > 6 else ''} (read as transformers names them)")
    model.eval()
    _adopt(model)
    return model


_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj|up_proj)")  # per-expert or fused


def _dense_tensors(path, adapter, wanted: set, safe_open) -> dict:
    """The dense (non-expert) tensors of one safetensors file, under transformers' names."""
    hub = adapter.hub_layout()
    part = {}
    with safe_open(str(path), framework="pt") as st:
        for name in st.keys():
            if _EXPERT_TENSOR.search(name):  # (a bias the hub keeps beside its experts is dense: Laguna's)
                continue
            target = hub.from_hub(name) if hub else name
            if target in wanted:
                part[target] = st.get_tensor(name)
    return part
