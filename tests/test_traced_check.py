"""bench/traced_check.py on the CPU: the script runs end to end and writes its rows (its
timings say nothing on a CPU; the GPU run is the measurement)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_traced_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "traced.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "traced_check.py"), "--device", "cpu",
                           "--width", "32", "--batch", "32", "--layers", "2", "--steps", "1",
                           "--warmup", "1", "--kernels", "emulated-rowwise-e4m3,no-such-kernel",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["bf16"]["status"] == rows["emulated-rowwise-e4m3"]["status"] == "ok"
    fp8 = rows["emulated-rowwise-e4m3"]
    assert fp8["loka_op_calls"] == 0 and fp8["step_ms"] > 0 and fp8["gpu_ms"] is None
    # the compiled step computes what the eager one does
    assert abs(fp8["loss_compiled"] - fp8["loss_eager"]) < 1e-5 and fp8["grad_rel_diff"] < 1e-5
    assert rows["no-such-kernel"]["status"] == "failed" and "no-such-kernel" in rows["no-such-kernel"]["error"]
