"""``python -m hstu ...``: the ``hstu`` command without its console script (same parser, same exit codes)."""

import sys

from hstu.cli import main

sys.exit(main())
