from .base import EVICTION, EvictionPolicy  # noqa: F401
