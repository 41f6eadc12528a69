"""docs/distributed.md's training script runs as written, on two processes."""

from __future__ import annotations

import re
import sys

from test_bench_distributed import ROOT, _run

DOC = ROOT / "docs" / "distributed.md"


def test_the_docs_example_is_the_documented_flow():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    for call in ("ld.reduce_probe", "ld.plan_once", "ld.fp8_all_gather", "fully_shard",
                 "ld.check_same_plan", "ld.RankAgreement", "ld.save"):
        assert call in code, call


def test_the_docs_example_trains_on_two_processes(tmp_path):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(code)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", str(script)], cwd=tmp_path)
    assert proc.returncode == 0
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    assert (tmp_path / "ckpt" / "plan.json").is_file()
