"""Policy families. Each family has a base class + registry in ``base.py`` and one module per policy."""
