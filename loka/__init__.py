"""LoKA: low-precision (FP8) kernel applications for recommendation models.

Probe each GEMM's real distributions, change the model so more of it is FP8-safe (Mods),
and dispatch every GEMM role to the fastest kernel that meets an accuracy budget.
"""

from . import kernels, numerics
from .config import DispatchConfig, LinearConfig, ModsConfig, ProbeConfig, Role
from .dispatch.linear import Linear

__version__ = "0.1.0"

__all__ = ["kernels", "numerics", "Linear", "LinearConfig", "ProbeConfig", "DispatchConfig",
           "ModsConfig", "Role", "__version__"]


def __getattr__(name):
    # Heavier parts load on first use, so `import loka` stays fast.
    lazy = {
        "Probe": ("loka.probe", "Probe"), "probe": ("loka.probe", "probe"),
        "ProbeReport": ("loka.probe", "ProbeReport"), "SiteReport": ("loka.probe", "SiteReport"),
        "plan": ("loka.dispatch", "plan"), "Plan": ("loka.dispatch", "Plan"),
        "apply": ("loka.dispatch", "apply"), "unapply": ("loka.dispatch", "unapply"),
        "optimize": ("loka.dispatch", "optimize"),
        "aot_compile": ("loka.dispatch", "aot_compile"), "load_aot": ("loka.dispatch", "load_aot"),
        "AOTModel": ("loka.dispatch", "AOTModel"),
        "mods": ("loka.mods", None), "models": ("loka.models", None), "data": ("loka.data", None),
        "distributed": ("loka.distributed", None),
        "integrations": ("loka.integrations", None),
    }
    if name in lazy:
        import importlib
        mod_name, attr = lazy[name]
        mod = importlib.import_module(mod_name)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'loka' has no attribute {name!r}")
