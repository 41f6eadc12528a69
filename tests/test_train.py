import copy
import math
import os
import signal
import stat
import struct
import subprocess
import sys
import time
import zipfile

import pytest
import torch
import torch.nn.functional as F

import loka
import loka.models as M
from loka.config import LinearConfig, Role
from loka.data import CriteoReader, SyntheticCTR, sample_path
from loka.dispatch import Plan
from loka.kernels import Kernel, register, unregister
from loka.kernels import get as get_kernel
from loka.train import (CHECKPOINT_NAME, CheckpointError, PlanChangedError, RunExistsError,
                        RunInUseError, RunLock, TrainResult, evaluate, loss_fn, make_optimizers,
                        remove_stale_temp_files, train)


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


# -- checkpoints that are empty, foreign or damaged; the run directory ------------------
def _checkpointed(tmp_path, steps=3):
    model, data, _ = _setup()
    train(model, data, steps, checkpoint_dir=str(tmp_path), progress=False)
    return tmp_path / CHECKPOINT_NAME


def _resume(tmp_path, steps=5):
    model, data, _ = _setup(seed=7)
    return train(model, data, steps, checkpoint_dir=str(tmp_path), resume=True,
                 progress=False)


def test_zero_byte_checkpoint_is_refused_naming_the_file(tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty") as info:
        _resume(tmp_path)
    assert str(tmp_path / CHECKPOINT_NAME) in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_of_another_structure_is_refused_naming_the_file(tmp_path):
    torch.save({"model": {}}, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError, match="'optimizers'") as info:
        _resume(tmp_path)
    assert str(tmp_path / CHECKPOINT_NAME) in str(info.value)
    torch.save([1, 2, 3], tmp_path / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError, match="not a LoKA checkpoint"):
        _resume(tmp_path)


def test_one_flipped_byte_in_a_stored_tensor_is_caught_by_the_checksum(tmp_path):
    path = _checkpointed(tmp_path)
    with zipfile.ZipFile(path) as z:  # torch.save writes a zip: find a stored tensor's bytes
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum") as info:
        _resume(tmp_path)
    assert str(path) in str(info.value)
    # still a plain torch checkpoint: weights_only loading works, and the checksum is in it
    assert torch.load(path, weights_only=True)["checksum"].startswith("sha256:")


def test_a_second_run_into_a_directory_with_a_checkpoint_refuses_without_resume(tmp_path):
    path = _checkpointed(tmp_path)
    before = path.read_bytes()
    model, data, _ = _setup()
    with pytest.raises(RunExistsError, match="resume"):
        train(model, data, 3, checkpoint_dir=str(tmp_path), progress=False)
    assert path.read_bytes() == before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_run_directory_is_locked_and_a_dead_holders_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from loka.train import RunLock\n"
         "with RunLock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        model, data, _ = _setup()
        with pytest.raises(RunInUseError, match=f"pid {holder.pid}") as info:
            train(model, data, 2, checkpoint_dir=str(tmp_path), progress=False)
        assert str(tmp_path) in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / CHECKPOINT_NAME).exists()
    # the holder died: its lock file stays, with its pid, and the next run takes it over
    dead = _dead_pid()
    (tmp_path / RunLock.NAME).write_text(f"{dead}\n")
    notes = []
    result = train(model, data, 2, checkpoint_dir=str(tmp_path), progress=False,
                   log_fn=lambda e: notes.append(e["message"]) if e["event"] == "note" else None)
    assert result.steps == 2
    assert any(f"pid {dead}" in n and "took over" in n for n in notes), notes
    assert any(f"pid {dead}" in n for n in result.notes)
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT_NAME]  # the lock is gone with its run


