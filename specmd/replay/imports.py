"""The import formats' entry points, kept here for existing callers: see :mod:`specmd.replay.formats`."""

from .formats import FORMATS, ImportOptions, Records, load_import, register_format  # noqa: F401
