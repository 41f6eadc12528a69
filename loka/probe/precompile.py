"""Compiling the Probe's timed calls ahead, in child processes, while it measures errors.

The Probe times the kernels whose quantization is plain PyTorch under ``torch.compile``
(:func:`loka.probe.calls.compiled_call`): one compiled graph per kernel, shape and
operand layout. On a machine whose compile caches are empty, compiling those graphs is most
of the Probe's timing pass (its report's ``meta['spent']['compile_s']``), one graph at a
time.

:func:`start` hands the calls the timing pass will compile (:class:`Entry`, planned once the
baselines are timed, before any error is sampled) to child processes,
:func:`main` (``SPEC`` ``OUT`` JSON files), that compile them into the on-disk caches
torch.compile keeps (Inductor's FX graph cache, AOTAutograd's cache, Triton's kernels)
while the parent samples errors. The parent's own compiles of the same graphs then load
from those caches instead of generating and compiling code again.

The children change no measurement: the parent waits for them (:meth:`Precompile.wait`)
before it times its first kernel, so their GPU and CPU work never overlaps a timing. While
it waits, LoKA's Triton kernels autotune at their timed shapes
(``ProbeConfig.tune_ahead``): the choice of a config may see the children's work, the
timings of the chosen configs do not. A
child that fails, or is still running after :data:`WAIT_S`, costs the parent only the
compiles it then does itself; what happened is in the report's ``meta['precompile']``.

A cache hit needs the same key in both processes: the children get the parent's Inductor
and functorch options that differ from their defaults and its matmul precision flags (the
parts of the key a process sets for itself); the cache directory and the visible devices
they inherit with the environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..config import Role
from ..kernels import registry
from ..kernels.roofline import autotune_limit
from .calls import compiled_call, linear_dims, one_line
from .sampler import naive_pair

__all__ = ["Entry", "Precompile", "start", "workers_for", "warm", "state_changes", "WAIT_S",
           "MAX_WORKERS"]

WAIT_S = 300.0
"""the longest the parent waits for its children before timing; then it stops them"""
MAX_WORKERS = 8
"""children at most by default (each holds a CUDA context and compiles one graph at a time)"""


class Entry(NamedTuple):
    """One compiled call of the timing pass: ``kernel`` at GEMM ``shape`` (M, K, N) of
    ``role`` on operands of ``dtype`` (``'bfloat16'``), the weight quantized beforehand
    where ``weight_q``."""

    kernel: str
    role: str
    shape: Tuple[int, int, int]
    dtype: str
    weight_q: bool


def workers_for(config, device: Optional[torch.device], entries: int) -> int:
    """How many children compile ``entries`` calls: ``config.precompile_workers``, or by
    default on CUDA half the CPU cores, at most :data:`MAX_WORKERS`, and none elsewhere
    (the CPU's timing pass compiles nothing by default, and compiles there compete with
    the errors for the same cores); never more than there are entries."""
    n = config.precompile_workers
    if n is None:
        if device is None or torch.device(device).type != "cuda":
            return 0
        n = min(MAX_WORKERS, max(1, (os.cpu_count() or 2) // 2))
    return max(0, min(n, entries))


def _changed(module) -> Dict[str, object]:
    """The options of a torch config module that differ from their defaults, where JSON
    can carry them (a private API: where it is missing, nothing is carried)."""
    try:
        changed = module._get_dict(skip_default=True)
    except Exception:  # noqa: BLE001 - another torch: the children use their defaults
        return {}
    out = {}
    for key, value in changed.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def process_state() -> Dict[str, object]:
    """What a child must set to compile under the parent's cache keys."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    matmul = torch.backends.cuda.matmul
    flags = {}
    for name in _MATMUL_FLAGS:
        if name == "allow_tf32" and hasattr(matmul, "fp32_precision"):
            continue  # fp32_precision says it and more (and torch may refuse to read it)
        try:
            flags[name] = getattr(matmul, name)
        except (AttributeError, RuntimeError):  # a flag this torch lacks, or will not read
            continue
    return {
        "inductor": _changed(inductor_config),
        "functorch": _changed(functorch_config),
        "matmul": {k: v if isinstance(v, str) else bool(v) for k, v in flags.items()},
        "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
    }


