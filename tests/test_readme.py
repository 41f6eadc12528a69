"""The README's Python example runs as written (on the CPU, in seconds)."""

import os
import re

import torch
from torch import nn

import loka
from tests.support import need_kernel

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _first_python_block() -> str:
    with open(README) as f:
        text = f.read()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = _first_python_block()
    if '"cublas-rowwise"' in code:  # its promise of FP8 Linears needs the kernel on the CPU
        need_kernel("cublas-rowwise")
    assert "loka.Probe" in code and "loka.plan" in code and "loka.apply" in code
    scope = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), scope)
    model, plan, report = scope["model"], scope["plan"], scope["report"]
    # what the example promises: a report of every Linear, a plan, FP8 Linears in the model
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert set(report.sites) == set(linears) and set(plan.sites) == set(linears)
    swapped = [n for n, m in model.named_modules() if isinstance(m, loka.Linear)]
    assert swapped and set(swapped) == set(plan.fp8_sites())
    assert "plan for cpu" in capsys.readouterr().out
    batch = next(iter(scope["data"]))
    with torch.no_grad():
        assert torch.isfinite(model(batch)).all()


def test_every_python_block_of_the_readme_is_valid_python_naming_real_api():
    """The other ```python blocks (illustrations that need a trained model or a GPU) are at
    least valid Python, and every ``loka.`` name they use exists."""
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 2
    import loka.quality
    for block in blocks:
        compile(block, "README.md", "exec")
        for dotted in re.findall(r"\bloka(?:\.[A-Za-z_]\w*)+", block):
            obj = loka
            for part in dotted.split(".")[1:]:
                obj = getattr(obj, part)
    assert "serve_ne_budget" in blocks[1]
    assert callable(loka.quality.serve_ne_budget)
