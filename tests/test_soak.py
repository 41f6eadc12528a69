"""bench/soak.py on the CPU for a few steps: every injected fault is caught (an Inf in the
output gradient skips its update, an FP8 gradient overflow and an activation drift past a
static FP8 scale switch their sites), and training ends on a finite loss."""

import importlib.util
import json
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_short_soak_catches_every_fault_and_ends_finite(soak, tmp_path, one_thread, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(["--steps", "20", "--device", "cpu", "--batch-size", "64", "--inf-steps",
                      "3,9", "--fp8-fault-step", "5", "--drift-from", "10", "--drift-steps", "2",
                      "--guard-every", "2", "--eval-steps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["ok"], result
    faults = {f["fault"]: f for f in result["faults"]}
    assert all(f["caught"] for f in faults.values())
    assert {3, 9} <= set(result["skipped_steps"])  # bad gradients: updates skipped
    switched = {s["site"]: s for s in result["sites_switched"]}
    assert set(switched) == {faults["fp8-grad"]["site"], faults["drift"]["site"]}
    assert switched[faults["fp8-grad"]["site"]]["step"] == 5
    assert "non-finite weight gradient" in switched[faults["fp8-grad"]["site"]]["reason"]
    assert "saturation" in switched[faults["drift"]["site"]]["reason"]
    assert switched[faults["drift"]["site"]]["step"] >= 10
    assert result["final_loss_finite"] and result["params_finite"]
    assert "3/3 faults caught" in capsys.readouterr().out