# (``fp32_precision``, where this torch has it, says what ``allow_tf32`` says and more; set
# after it, it wins, and a flag equal to the child's own is not set: setting one moves the
# other)
_MATMUL_FLAGS = ("allow_tf32", "fp32_precision", "allow_fp16_reduced_precision_reduction",
                 "allow_bf16_reduced_precision_reduction")


def state_changes(before: Dict[str, object], after: Dict[str, object]) -> List[str]:
    """The parts of two :func:`process_state` results that differ, as ``'section.name'``
    (e.g. ``'matmul.fp32_precision'``): a parent whose state moved after its children
    started compiles under other cache keys, and loads nothing they compiled."""
    out = []
    for section in sorted(set(before) | set(after)):
        b, a = before.get(section), after.get(section)
        if isinstance(b, dict) and isinstance(a, dict):
            out += [f"{section}.{k}" for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)]
        elif b != a:
            out.append(section)
    return out


def _apply_state(state: Dict[str, object]) -> None:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    for module, key in ((inductor_config, "inductor"), (functorch_config, "functorch")):
        for name, value in state.get(key, {}).items():
            current = getattr(module, name, None)
            if isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)  # JSON has no tuples; the key hashes the type
            try:
                setattr(module, name, value)
            except Exception:  # noqa: BLE001 - an option this torch lacks: a cache miss
                pass
    matmul = torch.backends.cuda.matmul
    for name in _MATMUL_FLAGS:
        value = state.get("matmul", {}).get(name)
        try:
            if value is not None and getattr(matmul, name) != value:
                setattr(matmul, name, value)
        except (AttributeError, RuntimeError):  # a flag this torch lacks, or will not read
            continue
    torch.use_deterministic_algorithms(bool(state.get("deterministic", False)))


def _cache_off() -> Optional[str]:
    """Why the parent's compiles could not load what a child compiled, or None."""
    from torch._inductor import config as inductor_config

    if not inductor_config.fx_graph_cache:
        return "Inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)"
    return None


