import pytest
import torch

from loka.mods import BlockNorm


def reference(x: torch.Tensor, block: int, eps: float) -> torch.Tensor:
    """float64 BlockNorm, one block at a time (the last block may be shorter)."""
    x = x.double()
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        out[..., start:start + block] = blk / torch.sqrt(blk.pow(2).mean(-1, keepdim=True) + eps)
    return out


@pytest.mark.parametrize("dim,block", [(512, 256), (256, 256), (300, 256), (100, 256),
                                       (7, 3), (64, 16), (1, 4)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                       (torch.bfloat16, 1e-2)])
def test_matches_float64_reference(dim, block, dtype, tol):
    g = torch.Generator().manual_seed(dim * block)
    x = (torch.randn(3, 5, dim, generator=g) * 3 + 0.5).to(dtype)
    y = BlockNorm(block)(x)
    assert y.dtype == dtype and y.shape == x.shape
    ref = reference(x, block, 1e-6)
    # a bf16 result carries bf16 rounding (rel. 2**-8) of the output only: the math is fp32
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol), (y.double() - ref).abs().max()


def test_bf16_computed_in_float32():
    x = torch.randn(4, 512, dtype=torch.bfloat16) * 100
    y = BlockNorm(256)(x)
    ref = reference(x.float(), 256, 1e-6).to(torch.bfloat16)  # round the exact result once
    assert torch.equal(y, ref)


def test_last_short_block_normalized_on_its_own():
    x = torch.ones(1, 260)
    x[..., 256:] = 10.0  # a 4-feature tail of large values
    y = BlockNorm(256)(x)
    assert torch.allclose(y, torch.ones_like(y), atol=1e-5)


def test_rms_of_each_block_is_one():
    y = BlockNorm(64)(torch.randn(8, 256) * 50).double()
    assert torch.allclose(y.view(8, 4, 64).pow(2).mean(-1), torch.ones(8, 4, dtype=torch.float64),
                          atol=1e-5)


def test_parameter_free_and_errors():
    assert list(BlockNorm(256).parameters()) == []
    with pytest.raises(ValueError):
        BlockNorm(0)
    with pytest.raises(ValueError):
        BlockNorm(16, eps=0.0)
    with pytest.raises(TypeError):
        BlockNorm(4)(torch.ones(2, 8, dtype=torch.int64))


def test_backward_and_meta():
    x = torch.randn(2, 300, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: BlockNorm(128)(t), (x,))
    y = BlockNorm(256)(torch.empty(2, 300, device="meta"))
    assert y.shape == (2, 300) and y.device.type == "meta"
