"""``python -m kvsp``: the same as the ``kvsp`` command."""

import sys

from kvsp.cli import main

sys.exit(main())
