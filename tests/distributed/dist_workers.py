"""What each rank runs in the distributed tests, and the single-process references they
are compared with. Results go to files (``torch.save`` of tensors, read back with
``weights_only=True``; JSON for the rest)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import loka
import loka.distributed as ld
from loka.assembly import build_reference
from loka.config import ProbeConfig
from loka.data import SyntheticCTR
from loka.dispatch import Guard, Plan
from loka.kernels import Kernel, get, register
from loka.train.loop import loss_fn

FP8 = "emulated-rowwise-e4m3"
BATCH = 32
STEPS = 3
LR = 0.05


def tiny() -> nn.Module:
    return build_reference("wukong", "tiny", None, torch.device("cpu"), seed=0)


def global_batches(model, steps=STEPS, seed=0):
    stream = iter(SyntheticCTR(model.feature_spec, BATCH, seed=seed))
    return [next(stream) for _ in range(steps)]


def full_params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_single(kernel=FP8, steps=STEPS) -> dict:
    """The reference: one process, the whole global batch, the same plan."""
    model = tiny()
    if kernel is not None:
        loka.apply(model, Plan.uniform(model, kernel))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(model, steps):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"params": full_params(model), "losses": losses}


def _train(run, model, probe=None):
    """The global batches, each rank's shard, through ``run`` (the model or its wrapper),
    under ``probe`` if given, SGD on ``run``'s parameters; the per-step losses averaged
    over ranks."""
    opt = torch.optim.SGD(run.parameters(), lr=LR)
    losses = []
    with probe if probe is not None else contextlib.nullcontext():
        for batch in global_batches(model):
            loss = loss_fn(run, ld.shard_batch(batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_mean_loss(loss))
    return losses


def _mean_loss(local: torch.Tensor) -> float:
    t = local.detach().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _flaky(a, b, out_dtype):
    """The FP8 kernel, but Inf in its output on rank 1 while armed."""
    y = get(FP8)(a, b, out_dtype)
    if _FLAKY["on"] and dist.get_rank() == 1:
        y = y.clone()
        y[0] = float("inf")
    return y


_FLAKY = {"on": False}


def _no_plan():
    raise ValueError("no report\n(a second line)")


# -- DDP ---------------------------------------------------------------------------------
def ddp_worker(rank, world, out):
    out = Path(out)
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = tiny()
    # the plan is made once (rank 0) on the unwrapped model and applied to the DDP one
    plan = ld.plan_once(lambda: Plan.uniform(model, FP8))
    ddp = DDP(model)
    report = loka.apply(ddp, plan)
    ld.check_same_plan(plan)
    # a plan made on the wrapped model names the same sites
    wrapped_plan = Plan.uniform(ddp, FP8)
    assert sorted(wrapped_plan.sites)[0].startswith("module."), sorted(wrapped_plan.sites)
    assert loka.dispatch.check(model, wrapped_plan) is not None
    # the Probe on the wrapped model, its statistics merged over the ranks
    probe = loka.Probe(ddp, ProbeConfig(every_n_steps=1, progress=False, source="captured"))
    losses = _train(ddp, model, probe)
    site = "over_arch.mlp.0"
    local_rows = probe.sites[site].act.moments.count
    captured = probe.sites[site].captured_x
    ld.reduce_probe(probe)
    stats = probe.sites[site].act
    # operand rows captured for source='captured' stay this rank's own
    captured_kept = captured is not None and probe.sites[site].captured_x is captured
    result = {"changed": len(report.changed), "losses": losses, "local_rows": local_rows,
              "merged_rows": stats.moments.count, "sites": sorted(probe.sites),
              "fingerprint": ld.plan_fingerprint(plan), "captured_kept": captured_kept}
    tensors = {"params": full_params(model), "mean": stats.moments.mean.clone(),
               "var": stats.moments.variance().clone(), "amax": stats.range.channel_amax.clone()}
    # a plan that differs on rank 1 is caught, naming rank 1
    other = plan.copy()
    if rank == 1:
        other.sites[site].roles[loka.Role.FWD].kernel = "bf16"
    try:
        ld.check_same_plan(other)
        result["divergence"] = None
    except ld.PlanDivergenceError as e:
        result["divergence"] = str(e)
    # a rank passing no plan: every rank raises (none waits in the collective)
    for key, call in (("bad_broadcast", lambda: ld.broadcast_plan(plan if rank else None)),
                      ("bad_check", lambda: ld.check_same_plan(None if rank else plan)),
                      ("bad_make", lambda: ld.plan_once(_no_plan))):
        try:
            call()
            result[key] = None
        except (TypeError, ValueError, RuntimeError) as e:
            result[key] = f"{type(e).__name__}: {e}"
    # the Guard: a non-finite batch on rank 1 only makes every rank skip the update
    guard = Guard(ddp, plan, check_every=1, agreement=ld.RankAgreement())
    batch = ld.shard_batch(global_batches(model, 1, seed=7)[0])
    if rank == 1:
        batch.dense[0, 0] = float("nan")
    loss = loss_fn(ddp, batch)
    loss.backward()
    result["nan_step_ok"] = guard.step(loss)
    ddp.zero_grad()
    # a site failing on rank 1 only is switched to bf16 on every rank
    register(Kernel("t-flaky", _flaky, library="custom", scaling="rowwise",
                    formats=("e4m3", "e4m3"), align=16, quantize_a=get(FP8).quantize_a,
                    quantize_b=get(FP8).quantize_b), override=True)
    flaky = plan.copy()
    flaky.sites["over_arch.mlp.2"].roles[loka.Role.FWD].kernel = "t-flaky"
    loka.apply(ddp, flaky)
    guard = Guard(ddp, flaky, check_every=1, agreement=ld.RankAgreement())
    _FLAKY["on"] = True
    loss = loss_fn(ddp, ld.shard_batch(global_batches(model, 1, seed=8)[0]))
    loss.backward()
    result["flaky_step_ok"] = guard.step(loss)
    _FLAKY["on"] = False
    result["switched"] = sorted(e.site for e in guard.events)
    result["flaky_fingerprint"] = ld.plan_fingerprint(flaky)
    ld.check_same_plan(flaky)
    (out / f"ddp{rank}.json").write_text(json.dumps(result))
    torch.save(tensors, out / f"ddp{rank}.pt")


# -- FSDP2 -------------------------------------------------------------------------------
def _shard(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model.over_arch)
    fully_shard(model)


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach() + 0 for k, v in sd.items()}  # + 0: plain tensors, same values


def fsdp_worker(rank, world, out):
    out = Path(out)
    result, tensors = {}, {}
    # (a) apply before fully_shard, with FP8 all-gather (rowwise)
    model = tiny()
    plan = ld.plan_once(lambda: Plan.uniform(model, FP8))
    loka.apply(model, plan)
    result["wrapped"] = ld.fp8_all_gather(model, "rowwise")
    _shard(model)
    probe = loka.Probe(model, ProbeConfig(every_n_steps=1, progress=False))
    losses = _train(model, model, probe)
    ld.reduce_probe(probe)
    result["merged_rows"] = probe.sites["over_arch.mlp.0"].act.moments.count
    guard = Guard(model, plan, check_every=1, agreement=ld.RankAgreement())
    result["guarded"] = sorted(guard.sites)
    result["losses_before"] = losses
    tensors["params_before"] = _full_state(model)
    # (b) apply after fully_shard (no FP8 all-gather)
    model = tiny()
    _shard(model)
    loka.apply(model, plan)
    result["losses_after"] = _train(model, model)
    result["linear_types"] = sorted({type(m).__name__ for m in model.modules()
                                     if isinstance(m, nn.Linear)})
    tensors["params_after"] = _full_state(model)
    result.update(_count_bytes(world))
    result.update(_per_linear_shards())
    if rank == 0:
        (out / "fsdp.json").write_text(json.dumps(result))
        torch.save(tensors, out / "fsdp.pt")


def producers_worker(rank, world, out):
    """The Probe's operand producers on a ``fully_shard``-ed model equal the plain
    model's (FSDP's identity functions on module inputs are seen through)."""
    from torch.distributed.fsdp import fully_shard

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Linear(32, 32) for _ in range(3))

        def forward(self, x):
            return self.c(self.b(torch.relu(self.a(x))))

    got = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = Net()
        if wrap:
            for m in (model.a, model.b, model.c, model):
                fully_shard(m)
        with loka.Probe(model, ProbeConfig(progress=False)) as probe:
            model(torch.randn(16, 32)).square().mean().backward()
        got.append({n: s.producers for n, s in probe.sites.items()})
    if rank == 0:
        (Path(out) / "producers.json").write_text(json.dumps(got))


def _per_linear_shards():
    """``fully_shard`` on each Linear itself (FSDP reshards it before the Probe's forward
    hook sees its weight; FSDP keys its state by the module object), apply before the first
    forward, then the Probe, the Guard and unapply."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    want = model[0].weight.detach().clone()
    for m in (model[0], model[2], model):
        fully_shard(m)
    first = model[0]
    plan = ld.plan_once(lambda: Plan.uniform(model, FP8))
    loka.apply(model, plan)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    with loka.Probe(model, ProbeConfig(every_n_steps=1, progress=False)) as probe:
        model(x).sum().backward()
    ld.reduce_probe(probe)
    guard = Guard(model, plan, check_every=1, agreement=ld.RankAgreement())
    loss = model(x).sum()
    loss.backward()
    ok = guard.step(loss)
    swapped = model[0] is first and isinstance(first, loka.Linear) \
        and isinstance(first, FSDPModule)
    loka.unapply(model)
    # one snapshot: the EMA's mean is the weight itself, up to the EMA's float32 rounding
    got = probe.sites["0"].weight.mean
    return {"per_linear_weight_exact": bool(torch.allclose(got, want, rtol=1e-6, atol=0)),
            "per_linear_rows": probe.sites["0"].act.moments.count,
            "per_linear_ok": ok, "per_linear_fp8": swapped,
            "per_linear_back": type(model[0]).__mro__[1:3] == (FSDPModule, nn.Linear)
            and model[0] is first}


