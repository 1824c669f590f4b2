from .base import EVICTION, OrderedEviction


@EVICTION.register("fifo")
class FIFO(OrderedEviction):
    """First in, first out: the expert resident longest is evicted; hits do not reorder.
    Within one layer call, insertion is in ascending expert index (lower index leaves first)."""
