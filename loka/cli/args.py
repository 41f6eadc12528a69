"""Argument values of the ``loka`` command: checked, turned into LoKA's own values, or
refused with a :class:`CliError` that says what to write instead.

``positive``, ``budget`` and ``speedup`` are argparse ``type=`` callables (argparse prints
their message as a usage error); the ``parse_*`` functions, ``probe_config`` and
``demo_config`` read what argparse left as text.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import ROLES, ModsConfig, ProbeConfig, Role
from ..demo import DemoConfig
from ..dispatch.steptimer import check_host_slowdown
from ..kernels import registry
from ..numerics.delayed import check_decay

__all__ = ["EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "CliError", "usage", "resolve_device",
           "parse_mods", "parse_pairs", "parse_budgets", "positive", "budget", "speedup",
           "parse_kernels", "unknown_kernels", "kernel_hint", "probe_config", "demo_config"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure the user can fix: printed as ``error: ...`` and ``hint: ...``."""

    def __init__(self, message: str, hint: Optional[str] = None, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code


def usage(message: str, hint: Optional[str] = None) -> CliError:
    """A :class:`CliError` for a bad option or value (exit code 2)."""
    return CliError(message, hint, EXIT_USAGE)


def resolve_device(args) -> torch.device:
    """The ``--device`` given (checked), else cuda when available, else cpu."""
    name = getattr(args, "device", None)
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise usage(f"--device {name!r} is not a device", "use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise usage(f"--device {name}: CUDA is not available on this machine",
                    "use --device cpu (the emulated kernels run there)")
    if device.type not in ("cpu", "cuda"):
        raise usage(f"--device {name}: LoKA runs on cpu or cuda", "use --device cpu")
    return device


def parse_mods(text: Optional[str]) -> ModsConfig:
    """``none`` | ``paper`` | ``no_bias,blocknorm=256,hardswish,pad_to=16,...`` -> ModsConfig."""
    if text is None or text.strip().lower() in ("", "none"):
        return ModsConfig()
    if text.strip().lower() == "paper":
        return ModsConfig.paper()
    fields = {f.name: f for f in dataclasses.fields(ModsConfig)}
    kwargs: Dict[str, Any] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in fields:
            raise usage(f"--mods: unknown Mod {key!r}",
                        f"choose from paper, none or {', '.join(fields)}")
        if fields[key].type in ("bool", bool):
            if value and value.lower() not in ("1", "true", "yes", "on"):
                raise usage(f"--mods: {key} is a switch, got {key}={value}", f"write just {key}")
            kwargs[key] = True
        elif not value and key == "blocknorm":
            kwargs[key] = 256  # the paper's block size
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise usage(f"--mods: {key} needs an integer, got {value!r}",
                            f"e.g. --mods {key}=16") from None
    try:
        return ModsConfig(**kwargs)
    except ValueError as e:
        raise usage(f"--mods: {e}") from None


def parse_pairs(items: Optional[Sequence[str]], what: str, example: str) -> Dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}``, split at the last ``=`` (a key may contain
    ``=``, as a regular expression may); ``example`` goes into the error's hint."""
    out: Dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.rpartition("=")
        if not sep or not key or not value:
            raise usage(f"--{what} {item!r}: expected KEY=VALUE", f"e.g. --{what} {example}")
        out[key] = value
    return out


def parse_budgets(items: Optional[Sequence[str]], what: str, keys: Optional[Sequence[str]] = None
                  ) -> Dict[str, float]:
    """``["wgrad=0.1", ...]`` -> ``{"wgrad": 0.1}``; the key may contain ``=`` (a regex)."""
    out: Dict[str, float] = {}
    example = f"{'wgrad' if keys else 'over_arch'}=0.1"
    hint = (f"a budget is a bound on the error metric, a finite number >= 0 "
            f"(0: the baseline only), e.g. --{what} {example}")
    for key, value in parse_pairs(items, what, example).items():
        item = f"{key}={value}"
        try:
            number = float(value)
        except ValueError:
            raise usage(f"--{what} {item!r}: {value!r} is not a number", hint) from None
        if not number >= 0 or number == float("inf"):
            raise usage(f"--{what} {item!r}: the budget must be a finite number >= 0", hint)
        if keys is not None and key not in keys:
            raise usage(f"--{what} {item!r}: unknown role {key!r}", f"roles: {', '.join(keys)}")
        if keys is None:
            try:
                re.compile(key)
            except re.error as e:
                raise usage(f"--{what} {item!r}: {key!r} is not a regular expression ({e})") from None
        out[key] = number
    return out


