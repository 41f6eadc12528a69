"""DDP and FSDP2 on 2 (and 4) CPU processes over gloo, compared with one process
training on the same global batch."""

from __future__ import annotations

import json

import pytest
import torch

import dist_workers as w
from dist_workers import UNEVEN
from harness import run_ranks

# FP8 (emulated rowwise) training on 2 ranks vs 1: the rowwise scales of the weight
# gradient's operands span each rank's rows instead of all rows, so the runs differ by
# FP8 rounding, not more. The bound is below the distance between the FP8 and the
# high-precision single-process runs (asserted), so it tells FP8 noise from a real
# difference such as a gradient not averaged over the ranks.
PARAM_ATOL = 3e-5
LOSS_RTOL = 5e-4


@pytest.fixture(scope="module")
def single():
    return w.train_single()


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_ddp_trains_like_one_process_and_agrees_on_plan_stats_and_guard(tmp_path, single):
    run_ranks(w.ddp_worker, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"ddp{r}.json").read_text()) for r in range(2)]
    ten = [torch.load(tmp_path / f"ddp{r}.pt", weights_only=True) for r in range(2)]
    # training: both ranks hold the same weights, those of one process on the whole batch
    assert _max_diff(ten[0]["params"], ten[1]["params"]) == 0.0
    assert res[0]["changed"] == len(w.Plan.uniform(w.tiny(), w.FP8).fp8_sites()) > 0
    diff = _max_diff(ten[0]["params"], single["params"])
    assert diff < PARAM_ATOL, diff
    for got, want in zip(res[0]["losses"], single["losses"]):
        assert got == pytest.approx(want, rel=LOSS_RTOL)
    # the bound is tight enough to mean something: high precision is farther away
    hp = w.train_single(kernel=None)
    assert _max_diff(hp["params"], single["params"]) > PARAM_ATOL
    # plans: one fingerprint; the divergent one names rank 1
    assert res[0]["fingerprint"] == res[1]["fingerprint"]
    for r in res:
        assert r["divergence"] is not None and "ranks [1]" in r["divergence"]
    # a rank without a plan makes every rank raise instead of waiting in the collective
    assert [r["bad_broadcast"] for r in res] == [
        "TypeError: broadcast_plan: rank 0 must pass a loka.Plan, got NoneType"] * 2
    assert res[0]["bad_check"] == ("PlanDivergenceError: ranks [1] passed no loka.Plan to "
                                   "check_same_plan")
    assert res[1]["bad_check"] == "TypeError: check_same_plan needs a loka.Plan, got NoneType"
    # make() failing on rank 0: its own error there, one line of it on the others
    assert res[0]["bad_make"] == "ValueError: no report\n(a second line)"
    assert res[1]["bad_make"] == ("RuntimeError: making the plan failed on rank 0: "
                                  "ValueError: no report")
    # Probe: sites named without the DDP prefix; statistics merged over both ranks' rows
    assert "over_arch.mlp.0" in res[0]["sites"] and not any(s.startswith("module.")
                                                             for s in res[0]["sites"])
    assert res[0]["merged_rows"] == res[0]["local_rows"] + res[1]["local_rows"]
    assert res[0]["merged_rows"] == res[1]["merged_rows"]
    assert [r["captured_kept"] for r in res] == [True, True]
    for key in ("mean", "var", "amax"):
        assert torch.equal(ten[0][key], ten[1][key])
    # Guard: NaN data on rank 1 only -> every rank skips; a site failing on rank 1 only
    # -> every rank switches it and keeps the same plan
    assert [r["nan_step_ok"] for r in res] == [False, False]
    assert [r["flaky_step_ok"] for r in res] == [False, False]
    assert [r["switched"] for r in res] == [["over_arch.mlp.2"]] * 2
    assert res[0]["flaky_fingerprint"] == res[1]["flaky_fingerprint"]


