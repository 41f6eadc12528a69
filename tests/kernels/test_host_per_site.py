"""bench/host_per_site.py on the CPU: one row per launcher with its times and its error
against the bf16 chain, a launcher this machine lacks as a row with its error, and its
argument errors (times mean nothing here)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import host_per_site as H  # noqa: E402


def test_rows_per_launcher_with_their_error_against_bf16(tmp_path):
    out = tmp_path / "h.json"
    assert H.main(["--sites", "3", "--rows", "32", "--dim", "32", "--steps", "2",
                   "--repeats", "1", "--device", "cpu",
                   "--variants", "bf16,scaled_mm,loka_scaled_mm,triton_gemm,bf16_modules,"
                   "loka_modules", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loka.bench.host_per_site" and doc["device_name"] == "cpu"
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["bf16", "scaled_mm", "loka_scaled_mm", "triton_gemm",
                          "bf16_modules", "loka_modules"]
    assert rows["bf16"]["rel_err_vs_bf16"] == rows["bf16_modules"]["rel_err_vs_bf16"] == 0.0
    for name in ("scaled_mm", "loka_scaled_mm", "loka_modules"):
        r = rows[name]
        assert r["wall_us_per_step"] > 0 and "gpu_us_per_step" not in r
        # three FP8 GEMMs of the same chain: FP8's error, not another function
        assert 1e-3 < r["rel_err_vs_bf16"] < 0.15, r
        assert r["extra_wall_us_per_site"] == pytest.approx(
            (r["wall_us_per_step"] - rows["bf16"]["wall_us_per_step"]) / 3)
    # the cuBLAS launchers, bare and through loka.apply's Linears, compute the same values
    for name in ("loka_scaled_mm", "loka_modules"):
        assert rows[name]["rel_err_vs_bf16"] == pytest.approx(
            rows["scaled_mm"]["rel_err_vs_bf16"], rel=1e-6), name
    assert "error" in rows["triton_gemm"]  # no Triton GEMM on a CPU: a row, not a stop


@pytest.mark.parametrize("argv", [["--dim", "24"], ["--sites", "0"], ["--variants", "fp4"]])
def test_argument_errors(argv, capsys):
    with pytest.raises(SystemExit):
        H.main(argv + ["--device", "cpu"])
    assert "error" in capsys.readouterr().err
