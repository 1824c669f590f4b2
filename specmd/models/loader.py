"""Build the model named by the ``model`` config group: a real checkpoint or a seeded tiny one."""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from .adapters import adapter_for

DTYPES = ("float32", "bfloat16", "float16")


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
        adapter_for(self.family)  # validates the family
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r}; valid choices: {', '.join(DTYPES)}")


def tiny_config(family: str, overrides: Optional[dict] = None):
    from transformers import AutoConfig

    adapter = adapter_for(family)
    kwargs = dict(adapter.tiny)
    kwargs.update(overrides or {})
    return AutoConfig.for_model(family, **kwargs)


def build_tiny(family: str, overrides: Optional[dict] = None, seed: int = 0, dtype: str = "float32"):
    """A seeded random model shaped like ``family`` (transformers' own initialisation, seeded)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    return model


ASSETS = Path(__file__).resolve().parent.parent / "assets"
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


def _is_local(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(path))


def model_geometry(cfg: ModelConfig):
    """The :class:`~specmd.engine.geometry.Geometry` of a model without loading its weights (built on the meta
    device from its config): what an imported routing trace lacks (expert bytes, roofline parameters)."""
    from transformers import AutoConfig

    if cfg.pretrained is None:
        config = tiny_config(cfg.family, dict(cfg.tiny))
    else:
        from ..eval.mirror import require_hub_for

        path = resolve_pretrained(cfg.pretrained)
        if not _is_local(path):
            require_hub_for(f"the geometry of model.pretrained={path}", path)
        config = AutoConfig.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    return _meta_geometry(config, cfg.family, cfg.dtype, cfg.trust_remote_code)


def _meta_geometry(config, family: str, dtype: str, trust_remote_code: bool = False):
    """The adapter's geometry of ``config``'s model built on the meta device (no weights are allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    return adapter_for(family).geometry(model)


SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "configs"


def shipped_geometry(name: str, dtype: str = "bfloat16"):
    """The geometry of a real model from the architecture fields of its config.json shipped in
    ``specmd/assets/configs/<name>.json`` (built on the meta device: no weights, no hub), at ``dtype``."""
    import json

    from transformers import AutoConfig

    path = SHIPPED_CONFIGS / f"{name}.json"
    if not path.is_file():
        names = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))
        raise ConfigError(f"{name!r}: no shipped model config; valid choices: {', '.join(names)}")
    fields = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    family = fields.pop("model_type")
    return _meta_geometry(AutoConfig.for_model(family, **fields), family, dtype)


def load_model(cfg: ModelConfig):
    """Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tokenizer import byte_tokenizer

    if cfg.pretrained is None:
        return build_tiny(cfg.family, dict(cfg.tiny), cfg.seed, cfg.dtype), byte_tokenizer()
    from ..eval.mirror import require_hub_for

    path = resolve_pretrained(cfg.pretrained)
    local = _is_local(path)
    if not local:
        require_hub_for(f"model.pretrained={path}", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
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
    tok = AutoTokenizer.from_pretrained(resolve_pretrained(cfg.tokenizer or cfg.pretrained), revision=cfg.revision)
    return model, tok
