import pytest
import torch
import torch.nn as nn

import loka.models as M
from loka.config import ModsConfig
from loka.data import Batch, FeatureSpec, SyntheticCTR, criteo_feature_spec

MODELS = M.list_models()


def _batch(model, batch_size=32, seed=0):
    return next(SyntheticCTR(model.feature_spec, batch_size, seed=seed))


def test_registry():
    assert set(MODELS) >= {"wukong", "dcnv2", "interformer", "dlrm", "logreg"}
    for name in MODELS:
        assert set(M.presets(name)) == {"tiny", "small", "paper"}
    with pytest.raises(ValueError, match="valid models"):
        M.build("nope")
    with pytest.raises(ValueError, match="valid presets"):
        M.build("wukong", "huge")
    with pytest.raises(ValueError, match="valid fields"):
        M.build("wukong", "tiny", not_a_field=3)
    with pytest.raises(TypeError):
        M.build("wukong", "tiny", mods={"no_bias": True})


@pytest.mark.parametrize("mods", [None, ModsConfig.paper()], ids=["plain", "mods"])
@pytest.mark.parametrize("name", MODELS)
def test_tiny_forward_backward(name, mods):
    torch.manual_seed(0)
    model = M.build(name, "tiny", mods)
    assert isinstance(model.default_batch_size, int)
    spec = model.feature_spec
    assert isinstance(spec, FeatureSpec) and all(len(t) == 3 for t in spec.tables)
    batch = _batch(model)
    logits = model(batch)
    assert logits.shape == (32,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", MODELS)
def test_logit_prior(name):
    model = M.build(name, "tiny")
    with torch.no_grad():
        p = torch.sigmoid(model(_batch(model, 256))).mean().item()
    assert 0.001 < p < 0.3  # starts near the 3% prior, not at 0.5


@pytest.mark.parametrize("name", MODELS)
def test_bf16_model(name):
    model = M.build(name, "tiny").to(torch.bfloat16)
    out = model(_batch(model))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("preset", ["small", "paper"])
@pytest.mark.parametrize("name", MODELS)
def test_presets_build_on_meta(name, preset):
    with torch.device("meta"):
        model = M.build(name, preset)
    assert all(p.is_meta for p in model.parameters())
    assert model.default_batch_size >= 256


WUKONG_PAPER_LINEARS = (
    [(64, 32), (2048, 2048), (2048, 8192), (64, 32)] * 4  # per layer: FMB proj, FM MLP x2, LCB
    + [(16384, 2048), (2048, 1024), (1024, 1)]            # top MLP
)


def test_wukong_paper_is_the_reference_config():
    with torch.device("meta"):
        model = M.build("wukong", "paper")
    c = model.config
    assert (c.num_embeddings, c.embedding_dim, c.num_fm, c.num_lcb, c.fm_rank, c.fm_hidden,
            c.num_layers, c.top_hidden, model.default_batch_size) == \
        (64, 256, 32, 32, 32, 2048, 4, (2048, 1024), 4096)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 19
    assert [(m.in_features, m.out_features) for m in linears] == WUKONG_PAPER_LINEARS
    # the GEMM shapes of ANCHORS.md at batch 4096 (M = B, or B * d over the n axis)
    b, d = 4096, 256
    gemms = {(b * d if m.in_features == 64 else b, m.in_features, m.out_features) for m in linears}
    assert {(4096, 2048, 2048), (4096, 2048, 8192), (4096, 16384, 2048), (4096, 2048, 1024),
            (1048576, 64, 32)} <= gemms
    assert all(t.num_embeddings == 100_000 for t in model.feature_spec.tables)


def test_wukong_shapes_through_layers():
    model = M.build("wukong", "tiny", num_fm=3, num_lcb=2)
    batch = _batch(model, 8)
    x = model.embed(batch)
    assert x.shape == (8, 8, 16)
    x = model.layers[0](x)
    assert x.shape == (8, 5, 16)
    assert model.layers[1].fmb(x).shape == (8, 3, 16)
    assert model.layers[1].lcb(x).shape == (8, 2, 16)
    assert model.layers[1](x).shape == (8, 5, 16)
    assert model(batch).shape == (8,)


def test_dcnv2_variants():
    for structure, rank in (("stacked", None), ("parallel", 8)):
        model = M.build("dcnv2", "tiny", structure=structure, cross_rank=rank)
        assert model(_batch(model)).shape == (32,)
    with pytest.raises(ValueError):
        M.build("dcnv2", "tiny", structure="diagonal")


def test_interformer_sequence_longer_than_seq_len_is_cut():
    model = M.build("interformer", "tiny", seq_len=2)
    assert model(_batch(model)).shape == (32,)
    with pytest.raises(ValueError, match="history"):
        M.build("interformer", "tiny", seq_table="missing")


def test_models_on_criteo_features():
    spec = criteo_feature_spec(1000)
    for name in ("dlrm", "dcnv2", "wukong", "logreg"):
        model = M.build(name, "tiny", features=spec)
        assert model(_batch(model, 16)).shape == (16,)


def test_missing_feature_is_a_clear_error():
    model = M.build("dlrm", "tiny")
    batch = _batch(model)
    partial = Batch(batch.dense, {k: v for k, v in list(batch.sparse.items())[:1]}, batch.labels)
    with pytest.raises(ValueError, match="lacks sparse features"):
        model(partial)


@pytest.mark.parametrize("name", ["wukong", "interformer"])
def test_compile_has_no_graph_breaks(name):
    model = M.build(name, "tiny")
    batch = _batch(model, 16)
    explanation = torch._dynamo.explain(model)(batch)
    assert explanation.graph_break_count == 0, explanation.break_reasons
