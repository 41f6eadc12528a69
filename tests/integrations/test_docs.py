"""Every Python block of docs/integrations.md runs as written, in order, in one scope (a
block whose first line is ``# needs: X`` runs where X is importable, or with a GPU)."""

import os
import re

import pytest
import torch

from loka.kernels import capabilities

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "integrations.md")


def _blocks():
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _missing(block: str):
    first = block.splitlines()[0]
    if not first.startswith("# needs: "):
        return None
    need = first[len("# needs: "):].strip()
    if need == "cuda":
        return None if torch.cuda.is_available() else "needs a CUDA GPU"
    module = {"torchao": "torchao.float8"}.get(need, need)
    return None if capabilities.module_available(module) else f"{need} is not installed"


def test_the_page_has_examples_for_every_integration():
    text = "\n".join(_blocks())
    for name in ("from_torchao", "to_torchao", "PlanConverter", "EmbeddingBagCollection",
                 "to_torchrec", "weights=", "window="):
        assert name in text, name


def test_every_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__integrations_doc__"}
    ran, skipped = 0, []
    for i, block in enumerate(_blocks()):
        why = _missing(block)
        if why is not None:
            skipped.append(f"block {i}: {why}")
            continue
        exec(compile(block, f"docs/integrations.md block {i}", "exec"), scope)
        ran += 1
    assert ran >= 2  # the metrics and converter blocks need nothing optional
    if skipped:
        pytest.skip("; ".join(skipped))