def _stack(scaling, kernel):
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(3)])
    ref = [m.weight.detach().clone() for m in model]
    if kernel is not None:
        loka.apply(model, Plan.uniform(model, kernel))
    if scaling is not None:
        ld.fp8_all_gather(model, scaling)
    return model, ref


def _count_bytes(world):
    """All-gather bytes of a 3-layer stack: bf16 parameters, FP8 rowwise, FP8 tensorwise;
    and whether the gathered FP8 weight is the forward kernel's own quantization."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    res = {}
    for name, scaling, kernel in (("bf16", None, None), ("rowwise", "rowwise", FP8),
                                  ("tensorwise", "tensorwise", "emulated-tensorwise-e4m3")):
        model, ref = _stack(scaling, kernel)
        seen = {}
        if kernel is not None:
            def keep(m, args, out):
                seen.setdefault("q", (m.weight_q.data.float().clone(), m.weight_q.scale.clone()))
            model[0].register_forward_hook(keep)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if scaling is None else \
            MixedPrecisionPolicy()
        for layer in model:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        if scaling == "tensorwise":
            ld.precompute_fp8_scales(model)
        with ld.count_all_gather() as counter:
            y = model(x.to(torch.bfloat16) if scaling is None else x)
            y.float().sum().backward()
        res[f"bytes_{name}"] = counter.bytes
        res[f"gathers_{name}"] = counter.count
        if kernel is not None:
            exact = []
            for step in range(2):  # the initial weights, then the weights after a step
                want = get(kernel).quantize_b(ref[0].t())
                q, s = seen.pop("q")
                exact.append(bool(torch.equal(q, want.data.float())
                                  and torch.equal(s, want.scale)))
                # the reduce-scatter stays in high precision: float32 gradient shards
                res[f"grad_dtype_{name}"] = str(model[0].weight.grad.dtype)
                torch.optim.SGD(model.parameters(), lr=1.0).step()
                if scaling == "tensorwise":
                    ld.precompute_fp8_scales(model)
                ref[0] = model[0].weight.full_tensor().detach() + 0
                model.zero_grad()
                with _count_all_reduce() as reduces:
                    model(x).sum().backward()
                res[f"all_reduces_{name}"] = reduces[0]
            ld.weights_changed()  # changed weights, no precompute: the all-gather reduces
            with _count_all_reduce() as reduces:
                model(x).sum().backward()
            res[f"all_reduces_unprecomputed_{name}"] = reduces[0]
            res[f"exact_{name}"] = exact
            res[f"grad_finite_{name}"] = bool(all(
                torch.isfinite(m.weight.grad.to_local()).all() for m in model))
    return res


def hsdp_worker(rank, world, out):
    """Tensorwise FP8 all-gather under HSDP (a 2-D mesh: 2 replicas of 2 shards): the
    precomputed scales reduce over the shard dimension, as FSDP's all-gather does."""
    import copy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(2)])
    loka.apply(model, Plan.uniform(model, "emulated-tensorwise-e4m3"))
    ref = copy.deepcopy(model)  # the same FP8 model, unsharded
    wrapped = ld.fp8_all_gather(model, "tensorwise", world_size=2)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    precomputed = ld.precompute_fp8_scales(model)
    with _count_all_reduce() as reduces:
        y = model(x)
    result = {"wrapped": wrapped, "precomputed": precomputed, "all_reduces": reduces[0],
              "same_as_unsharded": bool(torch.equal(y, ref(x)))}
    if rank == 0:
        (Path(out) / "hsdp.json").write_text(json.dumps(result))


