"""specmd: declarative experiments on expert caching for MoE inference under memory limits."""

__version__ = "0.1.0"
