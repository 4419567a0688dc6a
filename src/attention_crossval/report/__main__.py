"""``python -m report``: the same as the ``attention-report`` console script."""

import sys

from attention_crossval.report.cli import main

sys.exit(main())