UNEVEN = ((32, 64), (64, 48), (48, 32))
"""(in, out) of the Linears of :func:`uneven_worker`: 64 rows shard 22/22/20 over 3 ranks,
48 rows 16/16/16, 32 rows 11/11/10"""


def _uneven_run(kernel, scaling, x, steps=3):
    """The Linear stack under ``fully_shard`` (each Linear, then the root), planned with
    ``kernel`` (None: none) and FP8-gathered at ``scaling`` (None: not), trained ``steps``
    SGD steps on this rank's rows of ``x``; the scales are precomputed before step 1 only."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(4)
    layers = []
    for k, n in UNEVEN:
        layers += [nn.Linear(k, n, bias=False), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    res = {}
    if kernel is not None:
        loka.apply(model, Plan.uniform(model, kernel))
    if scaling is not None:
        res["wrapped"] = ld.fp8_all_gather(model, scaling)
        seen = []
        model[0].register_forward_hook(lambda m, a, o: seen.append(
            (m.weight_q.data.float().clone(), m.weight_q.scale.clone())))
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    rank = dist.get_rank()
    mine = x[rank * 8:(rank + 1) * 8]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    res.update(exact=[], gathers=[], losses=[])
    for step in range(steps):
        if scaling is not None:
            want = get(kernel).quantize_b(model[0].weight.full_tensor().detach().t())
        if step == 1 and scaling is not None:  # the scales travel before the step, at once
            with ld.count_all_gather() as pre:
                res["precomputed"] = ld.precompute_fp8_scales(model)
            res["precompute_gathers"] = pre.count
        with ld.count_all_gather() as counter:
            loss = model(mine).pow(2).mean()
            loss.backward()
        res["gathers"].append([counter.count, counter.bytes])
        if scaling is not None:
            q, sc = seen.pop()
            res["exact"].append(bool(torch.equal(q, want.data.float())
                                     and torch.equal(sc, want.scale)))
        res["losses"].append(_mean_loss(loss))
        opt.step()
        opt.zero_grad()
    res["params"] = _full_state(model)
    return res


def _uneven_repadded(x):
    """FSDP installs a new shard object on the ranks whose shard it re-pads (at its lazy
    init, after ``load_state_dict``), not on the others: scales precomputed before the
    first forward, and a forward after ``load_state_dict``, must still make every rank
    run the same collectives and gather the kernel's own quantization."""
    from torch.distributed.fsdp import fully_shard
    res = {}
    for scaling, kernel in (("rowwise", FP8), ("tensorwise", "emulated-tensorwise-e4m3")):
        torch.manual_seed(4)
        model = nn.Sequential(*[nn.Linear(k, n, bias=False) for k, n in UNEVEN])
        loka.apply(model, Plan.uniform(model, kernel))
        ld.fp8_all_gather(model, scaling)
        seen = []
        model[0].register_forward_hook(lambda m, a, o: seen.append(m.weight_q.scale.clone()))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        ld.precompute_fp8_scales(model)  # before FSDP's lazy init re-pads rank 2's shards
        mine = x[dist.get_rank() * 8:(dist.get_rank() + 1) * 8]
        ok = []
        for step in range(2):
            want = get(kernel).quantize_b(model[0].weight.full_tensor().detach().t())
            model(mine).sum().backward()
            ok.append(bool(torch.equal(seen.pop(), want.scale)))
            model.load_state_dict(model.state_dict())  # FSDP re-pads again
        res[f"repadded_{scaling}"] = ok
    return res


