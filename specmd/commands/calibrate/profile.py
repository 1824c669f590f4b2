"""A hardware profile's name and file: the name's grammar (:func:`check_name`: a config group option, no path,
no override syntax, not a shipped profile's), where it goes (:func:`check_output`), the model it is fitted on
(:func:`check_model`), its YAML (:func:`profile_yaml`) and the overrides that select it (:func:`use_command`).
Everything here is checked before calibrate measures."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
from pathlib import Path

from ...results import writable_dir

def profile_yaml(name: str, hw: dict, note: list[str]) -> str:
    """The profile as YAML: ``note`` as comment lines, then ``name`` and every field of ``hw`` (a dict field:
    one quoted key per line)."""
    lines = [f"# {line}" for line in note]
    lines.append(f"name: {name}")
    for k, v in hw.items():
        if isinstance(v, dict):
            lines.append(f"{k}:" + ("" if v else " {}"))
            lines.extend(f'  "{kk}": ' + (f"{vv:.6g}" if isinstance(vv, float) else json.dumps(vv))
                         for kk, vv in v.items())
            continue
        lines.append(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {'null' if v is None else v}")
    return "\n".join(lines) + "\n"


NAME_MAX = 100  # characters of a profile name


NAME_CHARS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # letters, digits, _ - . (not first: . -)


OVERRIDE_CHARS = "=,+~ \t[]{}()'\"$:@%*?!#&|;<>`^"  # what Hydra's override grammar (or a shell) reads as syntax


def default_name() -> str:
    """``calibrated_<host>``: the host name's first label, anything but letters, digits and _ as _."""
    host = re.sub(r"[^A-Za-z0-9_]", "_", platform.node().split(".")[0]) or "host"
    return f"calibrated_{host}"[:NAME_MAX]


def _name_problem(name: str) -> str | None:
    """What is wrong with profile name ``name`` (see :func:`check_name`), or None."""
    from ... import shipped

    if not name:
        return "a profile needs a name"
    if len(name) > NAME_MAX:
        return f"{len(name)} characters; at most {NAME_MAX}"
    if name in (".", "..") or any(c in name for c in "/\\"):
        return ("a profile name is a file name in <dir>/hardware, not a path (no / or \\, not . or ..): the "
                "profile is written to --out DIR/hardware/<name>.yaml and nowhere else")
    syntax = sorted({c for c in name if c in OVERRIDE_CHARS or c.isspace()})
    if syntax:
        return (f"{' '.join(repr(c) for c in syntax)} would break the override hardware=<name> that selects it "
                "(Hydra's override syntax)")
    if not NAME_CHARS.fullmatch(name):
        return "use letters, digits, _, - and . (not first: . or -)"
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for where, value in ((f"Hydra reads hardware={name}", OverridesParser.create().parse_override(f"hardware={name}").value()),
                         (f"the profile's YAML reads name: {name}", OmegaConf.to_container(OmegaConf.create(f"n: {name}"))["n"])):
        if value != name or not isinstance(value, str):
            return f"{where} as {'null' if value is None else f'the {type(value).__name__} {value!r}'}, not a name"
    shipped_names = {n.lower(): n for n in shipped.options("hardware")}
    for n in (name, f"{name}_disk"):  # (<name>_disk.yaml is written beside it)
        own = shipped_names.get(n.lower())
        if own == n:
            return (f"hardware={n} selects the shipped profile specmd/conf/hardware/{own}.yaml, not the calibrated "
                    "one: specmd's own configs come first on Hydra's search path (the user config directory and "
                    "hydra.searchpath are searched after them)")
        if own:
            return (f"{n} differs from the shipped profile {own} only in case: on a case-insensitive file system "
                    f"hardware={n} selects specmd/conf/hardware/{own}.yaml (first on Hydra's search path)")
    return None


def _suggest_name(name: str) -> str:
    """A valid name close to ``name``."""
    base = re.sub(r"[^A-Za-z0-9_]+", "_", name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]).strip("_")
    if not base:
        return default_name()
    for cand in (base, f"{base}_calibrated", f"box_{base}"):
        cand = cand[:NAME_MAX]
        if cand and _name_problem(cand) is None:
            return cand
    return default_name()


