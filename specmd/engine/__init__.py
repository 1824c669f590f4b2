"""The model-free engine (cache manager + clock + policies) that both drivers feed: see ``engine.py``."""

from .engine import GROUPS, Engine, ModelView, StackSpec  # noqa: F401
from .geometry import Geometry, pool_capacities  # noqa: F401
from .record import GateRecord, LiveRecord, Scoring  # noqa: F401
from .events import PoolLayout, ResidencyEvents  # noqa: F401