def test_fsdp2_trains_like_one_process_with_fp8_all_gather_at_half_the_bytes(tmp_path, single):
    run_ranks(w.fsdp_worker, 2, str(tmp_path))
    res = json.loads((tmp_path / "fsdp.json").read_text())
    ten = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    # FP8 all-gather on every FP8 site whose rows split over 2 ranks
    assert res["wrapped"]["layers.0.fmb.mlp.0"] == "fp8"
    assert "is not rowwise FP8" in res["wrapped"]["over_arch.mlp.4"]  # fwd on bf16 (N = 1)
    # apply before fully_shard (FP8 all-gather) and after it: both train as one process
    for key in ("before", "after"):
        diff = _max_diff(ten[f"params_{key}"], single["params"])
        assert diff < PARAM_ATOL, (key, diff)
        for got, want in zip(res[f"losses_{key}"], single["losses"]):
            assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert "Linear" in res["linear_types"]  # loka.Linear under fully_shard
    # the Probe and the Guard on the sharded model
    assert res["merged_rows"] == 3 * w.BATCH
    assert len(res["guarded"]) > 0
    # fully_shard on each Linear itself: the Probe sees whole weights, then apply, Guard
    assert res["per_linear_weight_exact"] and res["per_linear_rows"] == 2 * 16
    assert res["per_linear_ok"] and res["per_linear_fp8"] and res["per_linear_back"]
    # bytes: FP8 rows and their row scales vs bf16 parameters (3 layers 128x128)
    bf16 = res["bytes_bf16"]
    assert bf16 == res["gathers_bf16"] * 128 * 128 * 2 // 2
    assert res["bytes_rowwise"] <= 0.55 * bf16
    assert res["bytes_rowwise"] == res["gathers_rowwise"] * (64 * 128 + 64 * 4)
    assert res["bytes_tensorwise"] == 0.5 * bf16
    # the gathered FP8 weight is the forward kernel's quantization of the whole weight
    # (initial weights, and after an optimizer step: the cached FP8 shards are renewed)
    assert res["exact_rowwise"] == res["exact_tensorwise"] == [True, True]
    assert res["grad_finite_rowwise"] and res["grad_finite_tensorwise"]
    assert res["grad_dtype_rowwise"] == res["grad_dtype_tensorwise"] == "torch.float32"
    # after precompute_fp8_scales the tensorwise all-gathers need no all-reduce of their own
    assert res["all_reduces_tensorwise"] == 0 and res["all_reduces_rowwise"] == 0
    assert res["all_reduces_unprecomputed_tensorwise"] > 0  # (the count can see them)
    assert res["all_reduces_unprecomputed_rowwise"] == 0  # rowwise scales are local


