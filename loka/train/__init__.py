"""The training loop of the CLI, the demo and the benchmarks (``loop``), and the files of
a run directory: checkpoints with a checksum, stale temp files, the run lock
(``checkpoint``), and scoring a model on evaluation data (``scoring``). Their public names
are all here."""

from .checkpoint import (CHECKPOINT_NAME, CHECKSUM_KEY, TEMP_PATTERNS, CheckpointError,
                         RunExistsError, RunInUseError, RunLock, checkpoint_digest,
                         read_checkpoint, remove_stale_temp_files, verify_checkpoint,
                         write_checkpoint)
from .loop import (PlanChangedError, TrainResult, check_optimizer_states, checkpoint_plan,
                   load_optimizer_states, loss_fn, make_optimizers, plan_digest, train,
                   train_step)
from .scoring import EmptyEvaluationError, evaluate, is_infinite, predict

__all__ = ["train", "train_step", "loss_fn", "make_optimizers", "check_optimizer_states",
           "load_optimizer_states", "predict", "evaluate", "is_infinite",
           "EmptyEvaluationError", "TrainResult", "PlanChangedError", "plan_digest",
           "checkpoint_plan", "CHECKPOINT_NAME", "CHECKSUM_KEY", "TEMP_PATTERNS",
           "CheckpointError", "RunInUseError", "RunExistsError", "RunLock", "checkpoint_digest",
           "read_checkpoint", "verify_checkpoint", "write_checkpoint", "remove_stale_temp_files"]
