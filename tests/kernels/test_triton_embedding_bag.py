"""The Triton pooled-embedding kernel (``loka.kernels.triton.embedding_bag``) against a
float64 reference, and the custom op around it (autograd, fake implementation, the fused
embedding arch's ``pooling="triton"``). On a CUDA GPU the kernels are compiled; elsewhere
the tests run under Triton's CPU interpreter in a subprocess (see test_under_interpreter)."""

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from loka.kernels import capabilities as caps  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU = not INTERPRETED and caps.triton_available("cuda")
DEVICE = "cuda" if GPU else "cpu"


def test_under_interpreter(run_under_interpreter):
    if GPU or INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_under_interpreter(__file__, "not test_under_interpreter", min_passed=10)


@pytest.fixture(scope="module")
def E():
    if not (GPU or INTERPRETED):
        pytest.skip("needs a GPU, or Triton's interpreter (see test_under_interpreter)")
    return importlib.import_module("loka.kernels.triton.embedding_bag")


def bags(lengths, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return values.to(DEVICE), offsets.to(DEVICE)


@pytest.mark.parametrize("d, dtype, lengths", [
    (256, torch.bfloat16, [1, 2, 4, 8, 3, 0, 17, 5]),  # an empty bag, a bag longer than a tile
    (200, torch.float32, [3] * 9),                      # D not a power of two: masked lanes
    (600, torch.bfloat16, [2, 7, 1]),                   # several feature spans per bag
    (16, torch.float16, [33, 1]),
])
def test_bag_sums_match_float64(E, d, dtype, lengths):
    g = torch.Generator().manual_seed(d)
    weight = (torch.randn(50, d, generator=g) * 3).to(dtype).to(DEVICE)
    values, offsets = bags(lengths, 50, seed=d)
    out = E.embedding_bag_sum(values, offsets, weight)
    ref = E.reference_embedding_bag_sum(values, offsets, weight)
    assert out.shape == (len(lengths), d) and out.dtype == dtype
    # float32 accumulation, one rounding to the weight's dtype at the end
    eps = torch.finfo(dtype).eps
    err = (out.double() - ref).abs()
    assert (err <= eps * ref.abs() + 1e-5).all(), err.max()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    assert (out[empty] == 0).all()


def test_int32_ids_strided_weight_and_no_bags(E):
    base = torch.randn(30, 128).to(DEVICE)
    weight = base[::2]  # rows two apart: a row stride of 256
    values, offsets = bags([4, 1, 6], 15, seed=3)
    out = E.embedding_bag_sum(values.int(), offsets.int(), weight)
    torch.testing.assert_close(out.double(), E.reference_embedding_bag_sum(values, offsets, weight),
                               rtol=1e-6, atol=1e-5)
    none = E.embedding_bag_sum(values[:0], offsets[:1], weight)
    assert none.shape == (0, 128)


def test_bad_arguments_are_refused(E):
    values, offsets = bags([2, 2], 10)
    weight = torch.randn(10, 32).to(DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        E.embedding_bag_sum(values, offsets, weight[0])
    with pytest.raises(ValueError, match="integer ids"):
        E.embedding_bag_sum(values.float(), offsets, weight)
    with pytest.raises(ValueError, match="floating point"):
        E.embedding_bag_sum(values, offsets, weight.long())
    with pytest.raises(ValueError, match=r"\(bags \+ 1,\)"):
        E.embedding_bag_sum(values, offsets[:0], weight)


def test_op_gradient_matches_embedding_bag(E):
    from loka.models.fused_embedding import embedding_bag_sum

    values, offsets = bags([3, 0, 5, 1, 2], 12, seed=5)
    weight = torch.randn(12, 64, dtype=torch.float64).to(DEVICE)
    w1 = weight.clone().requires_grad_()
    w2 = weight.clone().requires_grad_()
    up = torch.randn(5, 64, dtype=torch.float64).to(DEVICE)
    (embedding_bag_sum(values, offsets, w1) * up).sum().backward()
    ref = torch.nn.functional.embedding_bag(values, w2, offsets, mode="sum",
                                            include_last_offset=True)
    (ref * up).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-12, atol=1e-12)


def test_op_passes_opcheck(E):
    from loka.models.fused_embedding import embedding_bag_sum

    values, offsets = bags([2, 4, 1], 20, seed=9)
    weight = torch.randn(20, 32).to(DEVICE).requires_grad_()
    torch.library.opcheck(embedding_bag_sum.register(), (values, offsets, weight))


def test_fused_arch_with_triton_pooling_matches_torch_pooling(E, monkeypatch):
    from loka.data.batch import Jagged
    from loka.models.arch import EmbeddingArch
    from loka.models.fused_embedding import FusedEmbeddingArch
    from loka.models.presets import feature_spec

    spec = feature_spec(0, 3, 40, (1, 2, 4))
    arch = EmbeddingArch(spec.tables, 32).to(DEVICE)
    ref, tri = FusedEmbeddingArch(arch), FusedEmbeddingArch(arch, pooling="triton")
    sparse = {}
    for i, t in enumerate(spec.tables):
        values, offsets = bags([1 + (b * (i + 1)) % 5 for b in range(6)], t.num_embeddings,
                               seed=i)
        sparse[t.name] = Jagged(values, offsets)
    calls = []
    real = E.embedding_bag_sum
    monkeypatch.setattr(E, "embedding_bag_sum", lambda *a: calls.append(1) or real(*a))
    out_ref = ref(sparse)
    assert calls == []  # torch pooling
    out_tri = tri(sparse)
    assert calls == [1]  # one kernel call for all three tables
    assert out_tri.shape == (6, 3, 32)
    torch.testing.assert_close(out_tri, out_ref, rtol=1e-6, atol=1e-6)
    out_tri.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(tri.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert "pooling=triton" in repr(tri)
    with pytest.raises(ValueError, match="pooling must be"):
        FusedEmbeddingArch(arch, pooling="tbe")


def test_op_compiles_in_one_graph_with_its_backward(E):
    """Dynamo and AOTAutograd take the op as one node, forward and backward
    (``fullgraph=True``: a graph break fails), and give the eager numbers."""
    from loka.models.fused_embedding import embedding_bag_sum

    values, offsets = bags([3, 1, 4, 0, 2], 16, seed=11)
    weight = torch.randn(16, 32).to(DEVICE)

    def f(w):
        return embedding_bag_sum(values, offsets, w).square().sum()
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(w1).backward()
    f(w2).backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-6, atol=1e-6)


def test_fused_arch_with_triton_pooling_compiles_without_graph_breaks(E, monkeypatch):
    """The availability check of ``pooling="triton"`` is a constant to Dynamo: the whole
    arch compiles as one graph (tracing the import probe behind it would break it), calls
    the op, and gives the eager numbers, forward and backward."""
    from loka.data.batch import Jagged
    from loka.models.arch import EmbeddingArch
    from loka.models.fused_embedding import FusedEmbeddingArch
    from loka.models.presets import feature_spec

    spec = feature_spec(0, 2, 30, (1, 3))
    arch = EmbeddingArch(spec.tables, 16).to(DEVICE)
    sparse = {}
    for i, t in enumerate(spec.tables):
        values, offsets = bags([1 + (b * (i + 2)) % 4 for b in range(5)], t.num_embeddings,
                               seed=20 + i)
        sparse[t.name] = Jagged(values, offsets)
    eager, comp = FusedEmbeddingArch(arch, pooling="triton"), FusedEmbeddingArch(arch, pooling="triton")
    calls = []
    real = E.embedding_bag_sum
    monkeypatch.setattr(E, "embedding_bag_sum", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    out = torch.compile(comp, fullgraph=True, backend="aot_eager")(sparse)
    assert calls == [1]  # the Triton op ran inside the compiled graph
    ref = eager(sparse)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(comp.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)
