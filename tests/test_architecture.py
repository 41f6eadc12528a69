"""The layers of docs/architecture.md, enforced: every import inside ``loka`` (also those
inside functions) goes down the layers or stays in its own part, no module imports a
private name of another part, there are no import cycles, function-local imports are kept
for optional dependencies, and a long module says why it is long."""

from __future__ import annotations

import ast
import collections
import pathlib
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "loka"

LAYERS: Dict[str, int] = {
    # foundation: no LoKA import at all
    "config": 0, "jsonio": 0, "timing": 0,
    "numerics": 1, "data": 1,
    "kernels": 2,
    # the Probe measures and never decides; the Mods change models; neither knows the other
    "probe": 3, "mods": 3,
    "dispatch": 4,
    # reference models are plain PyTorch with Mods: no Probe, no Dispatch
    "models": 5,
    "train": 6, "reporting": 6, "assembly": 6,
    # data-parallel training: agreement across ranks, FP8 all-gather, checkpoints
    "distributed": 6,
    # torchao (both directions) and torchrec: LoKA beside the libraries teams already use
    "integrations": 6,
    # the paired quality check trains both arms with the training loop
    "quality": 7,
    # the edges: nothing in the library imports them
    "demo": 7, "bench": 7,
    "cli": 8, "__main__": 9,
}
"""the part of ``loka`` (its first name below ``loka``) -> its layer; a part may import its
own modules and the parts of strictly lower layers"""

FORBIDDEN: Dict[str, Set[str]] = {"models": {"probe", "dispatch"}}
"""lower parts a part may still not import: the reference models are plain PyTorch (with
Mods), so that nothing in them can steer how LoKA treats them"""

LONG_LINES = 500
"""a module longer than this says why at its top (a line starting 'Length:')"""

OPTIONAL = ("loka.kernels.triton",)
"""LoKA packages that need an optional dependency (Triton) at import: the only LoKA
modules that may be imported inside a function"""


def _modules() -> Dict[str, Tuple[pathlib.Path, bool]]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


class Import:
    def __init__(self, source: str, target: str, names: List[str], line: int, local: bool):
        self.source, self.target, self.names, self.line, self.local = (source, target, names,
                                                                        line, local)

    def __repr__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} {self.names or ''}"


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str) -> List[Import]:
    path, is_pkg = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        local = getattr(node, "col_offset", 0) > 0
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "loka":
                    out.append(Import(name, _resolve(alias.name), [], node.lineno, local))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "loka":
                continue
            plain = []
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{mod}.{alias.name}"
                if sub in MODULES:
                    out.append(Import(name, sub, [], node.lineno, local))
                else:
                    plain.append(alias.name)
            if plain or not node.names:
                out.append(Import(name, _resolve(mod), plain, node.lineno, local))
    return out


IMPORTS = [imp for name in MODULES for imp in _imports(name)]


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_part_has_a_layer():
    parts = {part(m) for m in MODULES} - {""}
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"


def test_no_import_goes_up_or_sideways():
    bad = []
    for imp in IMPORTS:
        src, dst = part(imp.source), part(imp.target)
        if src == "" or src == dst:
            continue  # the facade loka/__init__.py; a part's own modules
        if dst == "" or LAYERS[dst] >= LAYERS[src] or dst in FORBIDDEN.get(src, ()):
            bad.append(f"{imp}: {src} (layer {LAYERS[src]}) may not import "
                       f"{dst or 'the loka facade'}" + (f" (layer {LAYERS[dst]})" if dst else ""))
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = collections.defaultdict(set)
    for imp in IMPORTS:
        if imp.target != imp.source:
            graph[imp.source].add(imp.target)
    # a package imports its own submodules by construction; a submodule importing its
    # package's __init__ (for a re-exported name) is the cycle to catch
    seen: Dict[str, int] = {}
    stack: List[str] = []
    cycles = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for node in sorted(MODULES):
        if node not in seen:
            visit(node)
    # `from . import x` inside a package's own __init__ is how a package is built
    real = [c for c in cycles if not _package_init_only(c)]
    assert not real, "\n".join(real)


