"""``ProbeReport``: what the Probe measured, per site, role and kernel; JSON in and out.

The JSON layout (schema ``loka.probe-report``, version :data:`SCHEMA_VERSION`)::

    {"schema": "loka.probe-report", "version": 1, "created": ISO-8601, "device": "cuda:0",
     "device_name": "NVIDIA H200", "torch": "2.11.0", "config": {ProbeConfig fields},
     "sites": {fqn: {"name", "in_features", "out_features", "tokens", "dtype",
                     "stats": {...summary...},
                     "roles": {"fwd"|"dgrad"|"wgrad": {"role", "shape": [M, K, N],
                               "baseline_us", "kernels": {name: KernelResult}}}}}}
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import Role

SCHEMA = "loka.probe-report"
SCHEMA_VERSION = 1


class ReportError(ValueError):
    """A report or plan file that is corrupt, foreign, or of an unknown version."""


def _num(x) -> Optional[float]:
    """JSON has no inf/nan: encode them as strings, decode back to floats."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _unnum(x) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, str):
        if x not in ("nan", "inf", "-inf"):
            raise ReportError(f"expected a number, got {x!r}")
        return float(x)
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ReportError(f"expected a number, got {x!r}")
    return float(x)


@dataclass
class ErrorStat:
    """A sample statistic with its bootstrap 95% confidence interval."""

    mean: float
    lo: float
    hi: float
    n: int
    std: float = 0.0

    def to_dict(self) -> dict:
        return {"mean": _num(self.mean), "lo": _num(self.lo), "hi": _num(self.hi),
                "n": int(self.n), "std": _num(self.std)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ErrorStat":
        _require(d, ("mean", "lo", "hi", "n"), "error statistic")
        return cls(_unnum(d["mean"]), _unnum(d["lo"]), _unnum(d["hi"]), int(d["n"]),
                   _unnum(d.get("std", 0.0)))


@dataclass
class KernelResult:
    """One kernel at one site and role."""

    kernel: str
    mere: Optional[ErrorStat] = None
    sqnr: Optional[ErrorStat] = None
    relfro: Optional[ErrorStat] = None
    naive_mere: Optional[ErrorStat] = None
    """MERE on N(0, 1) operands of the same shape, for the learned-vs-naive comparison"""
    time_us: Optional[float] = None
    """median time of the full kernel call, quantization included"""
    speedup: Optional[float] = None
    """baseline time / this kernel's time"""
    timing: str = "none"
    """'cuda-graph', 'cuda-events', 'cpu-wallclock' or 'none'"""
    safe: bool = False
    fast: bool = False
    error: Optional[str] = None
    """set when the kernel failed at this site (then it is never safe)"""

    def metric(self, name: str) -> Optional[ErrorStat]:
        if name == "neg_sqnr":
            s = self.sqnr
            return None if s is None else ErrorStat(-s.mean, -s.hi, -s.lo, s.n, s.std)
        return getattr(self, name)

    def to_dict(self) -> dict:
        d = {"kernel": self.kernel, "time_us": _num(self.time_us), "speedup": _num(self.speedup),
             "timing": self.timing, "safe": bool(self.safe), "fast": bool(self.fast),
             "error": self.error}
        for k in ("mere", "sqnr", "relfro", "naive_mere"):
            v = getattr(self, k)
            d[k] = None if v is None else v.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "KernelResult":
        _require(d, ("kernel",), "kernel result")
        stats = {k: (None if d.get(k) is None else ErrorStat.from_dict(d[k]))
                 for k in ("mere", "sqnr", "relfro", "naive_mere")}
        return cls(kernel=str(d["kernel"]), time_us=_unnum(d.get("time_us")),
                   speedup=_unnum(d.get("speedup")), timing=str(d.get("timing", "none")),
                   safe=bool(d.get("safe", False)), fast=bool(d.get("fast", False)),
                   error=d.get("error"), **stats)


@dataclass
class RoleReport:
    role: Role
    shape: Tuple[int, int, int]
    """(M, K, N) of the GEMM this role runs"""
    baseline_us: Optional[float] = None
    kernels: Dict[str, KernelResult] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"role": self.role.value, "shape": list(self.shape),
                "baseline_us": _num(self.baseline_us),
                "kernels": {k: v.to_dict() for k, v in self.kernels.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RoleReport":
        _require(d, ("role", "shape", "kernels"), "role report")
        shape = tuple(int(x) for x in d["shape"])
        if len(shape) != 3:
            raise ReportError(f"role shape must be [M, K, N], got {d['shape']!r}")
        return cls(Role.parse(d["role"]), shape, _unnum(d.get("baseline_us")),
                   {k: KernelResult.from_dict(v) for k, v in d["kernels"].items()})


@dataclass
class SiteReport:
    """One GEMM site (a Linear, keyed by its fully qualified name)."""

    name: str
    in_features: int
    out_features: int
    tokens: int
    """rows M of the site's input per step (product of its leading dims)"""
    dtype: str = "bfloat16"
    stats: Dict[str, Any] = field(default_factory=dict)
    """summary of the learned statistics (amax, outlier fraction, kurtosis, ...)"""
    roles: Dict[Role, RoleReport] = field(default_factory=dict)

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.tokens, self.in_features, self.out_features)

    def to_dict(self) -> dict:
        return {"name": self.name, "in_features": self.in_features,
                "out_features": self.out_features, "tokens": self.tokens, "dtype": self.dtype,
                "stats": _clean(self.stats),
                "roles": {r.value: rr.to_dict() for r, rr in self.roles.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SiteReport":
        _require(d, ("name", "in_features", "out_features", "tokens", "roles"), "site report")
        return cls(str(d["name"]), int(d["in_features"]), int(d["out_features"]),
                   int(d["tokens"]), str(d.get("dtype", "bfloat16")), dict(d.get("stats", {})),
                   {Role.parse(r): RoleReport.from_dict(v) for r, v in d["roles"].items()})


def _clean(obj):
    """Make nested stats JSON-safe (floats incl. inf/nan, lists, dicts)."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return _num(obj)
    if hasattr(obj, "item"):
        return _clean(obj.item()) if getattr(obj, "numel", lambda: 1)() == 1 else _clean(obj.tolist())
    return obj


def _require(d: Any, keys, what: str) -> None:
    if not isinstance(d, Mapping):
        raise ReportError(f"{what}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ReportError(f"{what}: missing field(s) {missing}")


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


@dataclass
class ProbeReport:
    sites: Dict[str, SiteReport] = field(default_factory=dict)
    device: str = "cpu"
    device_name: str = ""
    torch_version: str = ""
    config: Dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    meta: Dict[str, Any] = field(default_factory=dict)
    """free-form: model name, steps observed, timing notes"""

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "created": self.created,
                "device": self.device, "device_name": self.device_name,
                "torch": self.torch_version, "config": _clean(self.config),
                "meta": _clean(self.meta),
                "sites": {k: v.to_dict() for k, v in self.sites.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ProbeReport":
        _require(d, ("sites",), "probe report")
        try:
            sites = {k: SiteReport.from_dict(v) for k, v in d["sites"].items()}
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            if isinstance(e, ReportError):
                raise
            raise ReportError(f"probe report: invalid content ({e})") from None
        return cls(sites=sites, device=str(d.get("device", "cpu")),
                   device_name=str(d.get("device_name", "")), torch_version=str(d.get("torch", "")),
                   config=dict(d.get("config", {})), created=str(d.get("created", "")),
                   meta=dict(d.get("meta", {})))

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=False))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "ProbeReport":
        return cls.from_dict(read_json(path, SCHEMA, SCHEMA_VERSION))

    def kernel_names(self) -> List[str]:
        names = []
        for s in self.sites.values():
            for rr in s.roles.values():
                for k in rr.kernels:
                    if k not in names:
                        names.append(k)
        return names
