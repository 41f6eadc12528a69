"""Write docs/api.md: the public API of LoKA, from its signatures and docstrings.

Usage: ``python docs/gen_api.py [--out docs/api.md] [--check]``. ``--check`` exits 1 when
the file on disk differs from what would be written (for CI).

Walks the packages in :data:`PACKAGES`; a package's public names are its ``__all__``
(plus, for ``loka``, the names it loads lazily). Classes list their public methods and
properties, and dataclass fields with the docstring written beneath each field. An object
exported by several packages is documented once, where it is first met, and linked after.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import os
import re
import sys
import textwrap
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PACKAGES = ("loka", "loka.numerics", "loka.kernels", "loka.probe", "loka.dispatch", "loka.mods",
            "loka.models", "loka.data", "loka.quality", "loka.distributed", "loka.integrations")
LAZY = {"loka": ("Probe", "probe", "ProbeReport", "SiteReport", "plan", "Plan", "apply",
                 "unapply")}
SKIP = {"__version__"}


def _clean(text: str) -> str:
    """Signatures and reprs without memory addresses (the output must be reproducible)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


class _Annotation(str):
    """A string annotation (``from __future__ import annotations``) shown without quotes."""

    def __repr__(self) -> str:
        return str(self).strip("'\"")


def _repr(value) -> str:
    """A reproducible repr: sets sorted (their order follows hash randomization), enum
    members by name."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (set, frozenset)):
        items = ", ".join(sorted(_repr(v) for v in value))
        return f"{type(value).__name__}({{{items}}})" if value else f"{type(value).__name__}()"
    if isinstance(value, tuple):
        inner = ", ".join(_repr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return _clean(repr(value))


class _Default:
    """A parameter default shown by :func:`_repr`."""

    def __init__(self, value) -> None:
        self.value = value

    def __repr__(self) -> str:
        return _repr(self.value)


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = []
    for p in sig.parameters.values():
        if isinstance(p.annotation, str):
            p = p.replace(annotation=_Annotation(p.annotation))
        if p.default is not inspect.Parameter.empty:
            p = p.replace(default=_Default(p.default))
        params.append(p)
    ret = sig.return_annotation
    sig = sig.replace(parameters=params,
                      return_annotation=_Annotation(ret) if isinstance(ret, str) else ret)
    return _clean(str(sig))


def _summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^a-z0-9_\- ]", "", heading.lower()).replace(" ", "-")


def _field_docs(cls) -> Dict[str, str]:
    """{field: docstring} from the string literal under each annotated field."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                and isinstance(nxt.value.value, str):
            out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def _block(doc: str) -> List[str]:
    """A docstring as Markdown: kept verbatim in a literal block when it has layout."""
    if not doc:
        return []
    return ["", "```text", doc, "```", ""] if ("\n    " in doc or "==" in doc or ">>>" in doc
                                               or "Args:" in doc) else ["", doc, ""]


def _members(cls) -> List[str]:
    lines = []
    own = [(n, v) for n, v in cls.__dict__.items() if not n.startswith("_")]
    for name, value in own:
        if isinstance(value, property):
            doc = _doc(value)
            lines.append(f"- `{name}` (property)" + (f": {_summary(doc)}" if doc else ""))
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            sig = _signature(fn)
            if isinstance(value, classmethod) or not isinstance(value, staticmethod):
                sig = re.sub(r"^\((self|cls)(, )?", "(", sig)
            doc = _doc(fn)
            lines.append(f"- `{name}{sig}`" + (f": {_summary(doc)}" if doc else ""))
    return lines


def _describe(qualname: str, obj) -> List[str]:
    out = [f"### `{qualname}`", ""]
    if inspect.isclass(obj):
        kind = "enum" if issubclass(obj, enum.Enum) else (
            "dataclass" if dataclasses.is_dataclass(obj) else "class")
        if issubclass(obj, enum.Enum):
            out.append(f"*{kind}*: " + ", ".join(f"`{m.name}` = `{m.value!r}`" for m in obj))
        else:
            out.append(f"*{kind}* `{obj.__name__}{_signature(obj)}`")
        out += _block(_doc(obj))
        if dataclasses.is_dataclass(obj):
            docs = _field_docs(obj)
            rows = []
            for f in dataclasses.fields(obj):
                if f.default is not dataclasses.MISSING:
                    default = _repr(f.default)
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    factory = f.default_factory                       # type: ignore[misc]
                    # containers show their (empty) value; anything else, like a creation
                    # time, is computed per instance and would change on every run
                    default = (_clean(repr(factory())) if factory in (dict, list, tuple, set)
                               else "set at creation")
                else:
                    default = "required"
                text = docs.get(f.name, "").replace("\n", " ").replace("|", "\\|")
                rows.append(f"| `{f.name}` | `{default}` | {text} |")
            if rows:
                out += ["", "| field | default | meaning |", "|---|---|---|"] + rows + [""]
        members = _members(obj)
        if members:
            out += [""] + members + [""]
    elif callable(obj):
        out.append(f"`{qualname.rsplit('.', 1)[-1]}{_signature(obj)}`")
        out += _block(_doc(obj))
    else:
        out.append(f"`{_clean(repr(obj))[:200]}`")
    return out + [""]


def public_names(module) -> List[str]:
    names = list(getattr(module, "__all__", None) or
                 [n for n in vars(module) if not n.startswith("_")])
    names += [n for n in LAZY.get(module.__name__, ()) if n not in names]
    return [n for n in names if n not in SKIP]


def render() -> str:
    lines = ["# API reference", "",
             "Generated by `python docs/gen_api.py` from the signatures and docstrings; do not",
             "edit by hand. Guides: [index.md](index.md).", ""]
    lines += [f"- [`{p}`](#{_anchor(p)})" for p in PACKAGES] + [""]
    seen: Dict[int, str] = {}
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        lines += [f"## {pkg}", ""]
        doc = _doc(module)
        if doc:
            lines += ["```text", doc, "```", ""]
        for name in public_names(module):
            obj = getattr(module, name, None)
            if obj is None:
                continue
            qual = f"{pkg}.{name}"
            if inspect.ismodule(obj):
                lines += [f"- `{qual}`: module" + (f", see [{obj.__name__}](#{_anchor(obj.__name__)})"
                                                   if obj.__name__ in PACKAGES else
                                                   f" `{obj.__name__}`"), ""]
                continue
            if id(obj) in seen and not isinstance(obj, (int, float, str, tuple)):
                lines += [f"- `{qual}`: see [`{seen[id(obj)]}`](#{_anchor(seen[id(obj)])})", ""]
                continue
            seen[id(obj)] = qual
            lines += _describe(qual, obj)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "api.md"))
    p.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = open(args.out).read() if os.path.exists(args.out) else ""
        if current != text:
            print(f"{args.out} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
