"""LoKA's JSON files: atomic writes, validated reads, numbers JSON cannot hold, one error type.

Every file LoKA writes (Probe reports, plans, run metrics, benchmark results) goes through
:func:`atomic_write_text`, so a crash never leaves a file half-written. Every file it reads
back is checked field by field with the validators below, which raise one error type,
:class:`ReportError`, whose message names the offending field; :func:`read_json` checks the
envelope (``schema`` and ``version``) and names the file.

JSON has no infinity or NaN: :func:`encode_number` writes them as the strings ``"inf"``,
``"-inf"`` and ``"nan"``, and :func:`decode_number` reads them back.

A file is a guest: every way it can be wrong ends in a :class:`ReportError` that names the
file (and, past the envelope, the field), never a bare ``OverflowError``, ``TypeError`` or
``RecursionError``. Before anything is parsed, a file larger than :data:`MAX_FILE_BYTES`
(64 MiB; ``max_bytes=`` per call, or set the module attribute) is refused, and so is one
that does not open a JSON object or whose leading ``"schema"``/``"version"`` (where LoKA
writes them) name another kind of file. Integer literals of more than
:data:`MAX_INT_DIGITS` characters are read as floats (as ``1e999`` is read as inf), so
that the field that holds one refuses it by name; :func:`field_int` takes integers up to
``2**63 - 1``. Nesting too deep for the parser is refused.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from typing import IO, Any, Callable, Iterable, Mapping, Optional

import torch

__all__ = ["ReportError", "atomic_write", "atomic_write_text", "read_json", "load_json", "encode_number",
           "decode_number", "json_safe", "require_fields", "field_path", "field_int", "field_str",
           "field_bool", "field_number", "field_mapping", "field_list", "field_device",
           "MAX_FILE_BYTES", "MAX_INT_DIGITS", "MAX_INT"]

MAX_FILE_BYTES = 64 * 2 ** 20
"""largest JSON file LoKA reads (64 MiB; a Probe report of a paper-size model is a few MB)"""
MAX_INT_DIGITS = 20
"""longest integer literal read as an integer; longer ones are read as floats (inf beyond
float range), which every integer field refuses (counts, shapes and steps are far shorter)"""
MAX_INT = 2 ** 63 - 1
"""largest integer :func:`field_int` accepts"""
_HEAD_BYTES = 4096
_ENVELOPE = re.compile(r'\A\s*\{\s*"schema"\s*:\s*("(?:[^"\\]|\\.)*")'
                       r'(?:\s*,\s*"version"\s*:\s*(-?\d{1,20}(?![\d.eE])|true|false|null))?')
"""the envelope where LoKA writes it: the first keys of the file"""


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
            raise ReportError(f"expected a number, got {_short(x)}")
        return float(x)
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ReportError(f"expected a number, got {_short(x)}")
    try:
        return float(x)
    except OverflowError:
        raise ReportError(f"expected a number, got an integer of {len(str(abs(x)))} digits, "
                          "beyond float range") from None


def _short(x: Any, limit: int = 60) -> str:
    """``repr(x)``, cut to ``limit`` characters (error messages stay one short line)."""
    if isinstance(x, (dict, list)):
        return "a JSON object" if isinstance(x, dict) else "a JSON array"
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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


def field_int(d: Mapping, key: str, where: str, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """``d[key]``: an integer (not a bool) from ``minimum`` to ``maximum``."""
    x = d[key]
    if isinstance(x, bool) or not isinstance(x, int) or not minimum <= x <= maximum:
        raise ReportError(f"{field_path(where, key)}: expected an integer >= {minimum}"
                          + ("" if maximum == MAX_INT else f" and <= {maximum}")
                          + f", got {_short(x)}")
    return x


def field_str(d: Mapping, key: str, where: str, default: Optional[str] = None,
              optional: bool = False) -> Optional[str]:
    """``d[key]`` (or ``default``): a string, or None when ``optional``."""
    x = d.get(key, default)
    if x is None and optional:
        return None
    if not isinstance(x, str):
        raise ReportError(f"{field_path(where, key)}: expected a string, got {_short(x)}")
    return x


def field_bool(d: Mapping, key: str, where: str, default: bool = False) -> bool:
    """``d[key]`` (or ``default``): true or false."""
    x = d.get(key, default)
    if not isinstance(x, bool):
        raise ReportError(f"{field_path(where, key)}: expected true or false, got {_short(x)}")
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
        raise ReportError(f"{field_path(where, key)}: expected a number, got {_short(x)}") from None


def field_mapping(d: Mapping, key: str, where: str, default=None) -> Mapping:
    """``d[key]`` (or ``default``): a JSON object."""
    x = d.get(key, default)
    if not isinstance(x, Mapping):
        raise ReportError(f"{field_path(where, key)}: expected a JSON object, got {type(x).__name__}")
    return x


def field_list(d: Mapping, key: str, where: str, default=None, item=None) -> list:
    """``d[key]`` (or ``default``): a JSON array; with ``item`` (a type), of such items."""
    x = d.get(key, default)
    if not isinstance(x, list):
        raise ReportError(f"{field_path(where, key)}: expected a JSON array, got {_short(x)}")
    if item is not None:
        for i, v in enumerate(x):
            if not isinstance(v, item) or isinstance(v, bool) and item is not bool:
                what = "a string" if item is str else f"a {item.__name__}"
                raise ReportError(f"{field_path(where, key)}[{i}]: expected {what}, got {_short(v)}")
    return x


def field_device(d: Mapping, key: str, where: str, default: str = "cpu") -> str:
    """``d[key]`` (or ``default``): a device name torch reads ('cpu', 'cuda:0')."""
    name = field_str(d, key, where, default)
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        raise ReportError(f"{field_path(where, key)}: {_short(name)} is not a device name "
                          "('cpu', 'cuda:0')") from None
    return name


def atomic_write(path: "str | os.PathLike", write: Callable[[IO], None], *,
                 binary: bool = False, temp: Optional[str] = None) -> None:
    """Write a file so that a crash never leaves it half-written: ``write(f)`` fills a temp
    file in the same folder (``temp``, default a fresh ``.tmp-*<name>``), which is synced
    and renamed over ``path``, and the rename is synced too. Created with the umask's mode,
    as ``open`` would; on failure the temp file is removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if temp is None:
        temp = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}{os.path.basename(path)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)


