from .base import MISS, MissPolicy  # noqa: F401