def positive(kind: Callable, name: str, minimum=1) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, at least ``minimum`` (``name`` in the message)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value
    return check


def budget(text: str) -> float:
    """An argparse ``type``: an error budget, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def ne_change(text: str) -> float:
    """An argparse ``type``: a relative NE change bound, a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def speedup(text: str) -> float:
    """An argparse ``type``: a speed threshold, a finite number > 0."""
    value = budget(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number, got {text} (to plan on error only, use --assume-fast)")
    return value


def slowdown(text: str) -> float:
    """An argparse ``type``: a host slowdown factor, a finite number >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        return check_host_slowdown(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1 (1 turns the check "
                                         f"off), got {text}") from None


def decay(text: str) -> float:
    """An argparse ``type``: a delayed-scaling decay, a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        return check_decay(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a decay in (0, 1], got {text}") from None


def unknown_kernels(names: Sequence[str]) -> List[str]:
    """The names in ``names`` no registered kernel has, in order."""
    known = {k.name for k in registry.all_kernels()}
    return [n for n in names if n not in known]


def kernel_hint(unknown: Sequence[str]) -> str:
    """The registered kernel names nearest to ``unknown`` ones, and where to find all."""
    known = sorted(k.name for k in registry.all_kernels())
    close: List[str] = []
    for name in unknown:
        close += [c for c in difflib.get_close_matches(name, known, n=3, cutoff=0.6)
                  if c not in close]
    suggestion = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return suggestion + "'loka kernels' lists every kernel"


def parse_kernels(text: Optional[str]) -> Optional[Tuple[str, ...]]:
    """``--kernels a,b`` -> ``("a", "b")`` (None when not given); unknown names refused,
    with the nearest registered names."""
    if not text:
        return None
    kernels = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = unknown_kernels(kernels)
    if unknown:
        raise usage(f"--kernels: unknown kernel(s) {unknown}", kernel_hint(unknown))
    return kernels


def probe_kernels(text: Optional[str]) -> Tuple[Optional[Tuple[str, ...]], bool]:
    """The Probe's ``--kernels``: ``(kernels, all_kernels)``; ``all`` measures every available
    kernel, on a GPU too (``ProbeConfig.all_kernels``); a list as :func:`parse_kernels`."""
    if text is not None and text.strip() == "all":
        return None, True
    return parse_kernels(text), False


def probe_config(args) -> ProbeConfig:
    """The ``loka probe`` options as a ProbeConfig (kernels, roles and the module filter
    checked)."""
    kernels, all_kernels = probe_kernels(args.kernels)
    roles = ROLES
    if args.roles:
        try:
            roles = tuple(Role.parse(r.strip()) for r in args.roles.split(",") if r.strip())
        except ValueError as e:
            raise usage(f"--roles: {e}") from None
    if args.module_filter:
        try:
            re.compile(args.module_filter)
        except re.error as e:
            raise usage(f"--module-filter {args.module_filter!r}: not a regular expression ({e})") from None
    try:
        return ProbeConfig(
            every_n_steps=args.every_n_steps, num_samples=args.num_samples,
            sample_rows=args.sample_rows, source=args.source, compare_naive=args.naive,
            kernels=kernels, all_kernels=all_kernels, roles=roles, max_error=args.max_error,
            min_speedup=args.min_speedup,
            bootstrap=args.bootstrap, timing=not args.no_timing, seed=args.seed,
            module_filter=args.module_filter, time_unsafe=getattr(args, "time_unsafe", False),
            roofline_prune=not getattr(args, "no_roofline", False),
            autotune_from=getattr(args, "autotune_from", None),
            cold_cache=getattr(args, "cold_cache", False),
            head_sites=getattr(args, "head_sites", ProbeConfig.head_sites))
    except ValueError as e:
        raise usage(str(e)) from None


def demo_config(args) -> DemoConfig:
    """The ``loka demo`` options as a DemoConfig (``--quick``: :meth:`DemoConfig.quick`)."""
    given = {k: v for k, v in (("preset", args.preset), ("steps", args.steps),
                               ("probe_steps", args.probe_steps),
                               ("batch_size", args.batch_size)) if v is not None}
    given.update(model=args.model, max_error=args.max_error, seed=args.seed, out=args.out)
    try:
        return DemoConfig.quick(**given) if args.quick else DemoConfig(**given)
    except ValueError as e:
        raise usage(str(e)) from None
