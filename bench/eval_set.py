#!/usr/bin/env python3
"""The evaluation set of this repository (bench/evalset/) through ``loka.bench.evalset``:
the same as ``loka bench --eval-set bench/evalset``, with every option of the harness.

    python bench/eval_set.py --out bench/results/<run>/eval_set.json
    python bench/eval_set.py --scale tiny --models wukong --batch-sizes 64 --modes train \\
        --steps 2 --warmup 1 --no-graphs --out /tmp/eval.json          # CPU smoke run
    python bench/eval_set.py --help                                    # every option
"""

import os
import sys

from loka.bench.evalset import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], eval_set=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "evalset")))
