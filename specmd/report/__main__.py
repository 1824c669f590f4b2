"""``python -m specmd.report`` (same as ``specmd report``)."""

import sys

from . import main

sys.exit(main())
