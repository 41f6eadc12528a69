#!/usr/bin/env python3
"""Why one process's ``torch.compile`` does not load what another compiled: the cache keys
of every process a command starts, and the parts of the keys that differ.

A compile looks up AOTAutograd's cache first, then Inductor's FX graph cache, each under a
key hashed from many parts (the graph, its inputs, the Inductor and functorch options, the
matmul flags, the system). Torch writes each part's hash to its DEBUG log when that log is
on. ``run`` turns it on in every Python process of a command (a ``sitecustomize`` module
put first on ``PYTHONPATH``, which child processes inherit) and writes each process's lines
to ``DIR/<pid>-<parent pid>.log``; ``compare`` reads them back: for each process, the keys
it looked up, how many of them another process also looked up, and, for a key no other
process had, the parts whose hashes differ from the nearest key of another process. The
module runs the ``sitecustomize`` it shadows (the next one on the path) after its own.

What it is for: the Probe's children compile its timed calls ahead
(``loka.probe.precompile``) so that the parent loads them from the caches; a report whose
``meta.spent`` counts FX graph cache misses and no hits says the keys differ, and this says
which part::

    python bench/cache_keys.py run --dir /tmp/keys -- python bench/probe_time.py \\
        --fresh-caches --no-profile --out /tmp/pt.json
    python bench/cache_keys.py compare --dir /tmp/keys --out cache_keys.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
"""the modules whose DEBUG lines hold each key's parts"""

_SITE = """\
import logging, os, sys
_dir = os.environ.get("LOKA_CACHE_KEY_LOG")


class _PerProcess(logging.Handler):
    # a file per process, named when the process first logs: a child forked after startup
    # (multiprocessing, DataLoader workers) writes a file of its own
    def __init__(self, directory):
        super().__init__()
        self.directory, self.pid, self.file = directory, None, None

    def emit(self, record):
        try:
            if os.getpid() != self.pid:
                self.pid = os.getpid()
                self.file = open(os.path.join(
                    self.directory, "%d-%d.log" % (self.pid, os.getppid())), "a")
            self.file.write(self.format(record) + "\\n")
            self.file.flush()
        except Exception:
            self.handleError(record)


if _dir:
    _h = _PerProcess(_dir)
    _h.setFormatter(logging.Formatter("@@ %(name)s %(message)s"))
    for _name in {loggers!r}:
        _log = logging.getLogger(_name)
        _log.setLevel(logging.DEBUG)
        _log.addHandler(_h)
        _log.propagate = False  # (torch's own handlers would print every line to stderr)
# Python imports the first sitecustomize on its path, this one: run the next one too
_here = os.path.dirname(os.path.abspath(__file__))
for _p in list(sys.path):
    _f = os.path.join(os.path.abspath(_p or os.curdir), "sitecustomize.py")
    if os.path.dirname(_f) != _here and os.path.isfile(_f):
        try:
            import importlib.util
            _spec = importlib.util.spec_from_file_location("_sitecustomize_next", _f)
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        except Exception:
            pass
        break
"""

_DETAILS = re.compile(r"^@@ (\S+) (FX|Autograd) graph cache hash details for key (\S+):$")
_PART = re.compile(r"^\[(\w+)\] ([^:]+): ?(.*)$")
_LOG_NAME = re.compile(r"^(\d+)-(\d+)$")
DIFFERENCES = 3
"""keys per process and cache whose differing parts ``compare`` lists (the rest are counted)"""
SHOWN = 300
"""characters of a part's value ``compare`` shows"""