def check_name(name: str) -> str:
    r"""``--name``: a file name in ``<dir>/hardware`` that ``hardware=<name>`` selects -- no path (``/``, ``\``,
    ``.``, ``..``), no override syntax (``=``, ``,``, brackets, quotes, spaces ...), letters, digits, ``_``,
    ``-`` and ``.`` (not first: ``.`` or ``-``), at most :data:`NAME_MAX` characters, read back by Hydra as
    that same string (not ``null``, ``true``, ``1.5``), and not a shipped profile's name (nor ``<name>_disk``):
    specmd's configs come first on Hydra's search path, so ``hardware=a100_pcie`` would select the shipped
    profile, not the calibrated one. Returns ``name``; a ConfigError names the problem and a name that works."""
    from ...errors import ConfigError

    problem = _name_problem(name)
    if problem:
        raise ConfigError(f"--name {name!r}: {problem}; e.g. --name {_suggest_name(name)}")
    return name


def check_output(out: str | None, name: str) -> Path:
    """Where the profiles go: ``<DIR>/hardware`` of ``--out DIR`` (default: the user config directory),
    checked before any measurement -- a directory (or one that can be created: no file in its path), writable,
    and ``<name>.yaml`` / ``<name>_disk.yaml`` inside it and not directories. Returns the absolute hardware
    directory (not created)."""
    from ... import user_config_dir
    from ...errors import ConfigError

    if out is not None and not out.strip():
        raise ConfigError(f"--out {out!r}: an empty path; name a directory (default: the user config directory)")
    root = Path(out).expanduser() if out is not None else Path(user_config_dir())
    flag = f"--out {out}" if out is not None else f"the user config directory {root} ($SPECMD_CONFIG)"
    hw_dir = Path(os.path.abspath(root / "hardware"))
    writable_dir(hw_dir, flag)
    for n in (name, f"{name}_disk"):
        target = hw_dir / f"{n}.yaml"
        if not inside(target, hw_dir):
            raise ConfigError(f"--name {name!r}: {target} is not inside {hw_dir}")
        if os.path.lexists(target) and (target.is_dir() or not target.is_file()):
            raise ConfigError(f"{flag}: {target} exists and is not a file (the profile would replace it)")
    return hw_dir


def inside(path: Path, directory: Path) -> bool:
    """``path`` lies directly in ``directory`` once both are resolved (its own last component is not followed:
    os.replace replaces a link, not what it points to)."""
    d = Path(os.path.realpath(directory))
    return Path(os.path.realpath(path.parent)) == d and path.name not in ("", ".", "..")


def check_model(model: str) -> None:
    """``--model`` names a shipped model config whose checkpoint this machine can load: a local or shipped
    checkpoint, or a hub id the hub (or the local HF cache) answers -- checked before any measurement (offline,
    a hub model used to fail after the link and compute measurements, with a traceback). ConfigError for an
    unknown config or a missing shipped checkpoint, DataError for an unreachable hub."""
    from ... import shipped
    from ...errors import ConfigError

    models = shipped.options("model")
    if model not in models:  # --quick never loads it: checked here, not after minutes of fitting
        raise ConfigError(f"--model {model!r}: no such model config; valid choices: {', '.join(models)}")
    from ...models.loader import configured_model

    mcfg = configured_model(model)
    if mcfg.pretrained:
        from ...eval.mirror import require_hub_for
        from ...models.loader import resolve_pretrained

        path = resolve_pretrained(mcfg.pretrained)  # (a missing shipped checkpoint: ConfigError)
        if not os.path.isdir(os.path.expanduser(path)):
            require_hub_for(f"--model {model} (model.pretrained={mcfg.pretrained})", path)


def use_command(name: str, out_root: Path | None) -> str:
    """The run's overrides that select profile ``name``, quoted for a shell and for Hydra's override grammar:
    ``hardware=<name>``, and ``hydra.searchpath=[file://DIR]`` for a profile written with ``--out DIR``."""
    if out_root is None:
        return f"hardware={name}"
    url = f"file://{Path(os.path.abspath(out_root))}"
    if not re.fullmatch(r"[A-Za-z0-9_./:-]+", url):  # Hydra: a quoted string (a quote escaped with \, and
        # backslashes only where they precede a quote or the end), the whole override quoted for the shell
        url = '"' + re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), url) + '"'
    return f"hardware={name} " + shlex.quote(f"hydra.searchpath=[{url}]")


def small_copy_fields(report: dict) -> dict:
    """A link fit's small-copy regime as the profile's fields (:func:`~.fit.fit_link`; null: one rate)."""
    small = report.get("small_bw")
    return {"small_copy_gbps": small / 1e9 if small else None,
            "small_copy_mb": report["small_bytes"] / 1e6 if small else None}