_KILL_DURING_WRITE = """
import os, sys, time, torch
import loka.models as M
from loka.data import SyntheticCTR
from loka.train import train
out, marker, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
real_save = torch.save
def stalled_save(obj, f, *a, **k):  # the payload is written, then the process is killed
    real_save(obj, f, *a, **k)
    f.flush()
    open(marker, "w").close()
    time.sleep(60)
torch.save = stalled_save
torch.manual_seed(0)
model = M.build("wukong", "tiny")
train(model, SyntheticCTR(model.feature_spec, 16, seed=1), 4, checkpoint_dir=out,
      checkpoint_every=1, resume=resume, progress=False)
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_leaves_at_most_one_temp_file_and_resume_cleans_it(
        tmp_path):
    out = tmp_path / "run"
    for i in range(2):
        marker = tmp_path / f"writing-{i}"
        child = subprocess.Popen([sys.executable, "-c", _KILL_DURING_WRITE, str(out),
                                  str(marker), "1" if i else "0"])
        try:
            deadline = time.monotonic() + 120
            while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker.exists(), "the child never reached its checkpoint write"
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
    temps = [f for f in os.listdir(out) if f.endswith(".tmp")]
    assert len(temps) <= 1, temps
    model, data, _ = _setup()
    result = train(model, data, 3, checkpoint_dir=str(out), resume=True, progress=False)
    assert result.steps == 3
    assert sorted(os.listdir(out)) == [CHECKPOINT_NAME]


def test_stale_temp_files_of_the_run_are_removed_on_start_and_nothing_else(tmp_path):
    for name in (".ckpt-abc123.tmp", ".ckpt-x9.tmp", ".tmp-k2jmetrics.json"):
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / "notes.tmp").write_text("the user's")
    assert sorted(remove_stale_temp_files(str(tmp_path))) == [".ckpt-abc123.tmp", ".ckpt-x9.tmp",
                                                             ".tmp-k2jmetrics.json"]
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp"]


def test_checkpoints_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        path = _checkpointed(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


# -- training with a plan: the Guard, and the plan recorded in the checkpoint -----------
FAULTY = "t-train-faulty"
FP8 = "emulated-rowwise-e4m3"


@pytest.fixture
def faulty_kernel():
    """An FP8 kernel whose output is Inf from a finite input: the Guard must switch it."""
    base = get_kernel(FP8)

    def inf_out(a, b, out_dtype):
        y = base(a, b, out_dtype).clone()
        y[0] = float("inf")
        return y

    register(Kernel(FAULTY, inf_out, library="custom", scaling="rowwise",
                    formats=("e4m3", "e4m3"), quantize_a=base.quantize_a,
                    quantize_b=base.quantize_b), override=True)
    yield FAULTY
    unregister(FAULTY)


def _plan_for(model, site_kernels=None):
    plan = Plan.uniform(model, FP8, device="cpu")
    for site, kernel in (site_kernels or {}).items():
        plan.sites[site].roles[Role.FWD].kernel = kernel
    return plan


def test_training_with_a_plan_arms_the_guard(tmp_path, faulty_kernel):
    model, data, held = _setup()
    site = "over_arch.mlp.0"
    plan = _plan_for(model, {site: FAULTY})
    result = train(model, data, 6, plan=plan, guard_every=2, checkpoint_dir=str(tmp_path),
                   eval_iter=held, eval_steps=2, progress=False)
    assert [e.site for e in result.guard_events] == [site]
    assert result.skipped_steps == [1]  # the first step is checked: its update is skipped
    assert [f.site for f in result.plan.fallbacks] == [site]
    assert plan.fallbacks == []  # the caller's plan is not changed
    assert math.isfinite(result.final["ne"]) and all(math.isfinite(l) for l in result.losses[1:])
    assert isinstance(model.over_arch.mlp[2], loka.Linear)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_fp8_run_resumes_with_its_recorded_plan_bit_for_bit(tmp_path):
    model, data, _ = _setup()
    full = train(model, data, 6, plan=_plan_for(model), progress=False)

    model, data, _ = _setup()
    train(model, data, 3, plan=_plan_for(model), checkpoint_dir=str(tmp_path), progress=False)
    model, data, _ = _setup(seed=5)  # a fresh process: no plan given, none applied
    notes = []
    resumed = train(model, data, 6, checkpoint_dir=str(tmp_path), resume=True, progress=False,
                    log_fn=lambda e: notes.append(e["message"]) if e["event"] == "note" else None)
    assert isinstance(model.over_arch.mlp[0], loka.Linear)
    assert model.over_arch.mlp[0].config == LinearConfig.uniform(FP8)
    assert any("recorded in the checkpoint" in n for n in notes)
    assert resumed.losses == full.losses


def test_resuming_with_another_plan_is_refused(tmp_path):
    model, data, _ = _setup()
    train(model, data, 2, plan=_plan_for(model), checkpoint_dir=str(tmp_path), progress=False)
    model, data, _ = _setup()
    other = Plan.uniform(model, "emulated-tensorwise-e4m3", device="cpu")
    with pytest.raises(PlanChangedError, match="another plan"):
        train(model, data, 4, plan=other, checkpoint_dir=str(tmp_path), resume=True,
              progress=False)


def test_the_fallbacks_of_a_run_survive_its_resume(tmp_path, faulty_kernel):
    model, data, _ = _setup()
    site = "over_arch.mlp.0"
    first = train(model, data, 3, plan=_plan_for(model, {site: FAULTY}), guard_every=1,
                  checkpoint_dir=str(tmp_path), progress=False)
    assert [e.site for e in first.guard_events] == [site]
    model, data, _ = _setup()
    resumed = train(model, data, 5, checkpoint_dir=str(tmp_path), resume=True, progress=False)
    assert resumed.guard_events == [] and [f.site for f in resumed.plan.fallbacks] == [site]
    assert not isinstance(model.over_arch.mlp[0], loka.Linear)  # on the baseline: plain again
    assert model.over_arch.mlp[2].config == LinearConfig.uniform(FP8)


def _lr_per_step(monkeypatch, **kw):
    """``(result, the learning rate of each AdamW step)`` of the tiny Wukong trained 6 steps
    at lr 1e-2 with ``train``'s options ``kw``, read from inside the optimizer."""
    seen, orig = [], torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return orig(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", spy)
        model, data, _ = _setup()
        result = train(model, data, 6, lr=1e-2, progress=False, **kw)
    return result, seen


def test_warmup_scales_each_steps_learning_rate_and_then_holds_it(monkeypatch):
    """With ``warmup_steps=4`` step k (1-based) updates at ``lr * min(1, k / 4)``: recorded
    from inside the optimizer, and a run with warm-up differs from one without."""
    warm, seen = _lr_per_step(monkeypatch, warmup_steps=4)
    assert seen == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2], rel=1e-12)
    model, data, _ = _setup()
    cold = train(model, data, 6, lr=1e-2, progress=False)
    assert warm.losses[0] == cold.losses[0] and warm.losses[1] != cold.losses[1]


