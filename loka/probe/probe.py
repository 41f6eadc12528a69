"""The Probe: learn each GEMM site's distributions while the model trains, then measure
every kernel's error and speed on operands drawn from them.

>>> with loka.Probe(model, config=loka.ProbeConfig()) as probe:      # doctest: +SKIP
...     for batch in batches:
...         loss = loss_fn(model, batch); loss.backward(); opt.step(); opt.zero_grad()
>>> report = probe.report()                                           # doctest: +SKIP

How steps are counted and what the hooks cost is in :mod:`loka.probe.hooks`; how kernels
are measured, in :mod:`loka.probe.measure`.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from ..config import ProbeConfig
from ..kernels import registry
from .hooks import SiteCollector
from .measure import measure_report
from .report import ProbeReport
from .stats import SiteStats

__all__ = ["Probe", "probe"]


class Probe:
    """Learns per-site statistics during training; :meth:`report` measures the kernels.

    Args:
        model: any module; every ``nn.Linear`` in it (``loka.Linear`` included) whose
            qualified name matches ``config.module_filter`` (``re.search``) is a site.
        config: :class:`~loka.config.ProbeConfig`.

    Raises:
        ValueError: no Linear matches, a bad filter, or an unknown kernel name.
    """

    def __init__(self, model: nn.Module, config: ProbeConfig = ProbeConfig()) -> None:
        self._hooks = SiteCollector(model, config, check_config=_check_kernel_names)
        self.model, self.config = model, config
        self.modules: Dict[str, nn.Linear] = self._hooks.modules
        """the probed Linears, by qualified name"""
        self.sites: Dict[str, SiteStats] = self._hooks.sites
        """what was learned at each of them"""

    # -- while the model trains (loka.probe.hooks) -------------------------------------
    def attach(self) -> "Probe":
        """Start observing (what ``with`` does on entry); step 0 is a stats step."""
        self._hooks.attach()
        return self

    def detach(self) -> None:
        """Remove every hook; what was learned stays and :meth:`report` still works."""
        self._hooks.detach()

    def __enter__(self) -> "Probe":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def steps(self) -> int:
        """Steps seen so far (training forwards, or :meth:`step` calls in manual mode)."""
        return self._hooks.steps

    @property
    def stats_steps(self) -> List[int]:
        """Indices of the steps on which statistics were taken."""
        return self._hooks.stats_steps

    @property
    def active(self) -> bool:
        """Whether the current step takes statistics (site hooks are registered)."""
        return self._hooks.active

    def step(self) -> None:
        """End the current step (manual counting; the first call switches it on)."""
        self._hooks.step()

    # -- afterwards (loka.probe.measure) -------------------------------------------------
    def report(self, device: "torch.device | str | None" = None) -> ProbeReport:
        """Measure the kernels (``ProbeConfig.kernels``; by default on a GPU
        :data:`~loka.kernels.registry.PROBE_DEFAULT`, on the CPU every available kernel) at
        every observed site and role.

        Args:
            device: where to measure (default: each site's weight device).

        Returns:
            :class:`~loka.probe.report.ProbeReport`.
        """
        return measure_report(self.sites, self.modules, self.config, device,
                              meta={"steps": self.steps, "stats_steps": len(self.stats_steps),
                                    "counting": self._hooks.counting})


def _check_kernel_names(config: ProbeConfig) -> None:
    for name in config.kernels or ():
        registry.get(name)  # a KeyError listing the registered names


def probe(model: nn.Module, batches: Iterable, loss_fn: Callable, *,
          config: ProbeConfig = ProbeConfig(), optimizer: Optional[torch.optim.Optimizer] = None,
          steps: Optional[int] = None, device: "torch.device | str | None" = None) -> ProbeReport:
    """Run training steps under a :class:`Probe` and return its report.

    Each step is ``loss_fn(model, batch).backward()``, then ``optimizer.step()`` and
    ``zero_grad`` if an optimizer is given (else the gradients are dropped). Steps are
    counted by :meth:`Probe.step`, one per batch.

    Args:
        model: the model to probe (put in training mode for the run, then restored).
        batches: any iterable of batches.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        config: the Probe's settings.
        optimizer: optional; without it the weights do not change.
        steps: stop after this many batches (None: all of ``batches``).
        device: where :meth:`Probe.report` measures.
    """
    was_training = model.training
    model.train()
    try:
        with Probe(model, config) as p:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                loss = loss_fn(model, batch)
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                p.step()
    finally:
        model.train(was_training)
    return p.report(device)
