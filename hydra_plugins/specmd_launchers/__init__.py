"""specmd's Hydra launcher plugins (Hydra loads launchers only from the ``hydra_plugins`` namespace)."""
