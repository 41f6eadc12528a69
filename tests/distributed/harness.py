"""Run a function on W processes over gloo on 127.0.0.1 (CPU), with a deadline: a hang
fails the test instead of blocking the suite."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every result is written and every rank has passed the barrier. Leave without the
    # interpreter's teardown: with torch 2.13 on gloo it sometimes aborts in C++
    # destructors at exit ("terminate called without an active exception", SIGABRT),
    # after the work is done, which would fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, deadline_s: float = DEADLINE_S) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; an exception
    on any rank fails the test with that rank's traceback, and so does the deadline."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args),
                             nprocs=world_size, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{fn.__name__} on {world_size} ranks did not finish in {deadline_s} s")
