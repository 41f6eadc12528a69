"""Peak memory of streaming a large Criteo-format file through ``CriteoReader``.

    python bench/bench_data_memory.py                 # a 16 MB file
    python bench/bench_data_memory.py --size-mb 1024  # ~1 GB, ~4.5M lines

Writes a random file in the Criteo TSV layout to a temporary directory (deleted after;
never committed), reads it batch by batch, and reports the peak resident set size before
and after reading: a streaming reader's peak must not grow with the file. Writes JSON to
``--out`` (default bench/results/data_memory_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import time

import torch

from loka.data import CriteoReader


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def write_file(path: str, size_mb: float, seed: int = 0) -> int:
    """A random Criteo-layout file of about ``size_mb`` MB, written in chunks. Returns lines."""
    rng = random.Random(seed)
    target, written, lines = int(size_mb * 1e6), 0, 0
    hexes = [f"{rng.getrandbits(32):08x}" for _ in range(4096)]
    with open(path, "w") as f:
        while written < target:
            chunk = []
            for _ in range(10_000):
                dense = [str(int(rng.expovariate(0.1))) if rng.random() > 0.2 else ""
                         for _ in range(13)]
                cats = [hexes[rng.getrandbits(12)] if rng.random() > 0.05 else "" for _ in range(26)]
                chunk.append("\t".join([str(int(rng.random() < 0.25))] + dense + cats))
            text = "\n".join(chunk) + "\n"
            f.write(text)
            written += len(text)
            lines += len(chunk)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "criteo.tsv")
        lines = write_file(path, args.size_mb)
        size = os.path.getsize(path)
        rss_before = _peak_rss_mb()
        tic = time.perf_counter()
        examples, batches, clicks = 0, 0, 0.0
        for batch in CriteoReader(path, args.batch_size):
            examples += batch.batch_size
            batches += 1
            clicks += float(batch.labels.sum())
        seconds = time.perf_counter() - tic
        rss_after = _peak_rss_mb()
    assert examples == lines, (examples, lines)
    result = {
        "file_mb": size / 1e6, "lines": lines, "batch_size": args.batch_size,
        "batches": batches, "seconds": seconds, "lines_per_s": lines / seconds,
        "mb_per_s": size / 1e6 / seconds, "ctr": clicks / examples,
        "peak_rss_mb_before_reading": rss_before, "peak_rss_mb_after_reading": rss_after,
        "peak_rss_growth_mb": rss_after - rss_before, "torch": torch.__version__,
    }
    print(f"{size / 1e6:.0f} MB, {lines:,} lines in {seconds:.1f}s ({result['lines_per_s']:,.0f} lines/s)")
    print(f"peak RSS {rss_before:.0f} MB before reading, {rss_after:.0f} MB after "
          f"(+{result['peak_rss_growth_mb']:.1f} MB)")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "data_memory_cpu.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
