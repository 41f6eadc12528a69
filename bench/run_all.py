#!/usr/bin/env python3
"""Every variant side by side on one device: `python bench/run_all.py --help`.

The same harness as `loka bench` (the package loka.bench); results go to bench/results/.
"""

import sys

from loka.bench import main

if __name__ == "__main__":
    sys.exit(main())
