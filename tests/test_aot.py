"""``loka.aot_compile`` / ``loka.load_aot``: a planned model as an AOTInductor package.

The model is a small ranking tower written here (its own norm and activation), served with
a static FP8 plan on the CPU build's real ``torch._scaled_mm``. Compiling takes seconds, so
one package per module serves most tests.
"""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch
import torch.nn as nn

import loka
from loka.dispatch.aot import AOTModel
from loka.dispatch.schema import Plan

KERNEL = "cublas-tensorwise"
ROWS = 64


class SquashNorm(nn.Module):
    """RMS over the features, then a learned gain (not torch's own norm class)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


def hard_swish(x):
    return x * (x + 3).clamp(0, 6) / 6


class Tower(nn.Module):
    """Dense features and pooled embeddings in, one logit per row out."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16 + 3 * 16, 64)
        self.norm = SquashNorm(64)
        self.hid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, dense, pooled):
        x = torch.cat([dense, pooled.flatten(1)], 1)
        h = self.norm(hard_swish(self.inp(x)))
        h = h + hard_swish(self.hid(h))
        return self.out(h).squeeze(-1)


def inputs(rows: int = ROWS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 16, generator=g), torch.randn(rows, 3, 16, generator=g))


def input_amax(model: nn.Module, sites, example) -> dict:
    seen = {}
    hooks = [model.get_submodule(s).register_forward_pre_hook(
        lambda m, a, s=s: seen.__setitem__(s, float(a[0].abs().max()))) for s in sites]
    with torch.no_grad():
        model(*example)
    for h in hooks:
        h.remove()
    return seen


def planned(seed: int = 0, kernel: str = KERNEL, rows: int = 0):
    """(the float32 tower, its copy served with static FP8 forwards at inp and hid; ``rows``:
    the tokens the plan's static scale tables are made for)."""
    torch.manual_seed(seed)
    ref = Tower().eval()
    model = Tower().eval()
    model.load_state_dict(ref.state_dict())
    plan = Plan.uniform(model, kernel, module_filter=r"^(inp|hid)$")
    assert plan.fp8_sites() == ["inp", "hid"]
    for site in plan.fp8_sites():
        plan.sites[site].tokens = rows
    plan.static_scales = input_amax(ref, plan.fp8_sites(), inputs())
    loka.apply(model, plan, inference=True)
    return ref, model


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    ref, model = planned()
    path = tmp_path_factory.mktemp("aot") / "tower.pt2"
    served = loka.aot_compile(model, inputs(), path)
    return ref, model, served, path


def test_the_package_computes_the_compiled_models_bits_and_fp8s_error(package):
    ref, model, served, path = package
    x = inputs(seed=1)
    with torch.inference_mode():
        compiled = torch.compile(model)(*x)
        out = served(*x)
        exact = ref.double()(*(t.double() for t in x))
    # the same Inductor code: bit for bit
    assert torch.equal(out, compiled)
    # two FP8 e4m3 GEMMs with static scales against float64: a few percent, never near 1
    assert 1e-3 < rel(out, exact) < 0.08
    assert served.fp8_sites == ("inp", "hid")
    assert 0 < served.check["rel_err_vs_eager"] < 0.08
    assert served.check["max_abs_diff"] > 0  # casts of values Inductor computes otherwise
    assert served.device == torch.device("cpu")
    assert [tuple(i.shape) for i in served.inputs] == [(ROWS, 16), (ROWS, 3, 16)]
    assert served.inputs[0].dtype == "torch.float32"
    # nothing left beside the package
    assert sorted(os.listdir(path.parent)) == ["tower.pt2"]


def test_a_loaded_package_gives_the_same_bits(package):
    _, _, served, path = package
    again = loka.load_aot(path)
    x = inputs(seed=2)
    assert torch.equal(again(*x), served(*x))
    assert again.check is None and again.fp8_sites == served.fp8_sites
    assert "tower.pt2" in repr(again) and "fp8_sites=2" in repr(again)
    with pytest.raises(ValueError, match="compiled for cpu, not cuda"):
        loka.load_aot(path, device="cuda")


