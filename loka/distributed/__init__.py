"""LoKA in data-parallel training (``torch.distributed``: DDP and FSDP2).

* One plan for all ranks (:mod:`.agree`): :func:`reduce_probe` merges every rank's Probe
  statistics, :func:`plan_once` makes the plan on one rank (its report, its timings) and
  gives it to all, :func:`check_same_plan` raises naming the ranks that differ, and
  :class:`RankAgreement` makes every rank's Guard decide the same.
* FP8 all-gather under FSDP2 (:mod:`.fp8_gather`): :func:`fp8_all_gather` casts weight
  shards to FP8 before FSDP's all-gather (rowwise or tensorwise scales);
  :func:`count_all_gather` counts the bytes.
* Checkpoints (:mod:`.checkpoint`): :func:`save` / :func:`load` through
  ``torch.distributed.checkpoint`` (save on N ranks, load on M), with the plan and the
  Probe's report beside the weights.

Plans name sites without wrapper prefixes (``module.``, ``_orig_mod.``, ...), so a plan
made on the unwrapped model applies to the DDP- or FSDP-wrapped one and back. See
``docs/distributed.md``.
"""

from .agree import (PlanDivergenceError, RankAgreement, broadcast_plan, check_same_plan,
                    collective_device, plan_fingerprint, plan_once, reduce_probe, world)
from .checkpoint import Loaded, load, save
from .data import shard_batch
from .fp8_gather import (CollectiveBytes, FP8GatherWeight, count_all_gather, fp8_all_gather,
                         precompute_fp8_scales, weights_changed)

__all__ = ["PlanDivergenceError", "RankAgreement", "broadcast_plan", "check_same_plan",
           "collective_device", "plan_fingerprint", "plan_once", "reduce_probe", "world",
           "Loaded", "load", "save", "CollectiveBytes", "FP8GatherWeight", "count_all_gather",
           "fp8_all_gather", "precompute_fp8_scales", "shard_batch", "weights_changed"]
