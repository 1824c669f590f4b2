"""specmd: declarative experiments on expert caching for MoE inference under memory limits."""

from pathlib import Path

from . import native

native.select()  # compiled engine and policies, or their pure-Python sources (specmd/native.py)

__version__ = "0.1.0"
# The Hydra configs ship inside the package (package data), so an installed wheel runs from any directory; a
# user's own config directory joins the search path with hydra.searchpath=[file:///path/to/conf].
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
# What the package ships besides code: the embedded models (weights, cards, ml eviction networks) and real
# models' configs (specmd/assets/configs); ``specmd:<name>`` names a directory here.
ASSETS = Path(__file__).resolve().parent / "assets"


def _register_resolvers() -> None:
    from . import shipped  # ${specmd_unique:} and ${specmd_job:...}, used by the configs' directories

    shipped.register_resolvers()


_register_resolvers()


def user_config_dir() -> str:
    """The user's specmd config directory, on Hydra's search path (``specmd calibrate`` writes hardware
    profiles to ``<it>/hardware/``): ``$SPECMD_CONFIG``, else ``$XDG_CONFIG_HOME/specmd``, else
    ``~/.config/specmd``."""
    import os

    d = os.environ.get("SPECMD_CONFIG")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "specmd")
