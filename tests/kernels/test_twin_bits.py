"""Kernels registered with ``same_bits_as`` (LoKA's Triton quantizers before cuBLAS's GEMM)
give their twin's output bit for bit on the operands the Probe samples, in each role's
layout: the Probe then samples only the twin's errors (``ProbeConfig.twin_errors``). Needs
an FP8 GPU (the cuBLAS GEMM has no CPU path); skipped elsewhere."""

import pytest
import torch

from loka.config import Role
from loka.kernels import capabilities as caps
from loka.kernels import registry
from loka.probe.sampler import naive_pair

GPU = caps.triton_available("cuda") and (caps.cuda_capability("cuda") or (0, 0)) >= (8, 9)
TWINS = sorted((k.name, k.same_bits_as) for k in registry.all_kernels() if k.same_bits_as)
# (rows, in_features, out_features): a narrow projection, a square layer, a wide MLP layer
SHAPES = [(1024, 64, 32), (2048, 256, 512), (4096, 2048, 1024)]


def test_the_registered_twins_are_the_triton_quantized_cublas_kernels():
    assert TWINS == [("triton-rowwise-cublas", "cublas-rowwise"),
                     ("triton-rowwise-cublas-fastacc", "cublas-rowwise-fastacc"),
                     ("triton-tensorwise-cublas", "cublas-tensorwise"),
                     ("triton-tensorwise-cublas-fastacc", "cublas-tensorwise-fastacc")]
    for name, twin in TWINS:
        a, b = registry.get(name), registry.get(twin)
        assert (a.formats, a.scaling, a.fast_accum) == (b.formats, b.scaling, b.fast_accum)


@pytest.mark.skipif(not GPU, reason="needs an FP8 GPU with Triton")
@pytest.mark.parametrize("name, twin", TWINS)
@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("shape", SHAPES)
def test_same_bits_as_its_twin_in_every_role(name, twin, role, shape):
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    a, b = naive_pair(role, *shape, "cuda", torch.bfloat16, gen)
    # heavy tails: a row 1000x larger, one of zeros, an outlier
    a = a.clone()
    a[1] *= 1000
    a[2] = 0
    a[3, 5] = 448 * 64
    kern, ref = registry.get(name), registry.get(twin)
    if not (kern.supports("cuda", *a.shape, b.shape[1], role=role)
            and ref.supports("cuda", *a.shape, b.shape[1], role=role)):
        pytest.skip(f"{role.value} {tuple(a.shape)}x{tuple(b.shape)} not supported")
    got, want = kern(a, b, torch.bfloat16), ref(a, b, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
