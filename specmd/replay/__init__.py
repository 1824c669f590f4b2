"""The trace driver: the trace format, importers, the replay driver, the future oracles read, trace statistics.
A driver imports nothing of the app, the commands or their orchestration (miss-ratio curves: specmd/commands/mrc.py;
many replays on every core: specmd/pool.py; recording: specmd/recorder.py) -- tests/system/test_layering.py."""
