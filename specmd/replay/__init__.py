"""Trace replay: the trace format, importers, the replay driver, the future oracles read, miss-ratio curves."""