class Precompile:
    """The children of one Probe (:func:`start`)."""

    def __init__(self, entries: Sequence[Entry], procs: List[Tuple[subprocess.Popen, Path]],
                 workdir: Optional[str], skipped: Optional[str] = None,
                 state: Optional[Dict[str, object]] = None) -> None:
        self.entries = list(entries)
        self.procs = procs
        self.workdir = workdir
        self.skipped = skipped
        self.state = state
        """what the children were given (:func:`process_state` when they started)"""
        self.started = time.perf_counter()

    def running(self) -> bool:
        """Whether any child is still compiling."""
        return any(p.poll() is None for p, _ in self.procs)

    def wait(self, status: Callable[[str], None] = lambda s: None,
             timeout: float = WAIT_S) -> Dict[str, object]:
        """Wait for every child (at most ``timeout`` seconds in all; then stop the rest)
        and say what they did: the report's ``meta['precompile']``."""
        if self.skipped is not None:
            return {"entries": len(self.entries), "workers": 0, "skipped": self.skipped}
        t0 = time.perf_counter()
        if any(p.poll() is None for p, _ in self.procs):
            status(f"compiling {len(self.entries)} timed calls in {len(self.procs)} processes")
        timed_out = 0
        for p, _ in self.procs:
            try:
                p.wait(timeout=max(0.0, timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                timed_out += 1
        compiled, failed, errors = 0, 0, []
        for p, out in self.procs:
            try:
                done = json.loads(out.read_text())
                compiled += int(done["compiled"])
                failed += len(done["failed"])
                errors += [str(e) for e in done["failed"]]
            except (OSError, ValueError, KeyError, TypeError):
                log = out.with_suffix(".log")
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] \
                    if log.exists() else []
                errors.append(f"child exited {p.returncode}" + (f": {tail[0][:200]}"
                                                                if tail else ""))
        return {"entries": len(self.entries), "workers": len(self.procs),
                "compiled": compiled, "failed": failed, "timed_out": timed_out,
                "errors": errors[:5], "wall_s": round(time.perf_counter() - self.started, 3),
                "waited_s": round(time.perf_counter() - t0, 3),
                "state_changed": state_changes(self.state, process_state())
                if self.state is not None else []}

    def stop(self) -> None:
        """Stop any child still running and remove the specs (idempotent)."""
        for p, _ in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


# (``-m loka.probe.precompile`` would import this module twice: the package imports it)
_CHILD = "import sys; from loka.probe.precompile import main; sys.exit(main())"


def start(entries: Sequence[Entry], device: Optional[torch.device], config
          ) -> Optional[Precompile]:
    """Start compiling ``entries`` in :func:`workers_for` children; None where none are
    wanted (no entries, or none asked for)."""
    entries = list(entries)
    n = workers_for(config, device, len(entries))
    if n == 0:
        return None
    reason = _cache_off()
    if reason is not None:
        return Precompile(entries, [], None, skipped=reason)
    # the largest calls first, dealt round-robin: the children finish at about one time
    order = sorted(entries, key=lambda e: -(e.shape[0] * e.shape[1] * e.shape[2]))
    chunks = [order[i::n] for i in range(n)]
    workdir = tempfile.mkdtemp(prefix="loka-precompile-")
    state = process_state()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the package
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # n children, each one compile at a time
    procs = []
    for i, chunk in enumerate(chunks):
        spec = Path(workdir) / f"spec{i}.json"
        out = Path(workdir) / f"out{i}.json"
        spec.write_text(json.dumps({
            "device": str(device), "seed": config.seed, "state": state,
            "autotune_configs": config.autotune_configs,
            "entries": [e._asdict() for e in chunk]}))
        with open(out.with_suffix(".log"), "w") as log:
            procs.append((subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(spec), str(out)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL),
                out))
    return Precompile(entries, procs, workdir, state=state)


def warm(entries: Sequence[Entry], device: torch.device, seed: int = 0,
         autotune_configs: Optional[int] = None) -> Tuple[int, List[str]]:
    """Compile each entry's call as the timing pass does (the same function, operands of
    the same shapes, layouts and dtypes, the weight quantized beforehand where asked), by
    calling it once. Returns (calls compiled, one line per call that failed)."""
    calls: Dict[tuple, Callable] = {}
    done, failed = 0, []
    for e in entries:
        try:
            kern = registry.get(e.kernel)
            role, dtype = Role.parse(e.role), getattr(torch, e.dtype)
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            a, b = naive_pair(role, *linear_dims(role, tuple(e.shape)), device, dtype, gen)
            with torch.no_grad(), autotune_limit(autotune_configs):
                if e.weight_q:
                    b = kern.quantize_b(b)
                key = (kern.name, dtype)
                if key not in calls:
                    calls[key] = compiled_call(kern, dtype)
                calls[key](a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            done += 1
        except Exception as ex:  # noqa: BLE001 - the parent compiles it itself
            failed.append(f"{e.kernel} {e.role} {tuple(e.shape)}: {one_line(ex)}")
    return done, failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    """A child of :func:`start` (arguments SPEC OUT): compile SPEC's entries, write what
    happened to OUT."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: main SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    _apply_state(spec.get("state", {}))
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    entries = [Entry(d["kernel"], d["role"], tuple(d["shape"]), d["dtype"], bool(d["weight_q"]))
               for d in spec["entries"]]
    t0 = time.perf_counter()  # (importing this module imported the package: kernels registered)
    done, failed = warm(entries, device, int(spec.get("seed", 0)), spec.get("autotune_configs"))
    Path(args[1]).write_text(json.dumps({"compiled": done, "failed": failed,
                                         "seconds": round(time.perf_counter() - t0, 3)}))
    return 0
