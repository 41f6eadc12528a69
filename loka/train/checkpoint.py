"""A run directory's files: the checkpoint (written atomically, with a checksum, verified on
load) and the lock that gives one run at a time the directory.

A checkpoint is a plain ``torch.save`` dict, loaded with ``torch.load(weights_only=True)``.
Its ``checksum`` entry is ``"sha256:<hex>"`` over everything else in it (every key, every
number, every tensor's dtype, shape and bytes, in order), so a file that changed after it
was written (a flipped byte, a truncated copy) is refused instead of resuming with other
weights or optimizer state. Every failure to read one is a :class:`CheckpointError` whose
message names the file.

The checkpoint is written to one temp file of a fixed name beside it
(``.ckpt-checkpoint.pt.tmp``), flushed to disk, then renamed over the checkpoint: a crash,
even SIGKILL, leaves the previous checkpoint intact and at most that one temp file, which
the next run of the directory removes (:func:`remove_stale_temp_files`). Files get the
mode the umask gives (0644 under 022).

:class:`RunLock` is an exclusive ``flock`` on ``<dir>/.loka.lock``, which holds the
holder's pid: a second run into the directory fails at once, naming that pid; a lock left
by a killed run is free (the kernel drops it with its process), and the next run takes it
over and says so.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import os
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..jsonio import atomic_write

__all__ = ["CHECKPOINT_NAME", "CHECKSUM_KEY", "TEMP_PATTERNS", "CheckpointError",
           "RunInUseError", "RunExistsError", "RunLock", "checkpoint_digest",
           "write_checkpoint", "read_checkpoint", "verify_checkpoint", "remove_stale_temp_files"]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKSUM_KEY = "checksum"
"""the checkpoint entry holding ``"sha256:<hex>"`` of the others"""
TEMP_PATTERNS = (".ckpt-*.tmp", ".tmp-*metrics.json")
"""the temp files LoKA writes in a run directory (the checkpoint's, and the atomic JSON
writer's for metrics.json): what a killed run may leave behind"""
_REQUIRED = {"model": Mapping, "optimizers": list, "step": int, "losses": list,
             "eval_history": list, "rng_cpu": torch.Tensor}
"""the entries of a checkpoint written by ``train`` and their types"""


class CheckpointError(ValueError):
    """A checkpoint that is empty, damaged, or not one ``loka.train`` wrote; the message
    names the file."""


class RunInUseError(RuntimeError):
    """The run directory is locked by another live run."""


class RunExistsError(ValueError):
    """The run directory already holds a checkpoint, and the run was not asked to resume."""


# -- the checksum -------------------------------------------------------------------------
def _feed(h, obj: Any) -> None:
    """Hash ``obj`` (nested dicts, lists, tensors, numbers, strings) by value and structure."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.layout != torch.strided:
            t = t.to_dense()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(f"a checkpoint cannot hold a {type(obj).__name__}")


def checkpoint_digest(state: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of every entry of ``state`` but the checksum itself, in order."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != CHECKSUM_KEY})
    return "sha256:" + h.hexdigest()


# -- writing ------------------------------------------------------------------------------
def _temp_path(path: str) -> str:
    return os.path.join(os.path.dirname(path) or ".", f".ckpt-{os.path.basename(path)}.tmp")


def write_checkpoint(path: "str | os.PathLike", state: Mapping[str, Any]) -> None:
    """Write ``state`` and its checksum to ``path`` atomically (temp file, fsync, rename)."""
    path = os.fspath(path)
    payload = dict(state)
    payload[CHECKSUM_KEY] = checkpoint_digest(payload)
    # one fixed temp name: a killed writer leaves at most one file, which a restart removes
    atomic_write(path, lambda f: torch.save(payload, f), binary=True, temp=_temp_path(path))


def remove_stale_temp_files(directory: "str | os.PathLike",
                            patterns: Sequence[str] = TEMP_PATTERNS) -> List[str]:
    """Remove the temp files a killed run left in ``directory`` (only names matching
    ``patterns``, LoKA's own); returns the names removed. Call it holding the
    directory's :class:`RunLock`, so that no live writer owns them."""
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for name in names:
        full = os.path.join(directory, name)
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) and os.path.isfile(full):
            os.unlink(full)
            removed.append(name)
    return removed


# -- reading ------------------------------------------------------------------------------
def verify_checkpoint(path: "str | os.PathLike", state: Any) -> Dict[str, Any]:
    """Check that ``state`` (loaded from ``path``) has the entries ``train`` writes and that
    its checksum matches; returns it without the checksum. A checkpoint written before
    checksums existed is accepted as it is."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a LoKA checkpoint (it holds a "
                              f"{type(state).__name__}, not a dict)")
    for key, kind in _REQUIRED.items():
        if key not in state:
            raise CheckpointError(f"{path}: not a LoKA checkpoint (no {key!r} entry)")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{path}: not a LoKA checkpoint ({key!r} is a "
                                  f"{type(state[key]).__name__}, not a {kind.__name__})")
    if state["step"] < 0:
        raise CheckpointError(f"{path}: not a LoKA checkpoint (step {state['step']})")
    state = dict(state)
    recorded = state.pop(CHECKSUM_KEY, None)
    if recorded is not None:
        try:
            actual = checkpoint_digest(state)
        except TypeError as e:
            raise CheckpointError(f"{path}: not a LoKA checkpoint ({e})") from None
        if recorded != actual:
            raise CheckpointError(f"{path}: checksum mismatch: the file changed after it was "
                                  "written (damaged or edited)")
    return state


def read_checkpoint(path: "str | os.PathLike", map_location: "torch.device | str" = "cpu"
                    ) -> Dict[str, Any]:
    """Load a checkpoint ``train`` wrote (``torch.load(weights_only=True)``) and verify it
    (:func:`verify_checkpoint`); every failure is a :class:`CheckpointError` naming the file
    (FileNotFoundError for a missing one)."""
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}"
                              f"{': ' + msg[:200] if msg else ''})") from None
    return verify_checkpoint(path, state)


# -- the lock -----------------------------------------------------------------------------
_HELD: Dict[str, List] = {}
"""lock path -> [file descriptor, depth]: the locks this process holds (re-entered, not
taken twice: ``flock`` on a second descriptor would block the process against itself)"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on a run directory for the duration of a ``with`` block.

    Args:
        directory: the run directory (created if missing).

    Raises:
        RunInUseError: another live process holds it (the message names its pid).

    After entering, ``took_over`` is the pid of a dead run whose lock file was left behind
    (None when there was none); re-entering in the same process nests.
    """

    NAME = ".loka.lock"

    def __init__(self, directory: "str | os.PathLike") -> None:
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, self.NAME)
        self.took_over: Optional[int] = None
        self._key = os.path.realpath(self.path)

    def __enter__(self) -> "RunLock":
        held = _HELD.get(self._key)
        if held is not None:
            held[1] += 1
            return self
        os.makedirs(self.directory, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.read(fd, 64).decode(errors="replace").strip()
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise RunInUseError(f"{self.directory} is in use by another loka run "
                                    f"(pid {holder or '?'})") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file as we opened it: take the new one
        previous = os.read(fd, 64).decode(errors="replace").strip()
        if previous.isdigit() and int(previous) != os.getpid():
            self.took_over = int(previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[self._key] = [fd, 1]
        return self

    @property
    def takeover_note(self) -> Optional[str]:
        """What to tell the user when a dead run's lock was taken over."""
        if self.took_over is None:
            return None
        state = "no longer running" if not _pid_alive(self.took_over) else "not holding it"
        return (f"took over the lock of {self.directory} left by pid {self.took_over} "
                f"({state})")

    def __exit__(self, *exc) -> None:
        held = _HELD[self._key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[self._key]
        fd = held[0]
        try:
            os.unlink(self.path)  # still holding it: no other run can hold this file now
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
