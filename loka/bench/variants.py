"""Benchmark variants: each row of ``loka bench`` is named by a variant, parsed once, at the
edge, into a frozen :class:`Variant`; everything downstream reads its fields.

A name is a base followed by modifiers, ``<base>[+<modifier>]...``, the modifiers in the
order of :data:`MODIFIERS` (one spelling per variant, so that names in results compare):

==============================  ============================================================
base
==============================  ============================================================
``bf16``                        the model as built, no FP8
``torchao-<recipe>[-auto]``     torchao's float8 recipe (:data:`TORCHAO_RECIPES`) on every
                                Linear it can take except the logit, or (``-auto``, training
                                only) on those torchao's own filter picks; in inference,
                                torchao's ``quantize_`` (tensorwise, rowwise)
``loka``                        LoKA: Probe -> plan -> apply (or ``--plan``)
``loka@<plan>``                 LoKA with the plan named ``<plan>`` in ``--plans``
``loka-uniform-<kernel>[-big]``  one kernel on every role of every eligible Linear (``-big``:
                                only Linears with K, N >= 1024): the fixed choice a per-site
                                plan must beat
==============================  ============================================================

==================  =======================================================================
modifier
==================  =======================================================================
``+mods``           the paper's Mods (No Bias, BlockNorm, Hard Swish)
``+merge``          with ``+mods``: sibling Linears reading one input merged into one GEMM
``+automerge``      the same, only where timing the siblings apart and merged says it pays
                    (``loka.mods.merge_pays``)
``+tuned``          LoKA's plan tuned by whole-step timings (``loka.dispatch.tune_speed``)
``+search``         the best fixed choice per group of same-shape sites by exhaustive
                    whole-step timing (``loka.dispatch.search_speed``): the plan's yardstick
``+graphs``         the whole step captured in one CUDA graph (on CUDA)
``+token-major``    with ``+mods``: ``ModsConfig.token_major`` (Wukong's token-axis Linears as
                    ``W @ X`` on the layout the layer holds)
``+triton-emb``     the fused embedding tables pool with LoKA's Triton kernel instead of
                    ``F.embedding_bag`` (the same function)
``+fused-norm``     with ``+mods``: ``ModsConfig.fuse_norm_quant`` (each norm and activation
                    in front of an FP8-input Linear fused with its quantization)
``+static``         LoKA inference rows: static activation scales from the Probe's observed
                    amax where the forward kernel takes one
``+plain-inductor``  torchao inference rows: ``quantize_`` leaves Inductor's settings as they
                    are (``set_inductor_config=False``; by default it switches on
                    coordinate-descent tuning for the whole process, which makes compilation
                    of a large step very slow)
==================  =======================================================================

``+merge`` and ``+automerge`` exclude each other, as do ``+tuned`` and ``+search``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..config import ModsConfig

__all__ = ["Base", "Variant", "VariantError", "MODIFIERS", "TORCHAO_RECIPES",
           "TORCHAO_SERVING_RECIPES", "FASTEST", "TRAIN_VARIANTS", "INFER_VARIANTS",
           "RATIO_REFS", "parse_variants"]

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes"""
TORCHAO_SERVING_RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 inference granularities (``PerTensor``, ``PerRow``)"""


class Base(enum.Enum):
    """What a variant runs before its modifiers."""

    BF16 = "bf16"
    TORCHAO = "torchao"
    LOKA = "loka"
    NAMED = "loka@"
    """LoKA with a plan named in ``--plans``"""
    UNIFORM = "loka-uniform"
    """one kernel everywhere (a yardstick)"""


MODIFIERS: Tuple[str, ...] = ("mods", "merge", "automerge", "tuned", "search", "graphs",
                              "token-major", "triton-emb", "fused-norm", "static",
                              "plain-inductor")
"""every modifier, in the order a name writes them"""
_EXCLUSIVE = (("merge", "automerge"), ("tuned", "search"))
_FREE = ("tuned", "search", "plain-inductor", "triton-emb", "token-major", "fused-norm",
         "static")
"""modifiers that may be added to any variant the command line lists (``+automerge`` counts
as the listed ``+merge``)"""


class VariantError(ValueError):
    """A variant name outside the grammar; the message is one line and names the culprit."""


def _field(modifier: str) -> str:
    return modifier.replace("-", "_")


@dataclass(frozen=True)
class Variant:
    """One benchmark row's configuration, as its name spells it (see the module docstring).

    ``Variant.parse(name).name == name`` for every name in the grammar.
    """

    base: Base
    recipe: str = ""
    """torchao: the recipe"""
    auto: bool = False
    """torchao: torchao's own filter picks the Linears (``-auto``)"""
    kernel: str = ""
    """loka-uniform: the kernel"""
    big_only: bool = False
    """loka-uniform: only Linears with K, N >= 1024 (``-big``)"""
    plan: str = ""
    """loka@: the name of the plan in ``--plans``"""
    mods: bool = False
    merge: bool = False
    automerge: bool = False
    tuned: bool = False
    search: bool = False
    graphs: bool = False
    token_major: bool = False
    triton_emb: bool = False
    fused_norm: bool = False
    static: bool = False
    plain_inductor: bool = False

    def __post_init__(self):
        for a, b in _EXCLUSIVE:
            if getattr(self, _field(a)) and getattr(self, _field(b)):
                raise VariantError(f"variant {self.name!r}: +{a} and +{b} exclude each other")
        if self.base is Base.TORCHAO and self.recipe not in TORCHAO_RECIPES:
            raise VariantError(f"unknown variant {self.name!r}: torchao recipe {self.recipe!r} "
                               f"is not one of {', '.join(TORCHAO_RECIPES)}")
        if self.base is Base.UNIFORM and not self.kernel:
            raise VariantError("unknown variant 'loka-uniform-': name a kernel")
        if self.base is Base.NAMED and (not self.plan or "@" in self.plan):
            raise VariantError(f"unknown variant {self.name!r}: loka@<plan> needs a plan name "
                               "(without + or @)")
        if self.base is not Base.TORCHAO and (self.recipe or self.auto):
            raise VariantError("recipe and auto belong to torchao variants")
        if self.base is not Base.UNIFORM and (self.kernel or self.big_only):
            raise VariantError("kernel and big_only belong to loka-uniform variants")
        if self.base is not Base.NAMED and self.plan:
            raise VariantError("plan belongs to loka@<plan> variants")

    # -- names ---------------------------------------------------------------------
    @property
    def base_name(self) -> str:
        if self.base is Base.TORCHAO:
            return f"torchao-{self.recipe}{'-auto' if self.auto else ''}"
        if self.base is Base.UNIFORM:
            return f"loka-uniform-{self.kernel}{'-big' if self.big_only else ''}"
        if self.base is Base.NAMED:
            return f"loka@{self.plan}"
        return self.base.value

    @property
    def modifiers(self) -> Tuple[str, ...]:
        """The modifiers set, in name order."""
        return tuple(m for m in MODIFIERS if getattr(self, _field(m)))

    @property
    def name(self) -> str:
        return "+".join((self.base_name,) + self.modifiers)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The Variant ``name`` spells; :class:`VariantError` (one line) for a name outside
        the grammar: an unknown base or modifier, a modifier twice or out of order."""
        text = name.strip()
        head, *mods = text.split("+")
        kw: Dict[str, object] = {}
        if head in ("bf16", "loka"):
            kw["base"] = Base(head)
        elif head.startswith("loka@"):
            kw.update(base=Base.NAMED, plan=head[len("loka@"):])
        elif head.startswith("loka-uniform-"):
            body = head[len("loka-uniform-"):]
            kw.update(base=Base.UNIFORM, kernel=body.removesuffix("-big"),
                      big_only=body.endswith("-big"))
        elif head.startswith("torchao-"):
            body = head[len("torchao-"):]
            kw.update(base=Base.TORCHAO, recipe=body.removesuffix("-auto"),
                      auto=body.endswith("-auto"))
        else:
            raise VariantError(f"unknown variant {text!r}: the base {head!r} is none of bf16, "
                               "torchao-<recipe>[-auto], loka, loka@<plan>, "
                               "loka-uniform-<kernel>[-big]")
        last = -1
        for m in mods:
            if m not in MODIFIERS:
                raise VariantError(f"unknown variant {text!r}: unknown modifier +{m} (modifiers: "
                                   f"{' '.join('+' + x for x in MODIFIERS)})")
            if _field(m) in kw:
                raise VariantError(f"unknown variant {text!r}: +{m} twice")
            kw[_field(m)] = True
            if MODIFIERS.index(m) < last:
                spelled = cls(**kw).name
                raise VariantError(f"variant {text!r}: modifiers out of order, write {spelled!r}")
            last = MODIFIERS.index(m)
        return cls(**kw)

    def replace(self, **changes) -> "Variant":
        return dataclasses.replace(self, **changes)

    # -- what the harness reads ------------------------------------------------------
    @property
    def family(self) -> str:
        """'bf16', 'torchao' or 'loka' (LoKA's plans and its uniform yardsticks)."""
        if self.base is Base.TORCHAO:
            return "torchao"
        return "bf16" if self.base is Base.BF16 else "loka"

    @property
    def applies_plan(self) -> bool:
        """Whether the row probes (or loads) a LoKA plan and applies it."""
        return self.base in (Base.LOKA, Base.NAMED)

    @property
    def structure(self) -> str:
        """The model structure the plan is made for: '', 'merge' or 'automerge'."""
        return "merge" if self.merge else "automerge" if self.automerge else ""

    @property
    def whole_step(self) -> Optional[str]:
        """'tuned' or 'search' for a plan decided by whole-step timings, else None."""
        return "search" if self.search else "tuned" if self.tuned else None

    def graphs_on(self, device: torch.device) -> bool:
        """Whether the step is captured in a CUDA graph (``+graphs``, on CUDA)."""
        return self.graphs and device.type == "cuda"

    def mods_config(self) -> Optional[ModsConfig]:
        """The Mods the model is built with (None: the plain model)."""
        if not self.mods:
            return None
        return dataclasses.replace(ModsConfig.paper(), merge_siblings=self.merge,
                                   token_major=self.token_major,
                                   fuse_norm_quant=self.fused_norm)

    def listed(self) -> "Variant":
        """This variant without the modifiers that may be added to any listed variant
        (:data:`_FREE`), ``+automerge`` read as ``+merge``: what the lists must hold."""
        free = {_field(m): False for m in _FREE}
        return self.replace(**free, merge=self.merge or self.automerge, automerge=False)


def _names(*groups: Iterable[str]) -> Tuple[str, ...]:
    return tuple(n for g in groups for n in g)


FASTEST = ("bf16+mods+merge+graphs+token-major+triton-emb",
           "loka+mods+merge+tuned+graphs+token-major+triton-emb")
"""the strongest bf16 row and LoKA's fastest configuration: every Mod and layout change
that keeps the model's function, with and without LoKA's FP8 plan"""
_COMMON_LOKA = ("loka+mods", "loka+mods+graphs", "bf16+mods+merge+graphs",
                "loka+mods+merge+graphs", "loka+mods+merge+tuned+graphs")
TRAIN_VARIANTS = _names(
    ("bf16", "bf16+graphs", "bf16+mods", "bf16+mods+graphs"),
    (f"torchao-{r}{a}{m}" for m in ("", "+mods") for r in TORCHAO_RECIPES for a in ("", "-auto")),
    _COMMON_LOKA, FASTEST)
"""the training rows of a default run"""
INFER_VARIANTS = _names(
    ("bf16", "bf16+graphs", "bf16+mods", "bf16+mods+graphs"),
    (f"torchao-{r}{m}" for m in ("", "+mods") for r in TORCHAO_SERVING_RECIPES),
    _COMMON_LOKA, FASTEST)
"""the inference rows of a default run"""
RATIO_REFS = ("bf16", "bf16+mods", "bf16+mods+graphs", "bf16+mods+merge+graphs")
"""the baselines every row's speedup is given against (those measured in the run; a
chart is drawn against the first one measured)"""


def parse_variants(text: Optional[str], default: Sequence[str],
                   allowed: Sequence[str]) -> List[Variant]:
    """``--train-variants`` / ``--infer-variants``: a comma list (None: ``default``; 'none':
    no rows). Each name must parse and be in ``allowed`` up to the modifiers any listed
    variant may take (:meth:`Variant.listed`); loka@<plan> and loka-uniform-<kernel> take
    any modifiers. One ValueError names every bad entry."""
    if text is None:
        return [Variant.parse(n) for n in default]
    if text.strip() == "none":
        return []
    out, bad, why = [], [], []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        try:
            v = Variant.parse(name)
        except VariantError as e:
            bad.append(name)
            why.append(str(e))
            continue
        if (v.name not in allowed and v.listed().name not in allowed
                and v.base not in (Base.NAMED, Base.UNIFORM)):
            bad.append(name)
            continue
        out.append(v)
    if bad:
        reasons = f" ({'; '.join(why)})" if why else ""
        raise ValueError(f"unknown variant(s) {bad}{reasons}; choose from {list(allowed)}")
    return out
