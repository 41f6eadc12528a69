"""What the Probe does while the model trains: count steps and, on statistics steps, fold
every site's operands into its :class:`~loka.probe.stats.SiteStats`.

**Steps.** A step is one training-mode forward of the probed model with gradients
enabled (a forward pre-hook on the root module counts them; eval-mode and ``no_grad``
forwards are not steps). Statistics are taken on steps 0, N, 2N, ... (``every_n_steps``).
Calling :meth:`SiteCollector.step` once switches to manual counting: each call then ends a
step, which is right for gradient accumulation or a loss function that calls submodules
only.

**Overhead.** On a stats step the collector registers a forward hook on every site; the
hook subsamples up to ``max_rows_per_update`` rows of the input, folds them into the
site's statistics, folds the weight into its EMA, and puts a hook on the output tensor
that does the same for the output gradient in the backward pass. Nothing syncs with the
host. On the next step the site hooks are removed, so off-steps cost one pre-hook call
per forward of the whole model. On statistics steps where a site's output gradient's
producer is not yet known (at most ``MAX_WALKS`` walks per site), a forward hook on the
root walks the step's autograd graph once from the model's outputs (the same walk says
whether ops besides a site's Linear read its input); sites called outside
the root's forward are not looked for (host work that grows with the graph's size; see
:mod:`loka.probe.producers`). A statistics step's cost is GPU work that scales with
``max_rows_per_update`` (``bench/bench_probe.py`` measures it). Each site is updated at most
once per step (a module called twice in a step, or recomputed by activation
checkpointing, is seen on its first call). The Probe never changes the training
computation: hooks return nothing, and its random subsampling has its own generator.
Attach it to an eager model (hooks inside a ``torch.compile``\\ d region are traced by
Dynamo, which recompiles when they change).
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..config import ProbeConfig
from .producers import (X_USERS, consumer_kind, consumers_of_outputs, merge_kinds,
                        producer_of, x_layout, x_users)
from .stats import SiteStats

__all__ = ["SiteCollector", "WRAPPER_NAMES", "canonical_name", "full_weight"]

WRAPPER_NAMES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                 "_dmp_wrapped_module")
"""module names that wrappers insert anywhere in a qualified name (torch.compile, FSDP1,
activation checkpointing, torchrec's ``DistributedModelParallel``);
``DistributedDataParallel`` adds a leading ``module``"""


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """The whole weight: a DTensor (a Linear that ``fully_shard`` itself manages is
    resharded before the Probe's forward hook runs) is all-gathered, which every rank does
    at the same hook; a plain tensor is returned as it is."""
    full = getattr(weight, "full_tensor", None)
    return full() if callable(full) else weight


def canonical_name(name: str) -> str:
    """A site's name without what wrappers add: a leading ``module.`` (DDP) and every
    :data:`WRAPPER_NAMES` part, so that a plan made on a model names the same sites as one
    made on its wrapped form (``module.over.0`` and ``_orig_mod.over.0`` are ``over.0``)."""
    parts = [p for p in (name.split(".") if name else []) if p not in WRAPPER_NAMES]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


class SiteCollector:
    """Learns per-site statistics while the model trains (the hooks of :class:`~loka.Probe`).

    Args:
        model: any module; every ``nn.Linear`` in it (``loka.Linear`` included) whose
            qualified name matches ``config.module_filter`` (``re.search``) is a site.
        config: :class:`~loka.config.ProbeConfig`.
        check_config: called with ``config`` once its filter compiles, before the sites are
            found (the Probe checks its kernel names there).

    Raises:
        ValueError: no Linear matches, or a bad filter.
    """

    MAX_WALKS = 2
    """graph walks per site that look for its output gradient's producer: a site whose
    output does not reach the model's outputs stays unknown after that, instead of costing
    a walk on every statistics step"""
    MAX_CALLS = 8
    """calls per site and root forward whose output nodes are kept for the walk"""

    def __init__(self, model: nn.Module, config: ProbeConfig = ProbeConfig(),
                 check_config: Optional[Callable[[ProbeConfig], None]] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Probe needs an nn.Module, got {type(model).__name__}")
        if not isinstance(config, ProbeConfig):
            raise TypeError(f"config must be a ProbeConfig, got {type(config).__name__}")
        self.model, self.config = model, config
        try:
            pattern = re.compile(config.module_filter) if config.module_filter else None
        except re.error as e:
            raise ValueError(f"ProbeConfig.module_filter {config.module_filter!r} is not a "
                             f"valid regular expression ({e})") from None
        if check_config is not None:
            check_config(config)
        root = getattr(model, "_orig_mod", model)  # name sites as in the uncompiled model
        self.modules: Dict[str, nn.Linear] = {}
        self.sites: Dict[str, SiteStats] = {}
        for name, mod in root.named_modules():
            name = canonical_name(name)  # the same sites under DDP, FSDP1, checkpointing
            if isinstance(mod, nn.Linear) and (pattern is None or pattern.search(name)):
                self.modules[name] = mod
                self.sites[name] = SiteStats(
                    name, mod.in_features, mod.out_features,
                    max_full_cov_dim=config.max_full_cov_dim, block_size=config.block_size,
                    weight_ema=config.weight_ema, graphs=config.graph_updates)
        if not self.sites:
            what = "" if pattern is None else f" matching {config.module_filter!r}"
            raise ValueError(f"no nn.Linear{what} in {type(model).__name__}")
        self._step = 0
        self._forwards = 0
        self._ran = 0
        """sites seen running so far (the next site's ``SiteStats.order``)"""
        self._manual = False
        self._attached = False
        self._root_handle = None
        self._root_post_handle = None
        self._site_handles: List = []
        self._outputs: Dict[str, List[object]] = {}
        """site -> its outputs' autograd nodes, this step, until the root's forward ends"""
        self._inputs: Dict[str, List[object]] = {}
        """site -> its inputs' autograd nodes, this step, until the root's forward ends (who
        else reads x: ``producers['x_users']``)"""
        self._read: Dict[tuple, tuple] = {}
        """the inputs read so far in this root forward: (base id, offset, shape, strides,
        dtype) -> (first site that read it, its base tensor, held so that the id stays
        its own until the forward ends): sites reading one tensor (``producers['x_group']``)"""
        self._walks: Dict[str, int] = {n: 0 for n in self.sites}
        """per site: graph walks that looked for its output gradient's producer"""
        self._in_root = False
        """inside the root module's forward (where output nodes are recorded)"""
        self._last_update: Dict[str, int] = {n: -1 for n in self.sites}
        self.stats_steps: List[int] = []
        """indices of the steps on which statistics were taken"""
        self._generators: Dict[torch.device, torch.Generator] = {}

    # -- lifecycle -------------------------------------------------------------------
    def attach(self) -> "SiteCollector":
        """Start observing (what ``with`` does on entry); step 0 is a stats step."""
        if self._attached:
            raise RuntimeError("this Probe is already attached")
        self._attached = True
        self._root_handle = self.model.register_forward_pre_hook(self._on_root_forward)
        self._root_post_handle = self.model.register_forward_hook(self._on_root_output)
        self._set_step(self._step)
        return self

    def detach(self) -> None:
        """Remove every hook; what was learned stays."""
        if self._root_handle is not None:
            self._root_handle.remove()
            self._root_handle = None
        if self._root_post_handle is not None:
            self._root_post_handle.remove()
            self._root_post_handle = None
        self._hooks_off()
        self._attached = False

    def __enter__(self) -> "SiteCollector":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def steps(self) -> int:
        """Steps seen so far (training forwards, or :meth:`step` calls in manual mode)."""
        return self._step if self._manual else self._forwards

    @property
    def counting(self) -> str:
        """'manual' once :meth:`step` was called, else 'auto' (training forwards)."""
        return "manual" if self._manual else "auto"

    @property
    def active(self) -> bool:
        """Whether the current step takes statistics (site hooks are registered)."""
        return bool(self._site_handles)

    def step(self) -> None:
        """End the current step (manual counting; the first call switches it on)."""
        self._manual = True
        self._set_step(self._step + 1)

    # -- hooks -----------------------------------------------------------------------
    def _set_step(self, step: int) -> None:
        self._step = step
        want = self._attached and step % self.config.every_n_steps == 0
        if want and not self._site_handles:
            for name, mod in self.modules.items():
                self._site_handles.append(mod.register_forward_hook(
                    functools.partial(self._on_forward, name), with_kwargs=True))
        elif not want:
            self._hooks_off()

    def _hooks_off(self) -> None:
        for h in self._site_handles:
            h.remove()
        self._site_handles = []
        # nodes are held until the root's forward ends or the hooks go
        self._outputs, self._inputs, self._read = {}, {}, {}
        self._in_root = False

    def _on_root_forward(self, module: nn.Module, args) -> None:
        # output nodes are recorded only inside the root's forward, and none outlives it
        self._outputs, self._inputs, self._read, self._in_root = {}, {}, {}, True
        if self._manual or not (module.training and torch.is_grad_enabled()):
            return
        self._set_step(self._forwards)
        self._forwards += 1

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.config.seed)
        return gen

    def _on_forward(self, name: str, module: nn.Linear, args, kwargs, output) -> None:
        if not module.training:
            return
        site = self.sites[name]
        if site.order is None and self._in_root:
            # forward execution order (which sites are nearest the loss): inside the root's
            # forward, with or without grad (a reentrant checkpoint runs its forward without
            # grad), never in a checkpoint's recompute during the backward
            site.order = self._ran
            self._ran += 1
        if not torch.is_grad_enabled():
            return
        x = args[0] if args else kwargs.get("input", kwargs.get("x"))
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        # producers from every call (a shared Linear may be fed differently each time)
        site.producers["x"] = merge_kinds(site.producers.get("x"), producer_of(x))
        if site.producers.get("x_layout") != "rows":  # 'copied' only if every call copies
            site.producers["x_layout"] = x_layout(x, site.in_features)
        if self._in_root:
            self._note_reader(name, x)
        if (self._in_root and x.grad_fn is not None and "x_users" not in site.producers
                and self._walks[name] < self.MAX_WALKS):
            inputs = self._inputs.setdefault(name, [])
            if len(inputs) < self.MAX_CALLS:
                inputs.append(x.grad_fn)
        if (self._in_root and output.requires_grad and output.grad_fn is not None
                and "dy" not in site.producers and self._walks[name] < self.MAX_WALKS):
            nodes = self._outputs.setdefault(name, [])
            if len(nodes) < self.MAX_CALLS:
                nodes.append(output.grad_fn)
        if self._last_update[name] == self._step:
            return
        self._last_update[name] = self._step
        if not self.stats_steps or self.stats_steps[-1] != self._step:
            self.stats_steps.append(self._step)
        with torch.no_grad():
            x2d = x.detach().reshape(-1, site.in_features)
            rows = x2d.shape[0]
            site.tokens = max(site.tokens, rows)
            site.dtype = output.dtype
            idx = None
            if rows > self.config.max_rows_per_update:
                # random rows (with replacement) from the stats' own generator
                idx = torch.randint(rows, (self.config.max_rows_per_update,), device=x2d.device,
                                    generator=self._generator(x2d.device))
                x2d = x2d[idx]
            site.act.update(x2d)
            site.weight.observe(full_weight(module.weight))
            if self.config.source == "captured":
                site.captured_x = x2d[: self._capture_rows].clone()
        if output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, name, idx))

    def _note_reader(self, name: str, x: torch.Tensor) -> None:
        """Sites whose input is one tensor (the same view of the same base: Wukong's two
        Linears over one layer output's transpose) share ``producers['x_group']``, the
        name of the first of them to run: they observe samples of one tensor, so a static
        scale for it is one value, and compiled code casts it once for all of them
        (:func:`loka.dispatch.static.group_amax`)."""
        base = x._base if x._base is not None else x
        try:
            key = (id(base), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
        except (RuntimeError, NotImplementedError):  # a tensor without storage metadata
            return
        first, _ = self._read.setdefault(key, (name, base))
        if first != name:
            group = self.sites[first].producers.setdefault("x_group", first)
            self.sites[name].producers.setdefault("x_group", group)

    def _on_root_output(self, module: nn.Module, args, output) -> None:
        """Who consumes each site's output (the producer of its gradient): one walk of the
        step's autograd graph, on the statistics steps where a site's is not yet known."""
        pending, self._outputs, self._in_root = self._outputs, {}, False
        self._read = {}  # the bases it held: nothing outlives the forward
        inputs, self._inputs = self._inputs, {}
        if not pending and not inputs:
            return
        consumers = consumers_of_outputs(output)
        for name, nodes in inputs.items():  # any call whose x is shared makes it shared
            found = {x_users(node, consumers) for node in nodes} - {None}
            if found:
                self.sites[name].producers["x_users"] = max(found, key=X_USERS.index)
            elif name not in pending:
                self._walks[name] += 1
        for name, nodes in pending.items():
            self._walks[name] += 1
            kind = None
            for node in nodes:  # every call of the site this step
                found = consumer_kind(node, consumers)
                kind = merge_kinds(kind, found) if found is not None else kind
            if kind is not None:
                self.sites[name].producers["dy"] = kind

    @property
    def _capture_rows(self) -> int:
        return max(self.config.sample_rows or 4096, 2 * 16)

    def _on_grad(self, name: str, idx: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        site = self.sites[name]
        with torch.no_grad():
            g = grad.detach().reshape(-1, site.out_features)
            if idx is not None:
                g = g[idx]
            site.grad.update(g)
            if self.config.source == "captured":
                site.captured_dy = g[: self._capture_rows].clone()
