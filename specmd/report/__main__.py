"""``python -m specmd.report`` (same as ``specmd report``, with its one error path: specmd.cli.outcome)."""

import sys

from ..cli.outcome import guarded
from . import main

sys.exit(guarded("specmd report", main, sys.argv[1:]))