def test_a_run_resumed_mid_warmup_follows_the_schedule_it_is_resumed_with(tmp_path,
                                                                          monkeypatch):
    """Resumed at step 2 of a 4-step warm-up: with the same warm-up the rates go on
    rising; without one every later step is at the full rate, not at the checkpoint's."""
    for warm, want in ((4, [7.5e-3, 1e-2, 1e-2, 1e-2]), (0, [1e-2] * 4)):
        run = tmp_path / f"w{warm}"
        model, data, _ = _setup()
        train(model, data, 2, lr=1e-2, warmup_steps=4, checkpoint_dir=str(run), progress=False)
        _, got = _lr_per_step(monkeypatch, warmup_steps=warm, checkpoint_dir=str(run),
                              resume=True)
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_warmup_is_refused(bad):
    model, data, _ = _setup()
    with pytest.raises(ValueError, match="warmup_steps"):
        train(model, data, 2, warmup_steps=bad, progress=False)


def test_optimizer_state_continues_a_run_exactly(tmp_path):
    """Weights and optimizer states of a run's checkpoint at step 3, given to a fresh run
    of 3 steps on the batches that followed, reproduce the uninterrupted run's losses and
    weights exactly; the same weights with fresh optimizers do not."""
    from loka.train.checkpoint import read_checkpoint
    model, data, _ = _setup()
    full = train(model, data, 6, lr=3e-3, progress=False)
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    model, data, _ = _setup()
    train(model, data, 3, lr=3e-3, checkpoint_dir=str(tmp_path), progress=False)
    ckpt = read_checkpoint(str(tmp_path / CHECKPOINT_NAME))
    rest = SyntheticCTR(model.feature_spec, 64, seed=11)
    batches = [rest.batch(i) for i in range(3, 6)]

    def fresh():
        torch.manual_seed(7)
        m = M.build("wukong", "tiny")
        m.load_state_dict(ckpt["model"])
        return m

    m = fresh()
    given = copy.deepcopy(ckpt["optimizers"])
    cont = train(m, iter(batches), 3, lr=3e-3, progress=False, optimizer_state=ckpt["optimizers"],
                 seed=0)
    # the states given are left as they were: the next run from them starts alike
    for a, b in zip(given[0]["state"].values(), ckpt["optimizers"][0]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert cont.losses == full.losses[3:]
    assert all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())
    m = fresh()
    restart = train(m, iter(batches), 3, lr=3e-3, progress=False)
    assert restart.losses[0] == full.losses[3] and restart.losses[1:] != full.losses[4:]


