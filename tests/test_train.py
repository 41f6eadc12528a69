import os

import pytest
import torch
import torch.nn.functional as F

import loka.models as M
from loka.data import CriteoReader, SyntheticCTR, sample_path
from loka.train import (CHECKPOINT_NAME, TrainResult, evaluate, loss_fn, make_optimizers,
                        train)


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(name="wukong", seed=0, batch=64):
    torch.manual_seed(seed)
    model = M.build(name, "tiny")
    data = SyntheticCTR(model.feature_spec, batch, seed=11)
    return model, data, data.held_out()


def test_loss_fn_is_mean_bce():
    model, data, _ = _setup()
    batch = next(data)
    expected = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
    assert torch.allclose(loss_fn(model, batch), expected)


def test_train_and_evaluate(tmp_path):
    model, data, held = _setup()
    logs = []
    result = train(model, data, 20, lr=3e-3, eval_iter=held, eval_every=10, eval_steps=4,
                   progress=False, log_fn=logs.append)
    assert isinstance(result, TrainResult)
    assert len(result.losses) == 20 and result.steps == 20
    assert [e["step"] for e in result.eval_history] == [10, 20]
    assert set(result.final) >= {"ne", "auc", "logloss"} and result.samples_per_s > 0
    assert any(l["event"] == "eval" for l in logs) and any(l["event"] == "train" for l in logs)
    # the held-out stream is rewound before each evaluation: same batches every time
    again = evaluate(model, (held.batch(i) for i in range(4)), 4)
    assert again["ne"] == pytest.approx(result.final["ne"], rel=1e-12)


@pytest.mark.parametrize("name", ["wukong", "interformer"])
def test_resume_reproduces_the_loss_curve_bit_for_bit(tmp_path, name):
    model, data, held = _setup(name)
    full = train(model, data, 12, lr=3e-3, eval_iter=held, eval_every=4, eval_steps=2,
                 progress=False)

    model, data, held = _setup(name)
    ckpt = str(tmp_path / "ckpt")
    first = train(model, data, 6, lr=3e-3, eval_iter=held, eval_every=4, eval_steps=2,
                  checkpoint_dir=ckpt, checkpoint_every=3, progress=False)
    assert len(first.losses) == 6
    # a fresh process: other weights, other stream object at position 0
    model, data, held = _setup(name, seed=123)
    resumed = train(model, data, 12, lr=3e-3, eval_iter=held, eval_every=4, eval_steps=2,
                    checkpoint_dir=ckpt, checkpoint_every=3, resume=True, progress=False)
    assert resumed.resumed_from == 6
    assert resumed.losses == full.losses  # exact float equality
    assert [e["ne"] for e in resumed.eval_history] == [e["ne"] for e in full.eval_history]
    assert resumed.final["ne"] == full.final["ne"]
    assert not [f for f in os.listdir(ckpt) if f != CHECKPOINT_NAME]  # no temp files left


def test_checkpoint_contents_load_weights_only(tmp_path):
    model, data, _ = _setup()
    train(model, data, 3, checkpoint_dir=str(tmp_path), progress=False)
    state = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    assert state["step"] == 3 and state["data"] == {"seed": 11, "position": 3}
    assert len(state["losses"]) == 3 and "rng_cpu" in state
    # resuming a finished run does nothing more
    again = train(model, data, 3, checkpoint_dir=str(tmp_path), resume=True, progress=False)
    assert again.losses == state["losses"] and again.resumed_from == 3


def test_resume_with_criteo_reader(tmp_path):
    def run(steps, resume):
        torch.manual_seed(0)
        reader = CriteoReader(sample_path(), 16, table_sizes=1000, loop=True)
        model = M.build("dlrm", "tiny", features=reader.feature_spec)
        return train(model, reader, steps, checkpoint_dir=str(tmp_path / "c"),
                     resume=resume, progress=False, seed=0)

    full = run(16, False)
    os.remove(tmp_path / "c" / CHECKPOINT_NAME)
    run(7, False)
    assert run(16, True).losses == full.losses


def test_stateless_iterable_is_replayed(tmp_path):
    model, data, _ = _setup()
    batches = [data.batch(i) for i in range(8)]
    full = train(model, list(batches), 8, progress=False)
    model, _, _ = _setup()
    train(model, list(batches), 4, checkpoint_dir=str(tmp_path), progress=False)
    model, _, _ = _setup(seed=5)
    resumed = train(model, list(batches), 8, checkpoint_dir=str(tmp_path), resume=True,
                    progress=False)
    assert resumed.losses == full.losses


def test_stops_when_data_ends():
    model, data, _ = _setup()
    result = train(model, [data.batch(0), data.batch(1)], 5, progress=False)
    assert result.steps == 2 and len(result.losses) == 2


def test_sparse_tables_get_sparse_adam():
    model = M.build("dlrm", "tiny", sparse_embeddings=True)
    opts = make_optimizers(model, 1e-3, "cpu")
    assert [type(o).__name__ for o in opts] == ["AdamW", "SparseAdam"]
    data = SyntheticCTR(model.feature_spec, 32)
    result = train(model, data, 3, progress=False)
    assert len(result.losses) == 3


def test_errors():
    model, data, _ = _setup()
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train(model, data, 2, resume=True)
    with pytest.raises(ValueError):
        train(model, data, -1)
