from .stack import PolicyStack, install  # noqa: F401
