from .base import ROUTING, RoutingPolicy  # noqa: F401