def test_a_resumed_run_keeps_its_checkpoints_optimizer_states_and_says_so(tmp_path):
    model, data, _ = _setup()
    train(model, data, 2, checkpoint_dir=str(tmp_path), progress=False)
    other = make_optimizers(model, 1e-3, "cpu")
    notes = []
    model, data, _ = _setup()
    res = train(model, data, 3, checkpoint_dir=str(tmp_path), resume=True, progress=False,
                optimizer_state=[o.state_dict() for o in other],
                log_fn=lambda e: notes.append(e.get("message")))
    assert res.resumed_from == 2
    assert any("optimizer_state was not used" in (n or "") for n in notes)


def test_optimizer_state_keeps_this_runs_hyperparameters():
    """The moments come from the given states; lr and weight decay stay this run's."""
    from loka.train import load_optimizer_states
    model, data, _ = _setup()
    old = make_optimizers(model, 0.5, "cpu", weight_decay=0.3)
    loss_fn(model, next(data)).backward()
    for o in old:
        o.step()
    states = [o.state_dict() for o in old]
    mine = make_optimizers(model, 1e-3, "cpu")
    load_optimizer_states(mine, states)
    group = mine[0].param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.0
    first = mine[0].param_groups[0]["params"][0]
    assert torch.equal(mine[0].state[first]["exp_avg"], old[0].state[
        old[0].param_groups[0]["params"][0]]["exp_avg"])


def test_optimizer_state_of_another_model_is_refused_before_loading():
    model, data, _ = _setup()
    opts = make_optimizers(model, 1e-3, "cpu")
    other = M.build("dcnv2", "tiny")
    with pytest.raises(ValueError, match="optimizer_state"):
        train(other, SyntheticCTR(other.feature_spec, 8, seed=1), 1, progress=False,
              optimizer_state=[o.state_dict() for o in opts])
    with pytest.raises(ValueError, match="optimizer state"):
        train(model, data, 1, progress=False, optimizer_state=[{"param_groups": []}])
    # a state with a moment of another shape
    m2 = M.build("wukong", "tiny")
    opt = make_optimizers(m2, 1e-3, "cpu")
    loss_fn(m2, next(SyntheticCTR(m2.feature_spec, 8, seed=2))).backward()
    for o in opt:
        o.step()
    st = [o.state_dict() for o in opt]
    first = next(iter(st[0]["state"]))
    st[0]["state"][first]["exp_avg"] = torch.zeros(3, 3)
    from loka.train import load_optimizer_states
    target = make_optimizers(model, 1e-3, "cpu")
    with pytest.raises(ValueError, match="shape"):
        load_optimizer_states(target, st)
    assert not target[0].state  # nothing was loaded
    with pytest.raises(ValueError, match="shape"):
        train(model, data, 1, progress=False, optimizer_state=st)


def test_a_plan_arm_takes_the_optimizer_state_of_its_baseline():
    """An FP8 plan applied to a copy of a model keeps its parameters' order and shapes:
    the baseline's optimizer states load into the planned copy."""
    model, data, _ = _setup()
    opts = make_optimizers(model, 1e-3, "cpu")
    loss_fn(model, next(data)).backward()
    for o in opts:
        o.step()
    states = [o.state_dict() for o in opts]
    steps = {int(v["step"]) for v in states[0]["state"].values()}
    planned = copy.deepcopy(model)
    _, d1, _ = _setup()
    res = train(planned, d1, 2, plan=_plan_for(planned), progress=False,
                optimizer_state=states)
    assert isinstance(planned.over_arch.mlp[0], loka.Linear) and len(res.losses) == 2
    assert all(math.isfinite(l) for l in res.losses)
    # the moments were taken up: from the same weights and batches, fresh moments differ
    again = copy.deepcopy(model)
    _, d2, _ = _setup()
    fresh = train(again, d2, 2, plan=_plan_for(again), progress=False)
    assert steps == {1} and res.losses[0] == fresh.losses[0]
    assert res.losses[1] != fresh.losses[1]