def mixed_mesh_worker(rank, world, out):
    """Two Linears sharded over different process groups (4 ranks: shard groups {0,1},
    {2,3} and {0,2}, {1,3}): precomputed tensorwise scales reduce over each weight's own
    group; the gathered weight is the kernel's quantization of that whole weight."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    kernel = "emulated-tensorwise-e4m3"
    names = ("replicate", "shard")
    a = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=names)
    b = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=names)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[1].weight[rank % 2] *= 50  # the two shard groups see different largest |w|
    loka.apply(model, Plan.uniform(model, kernel))
    ld.fp8_all_gather(model, "tensorwise", world_size=2)
    fully_shard(model[0], mesh=a)
    fully_shard(model[1], mesh=b)
    fully_shard(model, mesh=a)  # a root without weights: the Linears reshard after use
    seen = {}
    def keep(i):
        def hook(m, args, out):
            seen.setdefault(i, m.weight_q.scale.clone())
        return hook
    for i in (0, 1):
        model[i].register_forward_hook(keep(i))
    want = [get(kernel).quantize_b(model[i].weight.full_tensor().detach().t()).scale
            for i in (0, 1)]
    ld.precompute_fp8_scales(model[0])
    ld.precompute_fp8_scales(model[1])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    ok = [bool(torch.equal(seen[i], want[i])) for i in (0, 1)]
    # both weights in one call: one all-reduce per group, each weight's own amax
    seen.clear()
    ld.weights_changed()
    with _count_all_reduce() as reduces:
        ld.precompute_fp8_scales(model)
    with _count_all_reduce() as in_forward:
        model(x)
    reduces[0] += in_forward[0]  # the forward's all-gathers need none of their own
    ok_together = [bool(torch.equal(seen[i], want[i])) for i in (0, 1)]
    result = {"ok": ok, "ok_together": ok_together, "all_reduces": reduces[0]}
    if rank == 0:
        (Path(out) / "mixed.json").write_text(json.dumps(result))


def uneven_worker(rank, world, out):
    """FP8 all-gather of weights whose rows do not split over 3 ranks (:data:`UNEVEN`), per
    scaling against the same plan sharded without it; the bf16 all-gather's bytes."""
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(5))
    res, params = {}, {}
    hp = _uneven_run(None, None, x)
    for scaling, kernel in (("rowwise", FP8), ("tensorwise", "emulated-tensorwise-e4m3")):
        gathered = _uneven_run(kernel, scaling, x)
        plain = _uneven_run(kernel, None, x)
        params[scaling] = gathered.pop("params")
        for key, ref in (("plain", plain["params"]), ("fp32", hp["params"])):
            res[f"diff_{key}_{scaling}"] = max(
                float((params[scaling][k].double() - v.double()).abs().max())
                for k, v in ref.items())
        res[f"fp8_effect_{scaling}"] = max(
            float((plain["params"][k].double() - v.double()).abs().max())
            for k, v in hp["params"].items())
        res[f"plain_losses_{scaling}"] = plain["losses"]
        res.update({f"{k}_{scaling}": v for k, v in gathered.items()})
    res.update(_uneven_repadded(x))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(4)
    model = nn.Sequential(*[nn.Linear(k, n, bias=False) for k, n in UNEVEN])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    with ld.count_all_gather() as counter:
        model(x[:8].to(torch.bfloat16)).float().sum().backward()
    res["bytes_bf16"], res["gathers_bf16"] = counter.bytes, counter.count
    if rank == 0:
        (Path(out) / "uneven.json").write_text(json.dumps(res))


