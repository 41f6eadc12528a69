"""bench/host_per_call.py on the CPU: its rows per kernel (eager and compiled), kernels
unavailable here listed as skipped, and its argument errors (times mean nothing here)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import host_per_call as H  # noqa: E402


def test_rows_per_kernel_and_the_unavailable_ones_skipped(tmp_path):
    out = tmp_path / "h.json"
    # a kernel of this CPU (torch 2.11's build has no rowwise _scaled_mm there)
    fp8 = "cublas-rowwise" if H.registry.get("cublas-rowwise").device_ok("cpu") \
        else "cublas-tensorwise"
    assert H.main(["--shape", "32x16x24", "--kernels", f"bf16,{fp8},cublas-rowwise-fastacc",
                   "--calls", "3", "--repeats", "2", "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loka.bench.host_per_call"
    assert [(r["kernel"], r["how"]) for r in doc["rows"]] == [
        ("bf16", "eager"), ("bf16", "compiled"), (fp8, "eager"), (fp8, "compiled")]
    assert all(r["shape"] == [32, 16, 24] and r["wall_us_per_call"] > 0 and "error" not in r
               for r in doc["rows"])
    assert "gpu_us_per_call" not in doc["rows"][0]  # CPU: no GPU time
    assert set(doc["skipped"]) == {"cublas-rowwise-fastacc"}  # CUDA tensor cores only


def test_a_failing_kernel_is_a_row_with_its_error(monkeypatch):
    import dataclasses

    import torch
    from loka.kernels import registry

    def boom(a, b, dtype):
        raise RuntimeError("no kernel image\nsecond line")
    broken = dataclasses.replace(registry.get("cublas-rowwise"), fn=boom)
    monkeypatch.setattr(H.registry, "get", lambda name: broken)
    rows = H.measure("cublas-rowwise", (8, 16, 16), torch.device("cpu"), torch.float32, 2, 1)
    assert [r["error"] for r in rows] == ["RuntimeError: no kernel image"] * 2


@pytest.mark.parametrize("args,match", [(["--shape", "256x256"], "is not MxKxN"),
                                        (["--shape", "0x8x8"], "positive"),
                                        (["--kernels", "warp-speed"], "unknown kernel"),
                                        (["--calls", "0"], ">= 1")])
def test_bad_arguments_are_one_line_errors(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        H.main(args + ["--device", "cpu"])
    assert e.value.code == 2 and match in capsys.readouterr().err