def _package_init_only(cycle: str) -> bool:
    """A cycle that is only a package's __init__ importing its submodules, which import a
    sibling through the package: not a cycle at run time."""
    nodes = cycle.split(" -> ")
    packages = [n for n in nodes if MODULES[n][1]]
    return bool(packages) and all(any(n.startswith(p + ".") or n == p for p in packages)
                                  for n in nodes) and _only_submodules(nodes, packages)


def _only_submodules(nodes: List[str], packages: List[str]) -> bool:
    for a, b in zip(nodes, nodes[1:]):
        if b in packages and not MODULES[a][1]:
            # a submodule importing its package: allowed only for submodules of it
            if not a.startswith(b + "."):
                return False
            if any(imp.source == a and imp.target == b and imp.names for imp in IMPORTS):
                return False  # it takes a name from the package's __init__: a real cycle
    return True


def test_no_private_name_crosses_parts():
    bad = []
    for imp in IMPORTS:
        if part(imp.source) == part(imp.target):
            continue
        private = [n for n in imp.names if _private(n)]
        if private or any(_private(p) for p in imp.target.split(".")[1:]):
            bad.append(f"{imp}")
    assert not bad, "private names imported from another part:\n" + "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_function_local_imports_only_for_optional_dependencies():
    bad = [f"{imp}" for imp in IMPORTS
           if imp.local and not any(imp.target == o or imp.target.startswith(o + ".")
                                    for o in OPTIONAL)]
    assert not bad, ("imports inside functions (move them to the top; a cycle means a layer "
                     "is wrong):\n" + "\n".join(bad))


def test_long_modules_say_why():
    bad = []
    for name, (path, _) in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LONG_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("Length:") for line in doc.splitlines()):
            bad.append(f"{path.relative_to(ROOT.parent)}: {lines} lines")
    assert not bad, (f"modules over {LONG_LINES} lines without a 'Length:' line in their "
                     "docstring:\n" + "\n".join(bad))


@pytest.mark.parametrize("source,target,names,expect", [
    ("loka.probe.probe", "loka.dispatch.apply", [], "may not import dispatch"),
    ("loka.models.wukong", "loka.probe.report", [], "may not import probe"),
    ("loka.kernels.registry", "loka.cli", [], "may not import cli"),
    ("loka.mods.fused", "loka.probe.report", [], "may not import probe"),
])
def test_the_layer_check_fails_on_a_forbidden_import(source, target, names, expect):
    """The checks above can fail: a planted upward import is reported."""
    planted = Import(source, target, names, 1, False)
    globals_ = globals()
    saved = globals_["IMPORTS"]
    globals_["IMPORTS"] = saved + [planted]
    try:
        with pytest.raises(AssertionError, match=expect):
            test_no_import_goes_up_or_sideways()
    finally:
        globals_["IMPORTS"] = saved


def test_the_cycle_check_fails_on_a_planted_cycle():
    saved = globals()["IMPORTS"]
    globals()["IMPORTS"] = saved + [Import("loka.numerics.scaling", "loka.kernels.registry", [],
                                           1, False)]
    try:
        with pytest.raises(AssertionError, match="loka.numerics"):
            test_no_import_cycles()
    finally:
        globals()["IMPORTS"] = saved


def test_the_private_and_local_checks_fail_when_planted():
    saved = globals()["IMPORTS"]
    globals()["IMPORTS"] = saved + [Import("loka.dispatch.linear", "loka.kernels.ops",
                                           ["_qtensor"], 1, True)]
    try:
        with pytest.raises(AssertionError, match="_qtensor"):
            test_no_private_name_crosses_parts()
        with pytest.raises(AssertionError, match="loka.kernels.ops"):
            test_function_local_imports_only_for_optional_dependencies()
    finally:
        globals()["IMPORTS"] = saved