def test_fp8_all_gather_of_rows_that_do_not_split_over_3_ranks(tmp_path):
    run_ranks(w.uneven_worker, 3, str(tmp_path))
    res = json.loads((tmp_path / "uneven.json").read_text())
    assert res["wrapped_rowwise"] == res["wrapped_tensorwise"] == {"0": "fp8", "2": "fp8",
                                                                     "4": "fp8"}
    # every step's gathered FP8 weight is the kernel's quantization of the whole weight
    assert res["exact_rowwise"] == res["exact_tensorwise"] == [True] * 3
    # training: tensorwise is the plan sharded without FP8 all-gather, bit for bit; rowwise
    # differs only by the dgrad's second quantization of the FP8 weight, well inside what
    # FP8 itself moves the weights from fp32
    assert res["diff_plain_tensorwise"] == 0.0
    assert res["losses_tensorwise"] == res["plain_losses_tensorwise"]
    assert res["diff_plain_rowwise"] < 0.5 * res["fp8_effect_rowwise"]
    assert res["losses_rowwise"][0] == res["plain_losses_rowwise"][0]
    # bytes: each shard padded to FSDP's padded rows p = ceil(N / 3); one forward and one
    # backward all-gather per Linear. Rowwise rows that split evenly carry their scales in
    # the same all-gather; uneven ones send them once per optimizer step, in one all-gather
    # for all such weights when precomputed, or one each inside the first all-gather.
    pad = [-(-n // 3) for _, n in UNEVEN]
    fp8 = 2 * sum(p * k for p, (k, _) in zip(pad, UNEVEN))
    even_scales = 2 * sum(4 * p for p, (_, n) in zip(pad, UNEVEN) if n % 3 == 0)
    uneven_scales = sum(4 * p for p, (_, n) in zip(pad, UNEVEN) if n % 3)
    assert res["bytes_bf16"] == 2 * fp8 and res["gathers_bf16"] == 6
    assert res["gathers_tensorwise"] == [[6, fp8]] * 3
    steady = [6, fp8 + even_scales]
    unprecomputed = [8, fp8 + even_scales + uneven_scales]
    assert res["gathers_rowwise"] == [unprecomputed, steady, unprecomputed]
    assert res["precompute_gathers_rowwise"] == 1 and res["precomputed_rowwise"] == 2
    assert res["precompute_gathers_tensorwise"] == 0 and res["precomputed_tensorwise"] == 3
    assert steady[1] <= 0.55 * res["bytes_bf16"]
    # FSDP re-padding the smaller shards (new shard objects on rank 2 only) before and
    # after the first forward keeps every rank's collectives and scales in step
    assert res["repadded_rowwise"] == res["repadded_tensorwise"] == [True, True]


@pytest.mark.slow
def test_precomputed_scales_reduce_over_each_weights_own_process_group(tmp_path):
    run_ranks(w.mixed_mesh_worker, 4, str(tmp_path))
    res = json.loads((tmp_path / "mixed.json").read_text())
    assert res == {"ok": [True, True], "ok_together": [True, True], "all_reduces": 2}


def test_the_probe_sees_the_same_operand_producers_through_fully_shard(tmp_path):
    run_ranks(w.producers_worker, 1, str(tmp_path))
    plain, sharded = json.loads((tmp_path / "producers.json").read_text())
    # FSDP's identity functions on module inputs are seen through: each x is its Linear's
    assert plain == sharded == {"a": {"x": "input", "dy": "pointwise", "x_layout": "rows"},
                                "b": {"x": "pointwise", "dy": "gemm", "x_users": "single",
                                      "x_layout": "rows"},
                                "c": {"x": "gemm", "dy": "output", "x_users": "single",
                                      "x_layout": "rows"}}


@pytest.mark.slow
def test_tensorwise_fp8_all_gather_under_hsdp_precomputes_its_scales(tmp_path):
    run_ranks(w.hsdp_worker, 4, str(tmp_path))
    res = json.loads((tmp_path / "hsdp.json").read_text())
    assert res == {"wrapped": {"0": "fp8", "1": "fp8"}, "precomputed": 2, "all_reduces": 0,
                   "same_as_unsharded": True}


@pytest.mark.slow
def test_checkpoint_saved_on_4_ranks_loads_on_2(tmp_path):
    ckpt, ref, got = tmp_path / "ckpt", tmp_path / "ref.pt", tmp_path / "got.pt"
    run_ranks(w.ckpt_save_worker, 4, str(ckpt), str(ref))
    assert (ckpt / "plan.json").is_file() and (ckpt / "probe_report.json").is_file()
    run_ranks(w.ckpt_load_worker, 2, str(ckpt), str(got))
    want = torch.load(ref, weights_only=True)
    loaded = torch.load(got, weights_only=True)
    assert want.keys() == loaded["params"].keys()
    for k in want:
        assert torch.equal(want[k], loaded["params"][k]), k
    fresh = w.build_reference("wukong", "tiny", None, torch.device("cpu"), seed=5).state_dict()
    assert any(not torch.equal(fresh[k], want[k]) for k in want)  # loading changed them
    assert int(loaded["plan_sites"]) == len(w.Plan.uniform(w.tiny(), w.FP8).sites)
    assert int(loaded["report_sites"]) == 1


def test_a_checkpoint_whose_plan_rank_0_cannot_write_fails_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "plan.json").mkdir(parents=True)  # the plan's name is taken by a directory
    run_ranks(w.ckpt_unwritable_plan_worker, 2, str(ckpt), str(tmp_path))
    msgs = [json.loads((tmp_path / f"save{r}.json").read_text()) for r in range(2)]
    assert msgs[0] is not None and msgs[0].split(":")[0].endswith("Error")
    assert msgs[1] == (f"RuntimeError: rank 0 could not write the plan or report beside the "
                       f"checkpoint at {ckpt} (rank 0 raised why)")
