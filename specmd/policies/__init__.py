"""Policy families. Each family has a base class + registry in ``base.py`` and one module per policy."""

from .eviction import EVICTION
from .miss import MISS
from .prefetch import PREFETCH
from .routing import ROUTING

REGISTRIES = {"routing": ROUTING, "miss": MISS, "eviction": EVICTION, "prefetch": PREFETCH}
