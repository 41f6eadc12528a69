"""The Probe: per-site statistics learned during training, and every kernel's error and
speed measured on operands drawn from them (``loka.Probe``, ``loka.probe``)."""

import sys as _sys
import types as _types

from ..timing import TimingResult, time_fn
from .measure import bootstrap_stat
from .probe import Probe, probe
from .report import (ErrorStat, KernelResult, ProbeReport, ReportError, RoleReport, SiteReport,
                     compare_reports)
from .sampler import (GaussianSampler, MatrixNormalSampler, OperandSampler, naive_pair,
                      sample_matrix_normal)
from .stats import ChannelMoments, FP8RangeStats, SiteStats, TensorStats, Welford
from .weights import MatrixNormal, WeightModel, flip_flop

__all__ = ["Probe", "probe", "ProbeReport", "SiteReport", "RoleReport",
           "KernelResult", "ErrorStat", "ReportError", "compare_reports", "Welford",
           "ChannelMoments", "FP8RangeStats", "TensorStats", "MatrixNormal", "flip_flop",
           "WeightModel", "SiteStats", "bootstrap_stat", "GaussianSampler", "OperandSampler",
           "naive_pair", "sample_matrix_normal", "MatrixNormalSampler", "TimingResult", "time_fn"]


class _CallablePackage(_types.ModuleType):
    """``loka.probe`` is this package *and* the one-call :func:`probe` of the public API:
    importing the package binds ``loka.probe`` to it, so calling it must run the Probe."""

    def __call__(self, *args, **kwargs):
        return probe(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallablePackage
