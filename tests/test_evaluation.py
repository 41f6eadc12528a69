"""Evaluation done right (issue 28, item 4): an evaluation file is covered exactly once
unless told otherwise, the count of examples seen is reported, the training file is never
called held-out, empty input is a one-line error, a finished run's metrics survive a
--resume, metrics.json is strict JSON, and ``loka evaluate`` scores a checkpoint alone."""

import json
import math

import pytest
import torch

import loka.models as M
from loka import cli
from loka.assembly import AssemblyError, make_streams, parse_data
from loka.data import CriteoReader, SyntheticCTR, criteo_feature_spec, sample_path
from loka.train import EmptyEvaluationError, evaluate, train

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 200  # lines of the shipped sample
DLRM = ["--model", "dlrm", "--preset", "tiny", "--batch-size", "16", "--device", "cpu"]


def _strict_json(path):
    """metrics.json parsed as JSON proper: NaN and Infinity are refused."""
    def refuse(token):
        raise ValueError(f"{path} holds {token}, which JSON has not")
    return json.loads(path.read_text(), parse_constant=refuse)


def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, *needles):
    err = err[err.index("error: "):]
    lines = err.strip().splitlines()
    assert code != 0 and lines[0].startswith("error: ") and len(lines) <= 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    d = tmp_path_factory.mktemp("tsv")
    (d / "empty.tsv").write_text("")
    (d / "blank.tsv").write_text("\n\n")
    lines = open(sample_path()).read().splitlines()
    (d / "eval.tsv").write_text("\n".join(lines[:90]) + "\n")
    return d


# -- the library -----------------------------------------------------------------------
def test_the_criteo_held_out_reader_does_not_loop_and_covers_its_file_once():
    model = M.build("dlrm", "tiny", features=criteo_feature_spec(1000))
    train_stream, held = make_streams(parse_data(f"criteo:{sample_path()},{sample_path()}"),
                                      model, 16, 0, "cpu")
    assert train_stream.loop and not held.loop
    assert sum(b.batch_size for b in held) == ROWS


def test_evaluate_covers_a_finite_stream_once_by_default():
    torch.manual_seed(0)
    reader = CriteoReader(sample_path(), 16, table_sizes=1000)
    model = M.build("dlrm", "tiny", features=reader.feature_spec)
    whole = evaluate(model, reader)
    assert whole["count"] == ROWS
    part = evaluate(model, CriteoReader(sample_path(), 16, table_sizes=1000), 3)
    assert part["count"] == 48


def test_evaluate_refuses_an_infinite_stream_without_a_count_and_empty_input():
    model = M.build("wukong", "tiny")
    with pytest.raises(ValueError, match="infinite"):
        evaluate(model, SyntheticCTR(model.feature_spec, 8))
    with pytest.raises(EmptyEvaluationError, match="no examples"):
        evaluate(model, [])


def test_make_streams_refuses_an_empty_file(tsv):
    model = M.build("dlrm", "tiny", features=criteo_feature_spec(1000))
    for name in ("empty.tsv", "blank.tsv"):
        with pytest.raises(AssemblyError, match="no examples"):
            make_streams(parse_data(f"criteo:{sample_path()},{tsv / name}"), model, 16, 0, "cpu")
        with pytest.raises(AssemblyError, match="no examples"):
            make_streams(parse_data(f"criteo:{tsv / name}"), model, 16, 0, "cpu")


def test_resuming_a_finished_run_keeps_its_final_evaluation(tmp_path):
    def run(resume):
        torch.manual_seed(0)
        model = M.build("wukong", "tiny")
        data = SyntheticCTR(model.feature_spec, 16, seed=3)
        return train(model, data, 3, eval_iter=data.held_out(), eval_steps=2,
                     checkpoint_dir=str(tmp_path), resume=resume, progress=False)

    first = run(False)
    again = run(True)
    assert again.resumed_from == 3 and again.steps == 3
    assert again.final["ne"] == first.final["ne"] and again.final["count"] == 32
    assert all(math.isfinite(v) for v in again.final.values())


# -- the command line ------------------------------------------------------------------
def test_train_covers_the_evaluation_file_exactly_once_by_default(tsv, tmp_path, capsys):
    out = tmp_path / "run"
    code, text, err = _run(["train", *DLRM, "--steps", "2", "--out", str(out),
                            "--data", f"criteo:{sample_path()},{tsv / 'eval.tsv'}"], capsys)
    assert code == 0, err
    final = _strict_json(out / "metrics.json")["final"]
    assert final["count"] == 90
    assert "held-out NE" in text and "90 examples" in text and "the whole file" in text


def test_a_partial_evaluation_says_so(tsv, tmp_path, capsys):
    out = tmp_path / "run"
    code, text, err = _run(["train", *DLRM, "--steps", "2", "--out", str(out), "--eval-steps",
                            "2", "--data", f"criteo:{sample_path()},{tsv / 'eval.tsv'}"], capsys)
    assert code == 0, err
    assert _strict_json(out / "metrics.json")["final"]["count"] == 32
    assert "32 examples" in text and "part of" in text and "--eval-steps" in text


def test_without_an_evaluation_file_the_training_file_is_not_called_held_out(tmp_path, capsys):
    out = tmp_path / "run"
    code, text, err = _run(["train", *DLRM, "--steps", "2", "--out", str(out),
                            "--data", "criteo:sample"], capsys)
    assert code == 0, err
    assert "held-out" not in text and "training file" in text
    metrics = _strict_json(out / "metrics.json")
    assert metrics["final"]["count"] == ROWS and metrics["eval_data"]["held_out"] is False


@pytest.mark.parametrize("name", ["empty.tsv", "blank.tsv"])
def test_an_empty_evaluation_or_training_file_is_a_one_line_error(name, tsv, tmp_path, capsys):
    for data in (f"criteo:{sample_path()},{tsv / name}", f"criteo:{tsv / name}"):
        code, _, err = _run(["train", *DLRM, "--steps", "2", "--out", str(tmp_path / "r"),
                             "--data", data], capsys)
        _one_line_error(code, err, "no examples", name)
        assert not (tmp_path / "r" / "checkpoint.pt").exists()


def test_resume_of_a_finished_run_keeps_its_metrics_and_steps_0_is_strict_json(tmp_path,
                                                                               capsys):
    out = tmp_path / "run"
    base = ["train", "--preset", "tiny", "--batch-size", "16", "--eval-steps", "2",
            "--out", str(out), "--device", "cpu", "--steps", "3"]
    assert _run(base, capsys)[0] == 0
    first = _strict_json(out / "metrics.json")
    code, text, err = _run(base + ["--resume"], capsys)
    assert code == 0, err
    second = _strict_json(out / "metrics.json")
    assert second["final"] == first["final"] and math.isfinite(second["final"]["ne"])
    assert "already" in err
    zero = tmp_path / "zero"
    assert _run(["train", "--preset", "tiny", "--batch-size", "16", "--eval-steps", "2",
                 "--out", str(zero), "--device", "cpu", "--steps", "0"], capsys)[0] == 0
    _strict_json(zero / "metrics.json")


def test_evaluate_scores_a_checkpoint_on_a_file_once(tsv, tmp_path, capsys):
    out = tmp_path / "run"
    data = f"criteo:{sample_path()},{tsv / 'eval.tsv'}"
    assert _run(["train", *DLRM, "--steps", "2", "--out", str(out), "--data", data],
                capsys)[0] == 0
    final = _strict_json(out / "metrics.json")["final"]
    result = tmp_path / "eval.json"
    code, text, err = _run(["evaluate", "--checkpoint", str(out / "checkpoint.pt"), *DLRM,
                            "--data", data, "-o", str(result)], capsys)
    assert code == 0, err
    scored = _strict_json(result)
    assert scored["metrics"]["count"] == 90 and scored["eval_data"]["held_out"] is True
    assert abs(scored["metrics"]["ne"] - final["ne"]) <= 1e-12 * abs(final["ne"])
    assert "90 examples" in text
    code, _, err = _run(["evaluate", "--checkpoint", str(out / "checkpoint.pt"), *DLRM,
                         "--data", f"criteo:{sample_path()},{tsv / 'empty.tsv'}"], capsys)
    _one_line_error(code, err, "no examples")
    code, _, err = _run(["evaluate", "--checkpoint", str(tmp_path / "none.pt"), *DLRM,
                         "--data", data], capsys)
    _one_line_error(code, err, "no such file")
