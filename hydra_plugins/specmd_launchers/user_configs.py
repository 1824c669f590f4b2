"""Puts the user's specmd config directory on Hydra's search path, so ``specmd calibrate`` can write
``<dir>/hardware/<name>.yaml`` and ``hardware=<name>`` works at once (no ``hydra.searchpath`` needed)."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class SpecmdUserConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        import os

        from specmd import user_config_dir

        d = user_config_dir()
        if os.path.isdir(d):  # created by the first `specmd calibrate`; Hydra warns about a missing one
            search_path.append(provider="specmd-user", path=f"file://{d}")
