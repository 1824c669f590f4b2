from .base import PREFETCH, PrefetchPolicy  # noqa: F401
