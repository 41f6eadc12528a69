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
process had, the parts that differ from the nearest key of another process.

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
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
"""the modules whose DEBUG lines hold each key's parts"""

_SITE = '''\
import logging, os
_dir = os.environ.get("LOKA_CACHE_KEY_LOG")
if _dir:
    _h = logging.FileHandler(os.path.join(_dir, "%d-%d.log" % (os.getpid(), os.getppid())),
                             delay=True)  # (no file for a process that logs nothing)
    _h.setFormatter(logging.Formatter("@@ %(name)s %(message)s"))
    for _name in {loggers!r}:
        _log = logging.getLogger(_name)
        _log.setLevel(logging.DEBUG)
        _log.addHandler(_h)
'''

_DETAILS = re.compile(r"^@@ (\S+) (FX|Autograd) graph cache hash details for key (\S+):$")


def run(directory: str, command: Sequence[str]) -> int:
    """Run ``command`` with every Python process's cache-key lines logged under
    ``directory``; returns its exit status."""
    if not command:
        raise ValueError("run needs a command after --")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    site = tempfile.mkdtemp(prefix="loka-cache-keys-")
    Path(site, "sitecustomize.py").write_text(_SITE.format(loggers=LOGGERS))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    env["LOKA_CACHE_KEY_LOG"] = str(out.resolve())
    proc = subprocess.Popen(list(command), env=env)
    Path(out, "root.json").write_text(json.dumps({"pid": proc.pid, "command": list(command)}))
    return proc.wait()


def parse(path: Path) -> List[Dict[str, object]]:
    """The keys one process's log holds, in order: ``{"cache": "fx" | "aot", "key",
    "parts": [line, ...]}``."""
    entries: List[Dict[str, object]] = []
    current: Optional[Dict[str, object]] = None
    for line in path.read_text(errors="replace").splitlines():
        m = _DETAILS.match(line)
        if m:
            current = {"cache": "fx" if m.group(2) == "FX" else "aot", "key": m.group(3),
                       "parts": []}
            entries.append(current)
        elif line.startswith("@@ "):
            current = None  # another message of these loggers
        elif current is not None and line.strip():
            current["parts"].append(line.strip())
    return entries


def compare(directory: str) -> Dict[str, object]:
    """Per process (``pid``, its parent, and whether it is the command's own process), its
    keys by cache, how many another process also had, and for each key no other process
    had the parts in which it differs from the nearest such key of another process."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    top = None
    if (root / "root.json").exists():
        top = json.loads((root / "root.json").read_text()).get("pid")
    procs = {}
    for path in sorted(root.glob("*-*.log")):
        pid, ppid = (int(x) for x in path.stem.split("-"))
        entries = parse(path)
        if entries:
            procs[pid] = {"ppid": ppid, "entries": entries}
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
            for e in unmatched[:3]:
                parts = set(e["parts"])
                near = max(theirs, key=lambda o: len(parts & set(o["parts"])), default=None)
                if near is None:
                    continue
                theirs_parts = set(near["parts"])
                diffs.append({"key": e["key"], "nearest": near["key"],
                              "only_here": sorted(parts - theirs_parts),
                              "only_there": sorted(theirs_parts - parts)})
            row["caches"][cache] = {"keys": len(mine), "shared": len(mine) - len(unmatched),
                                    "unshared": len(unmatched), "differences": diffs}
        out.append(row)
    return {"schema": "loka.bench.cache_keys", "version": 1, "dir": str(root),
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
        return run(args.dir, command)
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