def run(directory: str, command: Sequence[str]) -> int:
    """Run ``command`` with every Python process's cache-key lines logged under
    ``directory`` (which must hold no logs of an earlier run); returns its exit status."""
    if not command:
        raise ValueError("run needs a command after --")
    out = Path(directory)
    if out.exists() and any(_LOG_NAME.match(p.stem) for p in out.glob("*.log")):
        raise ValueError(f"{directory} holds the logs of an earlier run: give an empty --dir")
    out.mkdir(parents=True, exist_ok=True)
    site = tempfile.mkdtemp(prefix="loka-cache-keys-")
    try:
        Path(site, "sitecustomize.py").write_text(_SITE.format(loggers=LOGGERS))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([site] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
        env["LOKA_CACHE_KEY_LOG"] = str(out.resolve())
        proc = subprocess.Popen(list(command), env=env)
        Path(out, "root.json").write_text(json.dumps({"pid": proc.pid,
                                                      "command": list(command)}))
        return proc.wait()
    finally:
        shutil.rmtree(site, ignore_errors=True)


def parse(path: Path) -> List[Dict[str, object]]:
    """The keys one process's log holds, in order: ``{"cache": "fx" | "aot", "key",
    "parts": {name: (hash, value)}}``. A part's value may run over several lines (a
    graph's code, a pickled option): they are joined to it."""
    entries: List[Dict[str, object]] = []
    current: Optional[Dict[str, object]] = None
    last: Optional[str] = None
    for line in path.read_text(errors="replace").splitlines():
        m = _DETAILS.match(line)
        if m:
            current = {"cache": "fx" if m.group(2) == "FX" else "aot", "key": m.group(3),
                       "parts": {}}
            entries.append(current)
            last = None
            continue
        if line.startswith("@@ "):
            current = None  # another message of these loggers
            continue
        if current is None:
            continue
        part = _PART.match(line.strip())
        if part:
            last = part.group(2)
            current["parts"][last] = (part.group(1), part.group(3))
        elif last is not None:
            digest, value = current["parts"][last]
            current["parts"][last] = (digest, value + "\n" + line)
    return entries


def _differing(mine: Dict[str, tuple], theirs: Dict[str, tuple]) -> List[Dict[str, object]]:
    return [{"part": name,
             "here": mine[name][1][:SHOWN] if name in mine else None,
             "there": theirs[name][1][:SHOWN] if name in theirs else None}
            for name in sorted(set(mine) | set(theirs))
            if mine.get(name, (None,))[0] != theirs.get(name, (None,))[0]]


def compare(directory: str) -> Dict[str, object]:
    """Per process (``pid``, its parent, and whether it is the command's own process), its
    keys by cache, how many another process also had, and for the first
    :data:`DIFFERENCES` keys no other process had, the parts whose hashes differ from the
    nearest such key of another process (the one with the most parts of equal hash)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    top = None
    if (root / "root.json").exists():
        top = json.loads((root / "root.json").read_text()).get("pid")
    procs = {}
    for path in sorted(root.glob("*.log")):
        name = _LOG_NAME.match(path.stem)
        if not name:
            continue  # not a log of `run`
        entries = parse(path)
        if entries:
            procs[int(name.group(1))] = {"ppid": int(name.group(2)), "entries": entries}
    if not procs:
        raise ValueError(f"{directory} holds no cache keys: nothing compiled, or the "
                         f"command did not run under `cache_keys.py run`")
    out = []
    for pid, p in procs.items():
        others = [e for q, o in procs.items() if q != pid for e in o["entries"]]
        row = {"pid": pid, "ppid": p["ppid"], "command": pid == top, "caches": {}}
        for cache in ("aot", "fx"):
            mine = [e for e in p["entries"] if e["cache"] == cache]
            theirs = [e for e in others if e["cache"] == cache]
            keys = {e["key"] for e in theirs}
            unmatched = [e for e in mine if e["key"] not in keys]
            diffs = []
            for e in unmatched[:DIFFERENCES]:
                hashes = {(n, h) for n, (h, _) in e["parts"].items()}
                near = max(theirs, default=None, key=lambda o: len(
                    hashes & {(n, h) for n, (h, _) in o["parts"].items()}))
                if near is not None:
                    diffs.append({"key": e["key"], "nearest": near["key"],
                                  "parts": _differing(e["parts"], near["parts"])})
            row["caches"][cache] = {"keys": len(mine), "shared": len(mine) - len(unmatched),
                                    "unshared": len(unmatched), "differences": diffs}
        out.append(row)
    return {"schema": "loka.bench.cache_keys", "version": 2, "dir": str(root),
            "processes": out}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run a command (after --) with its cache keys logged")
    r.add_argument("--dir", required=True, help="directory for the per-process logs")
    c = sub.add_parser("compare", help="which keys processes shared, and how the rest differ")
    c.add_argument("--dir", required=True)
    c.add_argument("--out", help="JSON file for the comparison (default: print it)")
    args = ap.parse_args(argv)
    if args.what == "run":
        if not command:
            ap.error("run needs a command after --")
        try:
            return run(args.dir, command)
        except (OSError, ValueError) as e:  # a command that is not there, a used --dir
            ap.error(f"run: {e}")
    if command:
        ap.error("compare takes no command")
    try:
        result = compare(args.dir)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    for p in result["processes"]:
        caches = ", ".join(f"{k} {v['shared']}/{v['keys']} shared"
                           for k, v in p["caches"].items())
        print(f"pid {p['pid']}{' (the command)' if p['command'] else ''}: {caches}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
