"""LoKA's JSON files: atomic writes, validated reads, numbers JSON cannot hold, one error type.

Every file LoKA writes (Probe reports, plans, run metrics, benchmark results) goes through
:func:`atomic_write_text`, so a crash never leaves a file half-written. Every file it reads
back is checked field by field with the validators below, which raise one error type,
:class:`ReportError`, whose message names the offending field; :func:`read_json` checks the
envelope (``schema`` and ``version``) and names the file.

JSON has no infinity or NaN: :func:`encode_number` writes them as the strings ``"inf"``,
``"-inf"`` and ``"nan"``, and :func:`decode_number` reads them back.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Iterable, Mapping, Optional

__all__ = ["ReportError", "atomic_write_text", "read_json", "encode_number", "decode_number",
           "json_safe", "require_fields", "field_path", "field_int", "field_str", "field_bool", "field_number",
           "field_mapping"]


class ReportError(ValueError):
    """A report or plan file that is corrupt, foreign, or of an unknown version."""


def encode_number(x) -> "Optional[float | str]":
    """A float as JSON can hold it: inf and NaN become strings (``decode_number`` undoes it)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def decode_number(x) -> Optional[float]:
    """The float :func:`encode_number` wrote (ReportError for anything else)."""
    if x is None:
        return None
    if isinstance(x, str):
        if x not in ("nan", "inf", "-inf"):
            raise ReportError(f"expected a number, got {x!r}")
        return float(x)
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ReportError(f"expected a number, got {x!r}")
    return float(x)


def json_safe(obj: Any) -> Any:
    """Nested dicts, lists, floats (inf/nan too) and tensors/arrays made JSON-safe."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return encode_number(obj)
    if hasattr(obj, "item"):
        return json_safe(obj.item()) if getattr(obj, "numel", lambda: 1)() == 1 else json_safe(obj.tolist())
    return obj


def field_path(where: str, key) -> str:
    """``where.key``: the path of a field in an error message."""
    return f"{where}.{key}" if where else str(key)


def require_fields(d: Any, keys: Iterable[str], what: str) -> None:
    """``d`` is a JSON object holding every key in ``keys`` (else ReportError naming ``what``)."""
    if not isinstance(d, Mapping):
        raise ReportError(f"{what}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ReportError(f"{what}: missing field(s) {missing}")


def field_int(d: Mapping, key: str, where: str, minimum: int = 0) -> int:
    """``d[key]``: an integer (not a bool) of at least ``minimum``."""
    x = d[key]
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ReportError(f"{field_path(where, key)}: expected an integer >= {minimum}, got {x!r}")
    return x


def field_str(d: Mapping, key: str, where: str, default: Optional[str] = None,
              optional: bool = False) -> Optional[str]:
    """``d[key]`` (or ``default``): a string, or None when ``optional``."""
    x = d.get(key, default)
    if x is None and optional:
        return None
    if not isinstance(x, str):
        raise ReportError(f"{field_path(where, key)}: expected a string, got {x!r}")
    return x


def field_bool(d: Mapping, key: str, where: str, default: bool = False) -> bool:
    """``d[key]`` (or ``default``): true or false."""
    x = d.get(key, default)
    if not isinstance(x, bool):
        raise ReportError(f"{field_path(where, key)}: expected true or false, got {x!r}")
    return x


def field_number(d: Mapping, key: str, where: str, optional: bool = True, default=None):
    """``d[key]`` (or ``default``) decoded by :func:`decode_number`."""
    x = d.get(key, default)
    if x is None:
        if optional:
            return None
        raise ReportError(f"{field_path(where, key)}: missing number")
    try:
        return decode_number(x)
    except ReportError:
        raise ReportError(f"{field_path(where, key)}: expected a number, got {x!r}") from None


def field_mapping(d: Mapping, key: str, where: str, default=None) -> Mapping:
    """``d[key]`` (or ``default``): a JSON object."""
    x = d.get(key, default)
    if not isinstance(x, Mapping):
        raise ReportError(f"{field_path(where, key)}: expected a JSON object, got {type(x).__name__}")
    return x


def atomic_write_text(path: "str | os.PathLike", text: str) -> None:
    """Write a file so that a crash never leaves it half-written."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: "str | os.PathLike", schema: str, version: int) -> dict:
    """Load and check the envelope of a LoKA JSON file, with one-line errors."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{path}: not a {schema} file (schema: {found!r})")
    if data.get("version") != version:
        raise ReportError(f"{path}: {schema} version {data.get('version')!r} is not supported "
                          f"(this LoKA reads version {version})")
    return data