def atomic_write_text(path: "str | os.PathLike", text: str) -> None:
    """Write a text file through :func:`atomic_write`."""
    atomic_write(path, lambda f: f.write(text))


def _parse_int(text: str) -> "int | float":
    # a longer literal is read as a float, as JSON reads 1e999 (inf beyond float range):
    # every integer field refuses it by name, and int() never meets a 5000-digit string
    return float(text) if len(text) > MAX_INT_DIGITS else int(text)


def load_json(path: "str | os.PathLike", max_bytes: Optional[int] = None,
              schema: Optional[str] = None, version: Optional[int] = None) -> Any:
    """Parse a JSON file that must hold an object, with the guards of the module doc.

    Args:
        path: the file.
        max_bytes: refuse larger files (default :data:`MAX_FILE_BYTES`).
        schema, version: refuse, before the body is parsed, a file whose leading
            ``"schema"`` names another kind, or (of this kind) another ``"version"``
            (:func:`read_json` checks the envelope in full after the parse).

    Raises:
        FileNotFoundError: no such file.
        ReportError: too large, not JSON, not an object, nested too deep.
    """
    limit = MAX_FILE_BYTES if max_bytes is None else int(max_bytes)
    size = os.stat(path).st_size
    if size > limit:
        raise ReportError(f"{path}: {size:,} bytes is above the limit of {limit:,} for a "
                          "LoKA JSON file (pass max_bytes= or set loka.jsonio.MAX_FILE_BYTES "
                          "to read it anyway)")
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:  # it grew since the stat
        raise ReportError(f"{path}: above the limit of {limit:,} bytes for a LoKA JSON file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte "
                          f"{e.start})") from None
    head = text[:_HEAD_BYTES].lstrip()
    if not head:
        raise ReportError(f"{path}: empty file, not JSON")
    if head[0] != "{":
        raise ReportError(f"{path}: not a {schema or 'LoKA JSON'} file (it does not hold a "
                          "JSON object)")
    if schema is not None:
        _check_head(path, text, schema, version)
    try:
        return json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise ReportError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError
        raise ReportError(f"{path}: not valid JSON ({_first_line(e)})") from None


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_head(path, text: str, schema: str, version: Optional[int]) -> None:
    """Refuse a foreign envelope from the file's first bytes, before the body is parsed."""
    m = _ENVELOPE.match(text[:_HEAD_BYTES])
    if m is None:
        return  # not where LoKA writes it: the full parse decides
    try:
        found = json.loads(m.group(1))
    except ValueError:  # a bad escape: the full parse reports it
        return
    if found != schema:
        raise ReportError(f"{path}: not a {schema} file (schema: {_short(found)})")
    if version is not None and m.group(2) is not None:
        _check_version(path, schema, json.loads(m.group(2)), version)


def read_json(path: "str | os.PathLike", schema: str, version: int,
              max_bytes: Optional[int] = None) -> dict:
    """Load and check the envelope of a LoKA JSON file, with one-line errors.

    Args:
        path: the file.
        schema: the ``"schema"`` it must name.
        version: the ``"version"`` it must hold: this integer (not ``true``, not ``1.0``).
        max_bytes: refuse larger files (default :data:`MAX_FILE_BYTES`).
    """
    data = load_json(path, max_bytes, schema, version)
    if not isinstance(data, dict) or data.get("schema") != schema:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{path}: not a {schema} file (schema: {_short(found)})")
    _check_version(path, schema, data.get("version"), version)
    return data


def _check_version(path, schema: str, found: Any, version: int) -> None:
    if isinstance(found, bool) or not isinstance(found, int) or found != version:
        raise ReportError(f"{path}: {schema} version {_short(found)} is not supported "
                          f"(this LoKA reads version {version})")
