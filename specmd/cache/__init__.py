from .manager import CacheManager, Geometry  # noqa: F401
from .stats import CacheStats  # noqa: F401
