"""LoKA on torchrec models: the same site names with and without
``DistributedModelParallel``.

LoKA acts on a model's dense GEMMs (``nn.Linear``), so a torchrec model, an
``EmbeddingBagCollection`` fed ``KeyedJaggedTensor``s plus a dense part in plain PyTorch,
needs nothing special from the Probe, ``loka.plan``, ``loka.apply`` or the Guard: they
see the Linears, the collection is not a site. Under ``DistributedModelParallel`` the
qualified names grow the wrapper's parts (``_dmp_wrapped_module.`` and, for the dense part
it wraps in ``DistributedDataParallel``, ``module.``). Give LoKA the model itself,
:func:`unwrap` (torchrec's ``dmp.module``: the sharded model without its parallel
wrappers); its sites are named as on the unwrapped model, so a plan made on one applies to
the other. :func:`site_name` maps a qualified name of the wrapped model to that name.

torchrec is never imported here: the wrapper is recognised by its attribute names.
"""

from __future__ import annotations

from torch import nn

from ..probe.hooks import canonical_name

DMP_WRAPPER = "_dmp_wrapped_module"
"""the attribute under which ``DistributedModelParallel`` holds the model"""


def site_name(name: str) -> str:
    """The site name of a module's qualified name in a model that may be wrapped by
    ``DistributedModelParallel`` (and ``DistributedDataParallel``, ``torch.compile``,
    FSDP, activation checkpointing): the name it has in the unwrapped model."""
    parts = name.split(".") if name else []
    if parts and parts[0] == DMP_WRAPPER:
        parts = parts[1:]
    return canonical_name(".".join(parts))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedModelParallel`` (torchrec's ``module`` property: no
    parallel wrapper around it), or ``model`` itself when it is not wrapped."""
    if DMP_WRAPPER in model.__dict__.get("_modules", {}):
        inner = model.module  # DistributedModelParallel.module unwraps DDP/FSDP as well
        if isinstance(inner, nn.Module):
            return inner
    return model
