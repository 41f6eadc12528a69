"""The ``loka`` command: demo, train, probe, plan, audit, apply --check, report, bench, kernels.

Every subcommand prints one readable line on failure, with a hint, and exits 2 for a usage
error (bad option or value), 1 for a runtime failure (a missing or corrupt file, a plan
made for another model); ``--debug`` shows the traceback instead.

``args`` checks argument values and defines the errors, ``files`` reads reports, plans,
curves and checkpoints, ``commands`` holds what each subcommand does, ``parser`` the
options, help and examples; :func:`main` runs one command line. ``commands`` is imported
once a command is to run, not with the package: the commands build models, and importing
the models loads torch.compile's machinery (``loka.mods.fused``), which takes seconds that
``loka --help`` and a usage error should not pay.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

from .args import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError, usage
from .parser import build_parser

__all__ = ["main", "build_parser", "CliError", "usage"]


def _fail(message: str, hint: Optional[str]) -> None:
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``loka`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        # on first run of a command, not at import: see the module's docstring
        commands = importlib.import_module(f"{__name__}.commands")
        return int(commands.run(args) or EXIT_OK)
    except CliError as e:
        if debug:
            raise
        _fail(e.message, e.hint)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, unless --debug
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _fail(f"{type(e).__name__}: {msg}" if msg else type(e).__name__,
              "rerun with --debug for the traceback")
        return EXIT_FAILURE
