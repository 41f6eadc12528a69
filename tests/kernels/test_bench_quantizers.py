"""bench/bench_quantizers.py: its rows, its bit-exactness check and its argument errors,
run as a script under Triton's CPU interpreter at small shapes (times mean nothing here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_quantizers.py"
sys.path.insert(0, str(ROOT / "bench"))
import bench_quantizers as BQ  # noqa: E402


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", LOKA_TRITON_AUTOTUNE="0",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_row_at_every_shape_and_the_dual_row_is_bit_exact(tmp_path):
    out = tmp_path / "q.json"
    proc = _run("--shapes", "40x24,300x16", "--iters", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loka.bench.quantizers"
    assert [c["shape"] for c in doc["cases"]] == [[40, 24], [300, 16]]
    for case in doc["cases"]:
        rows = case["rows"]
        assert set(rows) == {"copy", "rowwise", "rowwise_t", "dual", "tensorwise", "c_rowwise",
                             "c_dual", "c_p2_rowwise", "c_p2_requant", "c_p2_dual",
                             "c_p2_direct_t"}
        n = case["shape"][0] * case["shape"][1]
        assert rows["copy"]["mbytes"] == pytest.approx(4 * n / 1e6)
        assert rows["dual"]["mbytes"] == pytest.approx(6 * n / 1e6)
        assert rows["dual"]["bit_exact"] is True
        assert rows["c_p2_requant"]["mbytes"] == pytest.approx(2 * n / 1e6)
        # the compiled power-of-two path: its rows as loka.numerics.quantize's, its
        # transposed layout, made from them, dequantizing to the direct one's values
        # (N(0, 9) data: every value normal under both scales), so the same errors
        p2 = rows["c_p2_dual"]
        assert p2["rows_bit_exact"] is True and p2["transposed_values_equal"] == 1.0
        assert 0.01 < p2["rel_err"] == p2["rel_err_direct"] < 0.05
        assert p2["rel_err_t"] == pytest.approx(p2["rel_err_t_direct"], rel=1e-12)
        assert rows["copy"]["of_copy_rate"] == pytest.approx(1.0)
        assert all(r["us"] > 0 and r["gb_per_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("text,match", [("4096", "is not RxC"), ("0x8", "positive"),
                                        (",", "no shape")])
def test_bad_shapes_are_one_line_errors(text, match):
    with pytest.raises(ValueError, match=match):
        BQ.parse_shapes(text)


def test_parse_shapes():
    assert BQ.parse_shapes("8192x2048, 4X8") == [(8192, 2048), (4, 8)]
