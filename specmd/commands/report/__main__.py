"""``python -m specmd.commands.report`` (same as ``specmd report``, with its one error path: specmd.ending)."""

import sys

from ...ending import guarded
from . import main

sys.exit(guarded("specmd report", main, sys.argv[1:]))