def test_inputs_laid_out_otherwise_give_the_contiguous_inputs_output(package):
    """The package reads memory as the contiguous example did: a transposed view, a column
    slice and an expanded row are copied first, not read as if contiguous."""
    _, _, served, _ = package
    dense, pooled = inputs(seed=4)
    want = served(dense, pooled)
    wide = torch.cat([torch.randn(ROWS, 16), dense], 1)
    for d in (dense.t().contiguous().t(), wide[:, 16:]):
        assert not d.is_contiguous()
        assert torch.equal(served(d, pooled), want)
    row = dense[:1].expand(ROWS, 16)
    assert torch.equal(served(row, pooled), served(row.contiguous(), pooled))


def test_non_finite_inputs_give_the_compiled_models_outputs(package):
    _, model, served, _ = package
    x = inputs(seed=3)
    x[0][5, 2] = float("nan")
    x[1][9, 0, 0] = float("inf")
    with torch.inference_mode():
        compiled = torch.compile(model)(*x)
    out = served(*x)
    # a NaN stays NaN; an Inf saturates to the static scale's largest FP8 value, as in the
    # compiled model (the plan's documented static-scale behaviour)
    assert torch.isnan(out[5]) and torch.isfinite(out[9])
    assert int(torch.isfinite(out).sum()) == ROWS - 1
    assert torch.equal(out.nan_to_num(), compiled.nan_to_num())


@pytest.mark.parametrize("bad, error, match", [
    (lambda x: x[:1], TypeError, "takes 2 tensor input"),
    (lambda x: (x[0].double(), x[1]), ValueError, "input 0 must be torch.float32"),
    (lambda x: (x[0][:10], x[1]), ValueError, r"input 0 must have shape \(64, 16\)"),
    (lambda x: (x[0], x[1].flatten(1)), ValueError, r"input 1 must have shape \(64, 3, 16\)"),
    (lambda x: (x[0].tolist(), x[1]), ValueError, "input 0 must be a tensor"),
])
def test_a_call_with_other_inputs_than_compiled_says_which(package, bad, error, match):
    _, _, served, _ = package
    with pytest.raises(error, match=match):
        served(*bad(inputs()))


def test_a_dynamic_batch_package_serves_other_row_counts(tmp_path):
    """Rowwise static scales whose table holds the example's rows: a row count traced as a
    symbol broadcasts the table's first row (the same scale) and adds no bound on it."""
    ref, model = planned(seed=1, kernel="cublas-rowwise", rows=ROWS)
    served = loka.aot_compile(model, inputs(), tmp_path / "dyn.pt2", dynamic_batch=True)
    assert [i.shape[0] for i in served.inputs] == [None, None]
    # the rowwise GEMM's scale checks branch on a single row: two rows up
    assert (served.inputs[0].min_rows, served.inputs[0].max_rows) == (2, None)
    for rows in (2, 37, 200):
        x = inputs(rows, seed=rows)
        with torch.inference_mode():
            eager = model(*x)
            exact = ref.double()(*(t.double() for t in x))
        out = served(*x)
        assert out.shape == (rows,)
        assert rel(out, eager) < 0.05
        assert rel(out, exact) < 0.08
    with pytest.raises(ValueError, match="input 0 has 1 rows; the package serves at least 2"):
        served(*inputs(1))
    with pytest.raises(ValueError, match=r"batch dimensions differ \(37 and 40 rows\)"):
        served(inputs(37)[0], inputs(40)[1])
    with pytest.raises(ValueError, match="the same rows"):
        loka.aot_compile(model, (inputs(37)[0], inputs(40)[1]), tmp_path / "bad.pt2",
                         dynamic_batch=True)


