#!/usr/bin/env python3
"""Every variant side by side on one device: `python bench/run_all.py --help`.

The same harness as `loka bench` (loka/bench.py); results go to bench/results/.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loka.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
