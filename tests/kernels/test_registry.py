import pytest
import torch

import loka
from loka.config import Role
from loka.kernels import Kernel, available, get, register, unavailable, unregister


def test_core_kernels_registered_and_available_on_cpu():
    names = {k.name for k in available("cpu")}
    for expected in ("bf16", "fp32", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3",
                     "emulated-blockwise-e4m3", "emulated-tensorwise-e5m2", "emulated-mx-e4m3",
                     "emulated-tensorwise-e4m3fnuz", "cublas-tensorwise"):
        assert expected in names


def test_unavailable_kernels_say_why():
    reasons = unavailable("cpu")
    assert "fast accumulation" in reasons["cublas-tensorwise-fastacc"]
    assert "cuda" in reasons["tf32"]


def test_why_a_named_kernel_cannot_run_is_one_answer_for_probe_and_plan():
    from loka.kernels import registry

    assert registry.why_not_runnable("emulated-rowwise-e4m3", "cpu") is None
    assert registry.why_not_runnable("no-such-kernel", "cpu") == registry.NOT_REGISTERED
    assert registry.why_not_runnable("tf32", "cpu") == unavailable("cpu")["tf32"]
    cfg = loka.ProbeConfig(kernels=("bf16", "tf32", "no-such-kernel"))
    from loka.probe.measure import not_runnable
    assert not_runnable(cfg, torch.device("cpu")) == {
        "tf32": unavailable("cpu")["tf32"], "no-such-kernel": registry.NOT_REGISTERED}


@pytest.mark.parametrize("name", ["emulated-tensorwise-e4m3", "cublas-tensorwise",
                                  "emulated-blockwise-e4m3"])
def test_alignment_predicate(name):
    k = get(name)
    assert k.supports("cpu", 64, 256, 256)
    cap = k.supports("cpu", 64, 250, 256)
    assert not cap and "multiples of" in cap.reason
    assert not k.supports("cpu", 0, 256, 256)


def test_shape_rules_hold_whatever_the_device():
    """``fits`` is ``supports`` without the device: a kernel this machine cannot run still
    says which shapes and roles it takes (what a plan made elsewhere is checked against)."""
    k = get("triton-rowwise")  # runs on CUDA only
    assert not k.supports("cpu", 64, 256, 256)
    assert k.fits(64, 256, 256, role="fwd")
    cap = k.fits(64, 250, 256)
    assert not cap and "multiples of" in cap.reason
    assert not k.fits(0, 256, 256)
    e5m2 = get("emulated-tensorwise-e5m2")
    assert not e5m2.fits(64, 64, 64, role="fwd") and e5m2.fits(64, 64, 64, role="dgrad")
    for name in ("emulated-tensorwise-e4m3", "cublas-tensorwise"):  # runnable here: the same
        for shape in ((64, 256, 256), (64, 250, 256), (0, 256, 256)):
            assert bool(get(name).fits(*shape)) == bool(get(name).supports("cpu", *shape))


def test_role_predicate_for_gradient_formats():
    k = get("emulated-tensorwise-e5m2")
    assert not k.supports("cpu", 64, 64, 64, role="fwd")
    assert k.supports("cpu", 64, 64, 64, role=Role.DGRAD)
    assert "emulated-tensorwise-e5m2" not in {x.name for x in available("cpu", role="fwd")}


def test_vendor_and_capability_predicates_on_gpus(monkeypatch):
    from loka.kernels import capabilities as caps
    monkeypatch.setattr(caps, "cuda_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(caps, "is_rocm", lambda: False)
    h200 = torch.device("cuda")
    assert "compute capability >= 10.0" in get("emulated-mx-e4m3").device_ok(h200).reason
    assert "AMD-only" in get("emulated-tensorwise-e4m3fnuz").device_ok(h200).reason
    monkeypatch.setattr(caps, "cuda_capability", lambda d=None: (8, 0))
    assert "8.9" in get("cublas-tensorwise").device_ok(h200).reason
    # CPU emulation of every recipe stays available
    assert get("emulated-mx-e4m3").device_ok("cpu")


def test_register_duplicate_and_unknown():
    k = Kernel("test-dup", lambda a, b, d: a @ b, library="custom")
    register(k)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register(k)
        register(k, override=True)
    finally:
        unregister("test-dup")
    with pytest.raises(KeyError, match="no kernel named"):
        get("test-dup")


def test_gemm_helper_and_shape_errors():
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    torch.testing.assert_close(loka.kernels.gemm("fp32", a, b), a @ b)
    with pytest.raises(ValueError, match="do not match"):
        loka.kernels.gemm("emulated-tensorwise-e4m3", a, torch.randn(16, 16))
    with pytest.raises(TypeError, match="floating point"):
        loka.kernels.gemm("bf16", a, torch.ones(32, 16, dtype=torch.int64), torch.float32)
