"""Errors specmd raises for bad user input. The CLI prints them without a traceback."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the valid choices."""


class DataError(RuntimeError):
    """Evaluation data cannot be found (no mirror, hub unreachable, dataset missing from the mirror)."""
