"""The commands' bodies, one module (or package) each: what ``specmd <command>`` does beyond a run.

The command table (:data:`specmd.cli.COMMANDS`) is the one list and names each command's module here; the
command line (:mod:`specmd.cli`) is the only floor above. A command imports the floors below -- the runs
(:mod:`specmd.app`, :mod:`specmd.pool`, :mod:`specmd.recorder`), the drivers, the domain, the engine -- and ends
through the one error path below it (:mod:`specmd.ending`), never through the command line
(``tests/system/test_layering.py``). No command imports another's modules: what two share lives below them (the sweeps
that ``report`` and ``status`` read: :mod:`specmd.sweeps`) or here (the values of the ``<command>.key=value``
options that ``mrc`` and ``tune`` take beside the overrides).
"""

from __future__ import annotations


def split_list(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    return [v.strip() for v in value.split(",") if v.strip()]


def list_value(key: str, value: str, notes: list) -> list[str]:
    """A list option's values (``key=[a,b]`` or ``key=a,b``); a single value, ``key=a``, is the list ``[a]``, and
    ``notes`` gets a line saying so (the command prints it before any work)."""
    if not value.strip().startswith("[") and "," not in value:
        notes.append(f"{key}={value}: one value, taken as the list {key.split('.')[-1]}=[{value.strip()}]")
    return split_list(value)


def plain_value(key: str, value: str) -> str:
    """A string option's value as Hydra's override grammar reads it -- quotes removed, so
    ``tune.out='/data/a b,c'`` names the directory a run's ``hydra.run.dir='/data/a b,c'`` would -- and never
    empty (a :class:`~specmd.errors.ConfigError` naming the option)."""
    from ..errors import ConfigError

    if value[:1] in ("'", '"'):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            value = OverridesParser.create().parse_override(f"k={value}").value()
        except Exception as exc:  # noqa: BLE001 -- Hydra's grammar errors
            raise ConfigError(f"{key}={value}: not a quoted string Hydra reads ({str(exc).splitlines()[0]})") from None
    if not str(value).strip():
        raise ConfigError(f"{key}= is empty: name a directory (or leave the option out for a new one per run)")
    return str(value)