class _count_all_reduce:
    """Count dist.all_reduce calls (the tensorwise amax after precompute_fp8_scales: none)."""

    def __enter__(self):
        self.count, self.orig = [0], dist.all_reduce

        def counted(*args, **kwargs):
            self.count[0] += 1
            return self.orig(*args, **kwargs)
        dist.all_reduce = counted
        return self.count

    def __exit__(self, *exc):
        dist.all_reduce = self.orig


# -- checkpoints ---------------------------------------------------------------------------
def ckpt_save_worker(rank, world, path, ref_file):
    model = tiny()
    plan = Plan.uniform(model, FP8)
    loka.apply(model, plan)
    ld.fp8_all_gather(model, "rowwise")  # saved as the plain weights inside
    _shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in global_batches(model, 2):
        loss_fn(model, ld.shard_batch(batch)).backward()
        opt.step()
        opt.zero_grad()
    ld.save(path, model, opt, plan=plan, report=_tiny_report())
    full = _full_state(model)
    if rank == 0:
        torch.save(full, ref_file)


def ckpt_load_worker(rank, world, path, out_file):
    model = build_reference("wukong", "tiny", None, torch.device("cpu"), seed=5)  # other init
    loaded_plan = Plan.load(Path(path) / "plan.json")
    loka.apply(model, loaded_plan)
    ld.fp8_all_gather(model, "rowwise")
    _shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loaded = ld.load(path, model, opt)
    full = _full_state(model)
    # the loaded model trains on: its FP8 all-gathers quantize the loaded weights
    loss = loss_fn(model, ld.shard_batch(global_batches(model, 1, seed=9)[0]))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    if rank == 0:
        torch.save({"params": full,
                    "plan_sites": torch.tensor(len(loaded.plan.sites)),
                    "report_sites": torch.tensor(len(loaded.report.sites))}, out_file)


def ckpt_unwritable_plan_worker(rank, world, path, out):
    """rank 0 cannot write plan.json (a directory holds the name): every rank raises."""
    model = nn.Sequential(nn.Linear(32, 32))
    try:
        ld.save(path, model, plan=Plan.uniform(model, FP8))
        msg = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        msg = f"{type(e).__name__}: {e}"
    (Path(out) / f"save{rank}.json").write_text(json.dumps(msg))


def _tiny_report():
    from loka.probe.report import ProbeReport, SiteReport
    return ProbeReport(sites={"over_arch.mlp.0": SiteReport("over_arch.mlp.0", 32, 32, 16)},
                       device="cpu", device_name="test", torch_version=torch.__version__)