def test_a_dynamic_batch_is_exported_from_a_single_row_where_the_code_allows():
    """Sizes 0 and 1 traced like any other: a model whose code does not branch on a single
    row is exported for one row up (the range the package then keeps), and from an
    example of one row too (which aot_compile refuses: see the next test). (The export
    alone: the compile is the rowwise test's.)"""
    from loka.dispatch.aot import _export, _row_bounds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with torch.no_grad():
        for rows in (8, 1):
            exported = _export(model, (torch.randn(rows, 16),), dynamic_batch=True)
            assert _row_bounds(exported) == (1, None)
            x = torch.randn(5, 16)
            assert torch.allclose(exported.module()(x), model(x), rtol=1e-5, atol=1e-6)
        assert _row_bounds(_export(model, (torch.randn(8, 16),), False)) == (None, None)


class SqueezeHead(nn.Module):
    """One logit per row, squeezed over every size-1 dimension: at one row, a 0-d tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, x):
        return self.lin(x).squeeze()


def test_code_that_computes_otherwise_at_one_row_is_compiled_from_two(tmp_path):
    """The size-oblivious export traces ``squeeze()`` as if the rows were never one, and
    Inductor compiles it so: at one row the first package returns a (1,) tensor where the
    model returns a 0-d one. It is compiled again from two rows; an example of one row is
    refused."""
    torch.manual_seed(0)
    model = SqueezeHead().eval()
    served = loka.aot_compile(model, (torch.randn(8, 16),), tmp_path / "sq.pt2",
                              dynamic_batch=True)
    assert (served.inputs[0].min_rows, served.inputs[0].max_rows) == (2, None)
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.allclose(served(x), model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="input 0 has 1 rows; the package serves at least 2"):
        served(torch.randn(1, 16))
    assert sorted(os.listdir(tmp_path)) == ["sq.pt2"]
    with pytest.raises(ValueError, match="at least 2 rows"):
        loka.aot_compile(model, (torch.randn(1, 16),), tmp_path / "m.pt2", dynamic_batch=True)
    assert sorted(os.listdir(tmp_path)) == ["sq.pt2"]


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x + self.calls


class Doubler(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x + 1


@pytest.mark.parametrize("model, what", [(Counter(), "buffer calls"), (Doubler(), "input x")])
def test_a_forward_that_writes_to_a_buffer_or_an_input_is_refused(tmp_path, model, what):
    """A package would freeze the buffer at its exported value and write into the caller's
    tensor; refused before the model ever runs, so neither changes."""
    x = torch.ones(4, 3)
    with pytest.raises(ValueError, match=f"writes to no buffer or input; this one writes to "
                                         f"{what}"):
        loka.aot_compile(model.eval(), (x,), tmp_path / "m.pt2")
    assert torch.equal(x, torch.ones(4, 3))
    assert all(float(b.sum()) == 0 for b in model.buffers())
    assert os.listdir(tmp_path) == []


def test_compile_refuses_bad_input(tmp_path):
    _, model = planned()
    with pytest.raises(TypeError, match="nn.Module"):
        loka.aot_compile(lambda x: x, inputs(), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="model.eval"):
        loka.aot_compile(Tower().train(), inputs(), tmp_path / "m.pt2")
    model.norm.train()  # dropout or a norm's statistics would run as in training
    with pytest.raises(ValueError, match=r"model.eval\(\) first \(in training mode: norm\)"):
        loka.aot_compile(model, inputs(), tmp_path / "m.pt2")
    model.eval()
    with pytest.raises(ValueError, match="must end in .pt2"):
        loka.aot_compile(model, inputs(), tmp_path / "m.so")
    with pytest.raises(ValueError, match="example_inputs is empty"):
        loka.aot_compile(model, (), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="example input 1 must be a tensor"):
        loka.aot_compile(model, (inputs()[0], 3), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="example input 0 is empty"):
        loka.aot_compile(model, inputs(0), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="does not exist"):
        loka.aot_compile(model, inputs(), tmp_path / "nowhere" / "m.pt2")
    with pytest.raises(ValueError, match="is a folder"):
        loka.aot_compile(model, inputs(), tmp_path)
    with pytest.raises(ValueError, match="batch dimension"):
        loka.aot_compile(model, (torch.tensor(1.0),), tmp_path / "m.pt2", dynamic_batch=True)
    with pytest.raises(TypeError, match=r"pass \(x,\), not x"):
        loka.aot_compile(model, inputs()[0], tmp_path / "m.pt2")
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        loka.aot_compile(model, (inputs()[0], inputs()[1].to("meta")), tmp_path / "m.pt2")
    assert os.listdir(tmp_path) == []


def test_a_failed_compile_leaves_the_old_package_and_no_scraps(tmp_path, monkeypatch):
    _, model = planned()
    path = tmp_path / "m.pt2"
    path.write_bytes(b"the package served yesterday")

    def fail(*a, **k):
        raise RuntimeError("C++ compiler not found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        loka.aot_compile(model, inputs(), path)
    assert path.read_bytes() == b"the package served yesterday"
    assert os.listdir(tmp_path) == ["m.pt2"]


def test_a_package_that_computes_non_finite_values_where_eager_does_not_is_refused(
        package, tmp_path, monkeypatch):
    """... and never reaches the path: the package there before stays, and nothing else."""
    _, model, _, made = package
    path = tmp_path / "m.pt2"
    path.write_bytes(b"the package served yesterday")

    def copy(exported, package_path, inductor_configs):
        with open(made, "rb") as src, open(package_path, "wb") as dst:
            dst.write(src.read())

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", copy)
    monkeypatch.setattr(AOTModel, "__call__",
                        lambda self, *x: torch.full((ROWS,), float("nan")))
    with pytest.raises(ValueError, match="not finite where the eager model's is"):
        loka.aot_compile(model, inputs(), path)
    assert path.read_bytes() == b"the package served yesterday"
    assert os.listdir(tmp_path) == ["m.pt2"]


def test_the_check_pairs_outputs_by_position_numbers_included():
    """A number the model returns comes back from the package as a tensor; the check pairs
    each output with its own, skips the number, and refuses a different count."""
    from loka.dispatch.aot import _compare

    y = torch.tensor([1.0, 2.0, float("nan")])
    check = _compare((torch.tensor(8), y * 1.01), (8, y))
    assert check["rel_err_vs_eager"] == pytest.approx(0.01)
    assert check["max_abs_diff"] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="returns 1 values where the eager model returns 2"):
        _compare((y,), (8, y))
    with pytest.raises(ValueError, match="output 1 is not finite"):
        _compare((torch.tensor(8), torch.full((3,), float("inf"))), (8, y))


def test_the_check_compares_shapes_dtypes_integers_and_numbers():
    from loka.dispatch.aot import _compare

    y = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"output 0 is \(\) torch.float32 where the eager "
                                         r"model's is \(2,\) torch.float32"):
        _compare((torch.tensor(1.0),), (y,))
    with pytest.raises(ValueError, match="output 0 is .* torch.float64 where"):
        _compare((y.double(),), (y,))
    # integers and booleans counted where they differ (a top-k of FP8 values may)
    assert _compare((y, torch.tensor([3, 5]), torch.tensor([True])),
                    (y, torch.tensor([3, 4]), torch.tensor([False])))["unequal_integers"] == 2
    with pytest.raises(ValueError, match="output 0 is 9 where the eager model's is 8"):
        _compare((torch.tensor(9), y), (8, y))
    assert _compare((torch.tensor([3, 4]), None), (torch.tensor([3, 4]), None)) == {
        "rel_err_vs_eager": 0.0, "max_abs_diff": 0.0, "unequal_integers": 0}


def test_input_descriptions_are_validated():
    from loka.dispatch.aot import InputSpec

    good = {"shape": [None, 16], "dtype": "torch.float32", "device": "cpu", "min_rows": 1,
            "max_rows": None}
    assert InputSpec.from_dict(good) == InputSpec((None, 16), "torch.float32", "cpu", 1, None)
    for change, match in [({"shape": "16"}, "shape '16' is not a list of sizes"),
                          ({"shape": [2, -1]}, "not a list of sizes"),
                          ({"shape": [True]}, "not a list of sizes"),
                          ({"dtype": "torch.nonsense"}, "'torch.nonsense' is not a torch dtype"),
                          ({"dtype": "Tensor"}, "is not a torch dtype"),
                          ({"dtype": None}, "None is not a torch dtype"),
                          ({"device": "gpu9"}, "'gpu9' is not a device"),
                          ({"min_rows": "2"}, "not a range of row counts"),
                          ({"min_rows": 5, "max_rows": 3}, "not a range of row counts")]:
        with pytest.raises(ValueError, match=match):
            InputSpec.from_dict({**good, **change})
    with pytest.raises(KeyError):
        InputSpec.from_dict({k: v for k, v in good.items() if k != "device"})
    with pytest.raises(ValueError, match="described by list"):
        InputSpec.from_dict([1])


def _rewritten(made, tmp_path, name, value):
    """A copy of the package ``made`` with its LoKA metadata entry set to ``value``."""
    out = tmp_path / name / made.name
    out.parent.mkdir()
    with zipfile.ZipFile(made) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("_metadata.json"):
                meta = json.loads(data)
                meta[loka.dispatch.aot.METADATA_KEY] = value
                data = json.dumps(meta).encode()
            zout.writestr(info, data)
    return out


def test_a_package_whose_description_is_corrupt_is_refused_in_one_line(package, tmp_path):
    _, _, served, made = package
    spec = served.inputs[0].to_dict()
    assert loka.load_aot(_rewritten(made, tmp_path, "same", json.dumps(
        {"inputs": [i.to_dict() for i in served.inputs], "fp8_sites": ["inp"]}))).fp8_sites == \
        ("inp",)
    for name, value, match in [
            ("empty", json.dumps({"inputs": []}), "it lists no inputs"),
            ("dtype", json.dumps({"inputs": [dict(spec, dtype="torch.nonsense")]}),
             "is not a torch dtype"),
            ("device", json.dumps({"inputs": [dict(spec, device="gpu9")]}), "not a device"),
            ("sites", json.dumps({"inputs": [spec], "fp8_sites": "inp"}),
             "fp8_sites is not a list of names"),
            ("mixed", json.dumps({"inputs": [spec, dict(spec, device="meta")]}),
             "several device types"),
            ("json", "{not json", "Expecting property name")]:
        with pytest.raises(ValueError, match=f"not made by loka.aot_compile .*{match}"):
            loka.load_aot(_rewritten(made, tmp_path, name, value))


def test_loading_what_is_not_a_package_says_so(package, tmp_path):
    _, _, _, made = package
    with pytest.raises(FileNotFoundError, match="no AOTInductor package"):
        loka.load_aot(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not an AOTInductor package"):
        loka.load_aot(junk)
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(made.read_bytes()[: made.stat().st_size // 2])
    with pytest.raises(ValueError, match="not an AOTInductor package|could not be loaded"):
        loka.load_aot(cut)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("other/data.json", "{}")
    with pytest.raises(ValueError, match="could not be loaded"):
        loka.load_aot(other)


def test_a_package_made_without_loka_is_refused(tmp_path):
    """A package torch made directly (no description of its inputs) is not loaded as one of
    LoKA's: its calls could not be checked."""
    with torch.no_grad():
        exported = torch.export.export(nn.Linear(16, 16).eval(), (torch.randn(4, 16),))
    path = torch._inductor.aoti_compile_and_package(exported,
                                                    package_path=str(tmp_path / "plain.pt2"))
    with pytest.raises(ValueError, match="not made by loka.aot_compile"):
        loka.load_aot(path)


def test_the_smoke_script_records_each_stage_and_the_one_that_failed():
    """bench/aot_smoke.py's stages (its GPU run names the stage a crash happened in)."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("aot_smoke", ROOT / "bench" / "aot_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    log = []
    assert smoke.stage(log, "one", lambda: 3) == 3
    with pytest.raises(ZeroDivisionError):
        smoke.stage(log, "two", lambda: 1 / 0)
    assert [(e["stage"], e["ok"]) for e in log] == [("one", True), ("two", False)]
    assert log[1]["error"] == "ZeroDivisionError: division by zero" and log[0]["s"] >= 0
