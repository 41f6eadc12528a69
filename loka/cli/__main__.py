"""``python -m loka.cli``: the command line without an installed entry point."""

import sys

from . import main

sys.exit(main())
