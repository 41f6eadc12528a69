"""Models and data streams built from names: what the command line, the demo and the
benchmark harness assemble before they train, probe or time anything.

A model is a reference model by name and preset (:mod:`loka.models`) or the user's own,
``module:factory``; data is the synthetic stream or Criteo TSV files. Failures raise
:class:`AssemblyError`, one line with a hint, which the command line prints as it is.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from . import models
from .config import ModsConfig
from .data import CriteoReader, SyntheticCTR, criteo_feature_spec, sample_path
from .data.batch import Batch, FeatureSpec, TableSpec
from .mods import convert
from .models.fused_embedding import fuse_embeddings

__all__ = ["AssemblyError", "model_names", "import_factory", "build_model", "build_reference",
           "capped_features", "DataSpec", "parse_data", "criteo_features", "make_streams",
           "device_batches", "Optimizers"]


class AssemblyError(ValueError):
    """A model or data source that cannot be built as named; ``usage``: the name itself is
    wrong (an unknown model, preset or data form), not the file or code behind it."""

    def __init__(self, message: str, hint: Optional[str] = None, usage: bool = False):
        super().__init__(message)
        self.message, self.hint, self.usage = message, hint, usage


def model_names() -> List[str]:
    """The reference models' names."""
    return models.list_models()


def import_factory(spec: str):
    """The callable ``module:factory`` names (the current directory importable, as ``python
    -m`` makes it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise AssemblyError(f"model {spec!r}: expected a reference model name or module:factory",
                            f"models: {', '.join(model_names())}; or e.g. mypkg.models:make_model",
                            usage=True)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AssemblyError(f"model {spec!r}: cannot import {module_name!r} ({e})",
                            "run loka from the directory that holds the module, or install it"
                            ) from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise AssemblyError(f"model {spec!r}: {module_name} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise AssemblyError(f"model {spec!r}: {attr} is not callable")
    return factory


def build_model(spec: str, preset: str, mods: Optional[ModsConfig], features=None,
                seed: int = 0, tables: str = "torch") -> Tuple[nn.Module, str]:
    """A reference model ``spec`` at ``preset`` or the module returned by ``module:factory()``,
    with ``mods`` applied; ``features`` replaces a reference preset's FeatureSpec; ``tables``
    ('torch' or 'torchrec') is how a reference model holds its embedding tables.

    Returns:
        ``(model, description)``.
    """
    torch.manual_seed(seed)
    if ":" in spec and tables != "torch":
        raise AssemblyError(f"--tables {tables} builds a reference model's tables; model "
                            f"{spec!r} is your own", "build its tables as you want them in "
                            "your factory", usage=True)
    if ":" in spec:
        factory = import_factory(spec)
        try:
            model = factory()
        except Exception as e:  # noqa: BLE001 - the user's code: report it in one line
            raise AssemblyError(f"model {spec!r}: the factory raised {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": "),
                                "module:factory must be callable without arguments and return "
                                "an nn.Module") from None
        if not isinstance(model, nn.Module):
            raise AssemblyError(f"model {spec!r}: the factory returned a "
                                f"{type(model).__name__}, not an nn.Module")
        if mods is not None and mods.any:
            convert(model, mods)
        return model, spec
    if spec not in models.list_models():
        raise AssemblyError(f"unknown model {spec!r}", f"models: {', '.join(models.list_models())}; "
                            "or module:factory for your own", usage=True)
    presets = list(models.presets(spec))
    if preset not in presets:
        raise AssemblyError(f"unknown preset {preset!r} for {spec}", f"presets: {', '.join(presets)}",
                            usage=True)
    overrides = {} if features is None else {"features": features}
    try:
        model = models.build(spec, preset, mods=mods, tables=tables, **overrides)
    except ImportError as e:  # torchrec tables without torchrec
        raise AssemblyError(f"--tables {tables}: {e}", "pip install 'loka[torchrec]' (see the "
                            "README's optional dependencies)") from None
    return model, f"{spec}/{preset}" + ("" if tables == "torch" else f" ({tables} tables)")


def capped_features(features: FeatureSpec, table_rows: Optional[int]) -> FeatureSpec:
    """``features`` with every table capped at ``table_rows`` rows (None or 0: as it is)."""
    if not table_rows:
        return features
    return FeatureSpec(features.num_dense, tuple(
        TableSpec(t.name, min(t.num_embeddings, table_rows), t.mean_bag_length)
        for t in features.tables))


def build_reference(name: str, preset: str, mods: Optional[ModsConfig], device: torch.device, *,
                    seed: int = 0, table_rows: Optional[int] = None,
                    fused_embeddings: bool = False, tables: str = "torch") -> nn.Module:
    """A reference model as the benchmarks run it: dense embedding gradients (so that fused
    AdamW and CUDA graphs apply), tables capped at ``table_rows``, optionally fused tables
    or tables in a torchrec ``EmbeddingBagCollection`` (``tables="torchrec"``, see
    :func:`loka.models.build`), in bf16 on CUDA and float32 elsewhere, on ``device``."""
    torch.manual_seed(seed)
    base = models.presets(name)[preset]
    overrides = {}
    if hasattr(base, "sparse_embeddings"):
        overrides["sparse_embeddings"] = False
    if table_rows and hasattr(base, "features"):
        overrides["features"] = capped_features(base.features, table_rows)
    model = models.build(name, preset, mods=mods, tables=tables, **overrides)
    if fused_embeddings:
        fuse_embeddings(model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What ``--data`` names: the synthetic stream, or Criteo TSV files (train, eval)."""

    kind: str
    train_path: Optional[str] = None
    eval_path: Optional[str] = None

    @property
    def held_out(self) -> bool:
        """Whether evaluation data is apart from the training data: the synthetic stream's
        held-out seed or an evaluation file; a Criteo training file alone is evaluated on
        itself (``make_streams``), and is not held out."""
        return self.kind == "synthetic" or self.eval_path is not None

    @property
    def eval_source(self) -> str:
        """What evaluation reads: ``synthetic held-out stream`` or the file's path."""
        if self.kind == "synthetic":
            return "synthetic held-out stream"
        return self.eval_path or self.train_path


def parse_data(text: str) -> DataSpec:
    """``synthetic`` | ``criteo:TRAIN.tsv[,EVAL.tsv]`` | ``criteo:sample`` -> DataSpec."""
    if text == "synthetic":
        return DataSpec("synthetic")
    if text.startswith("criteo:"):
        paths = text[len("criteo:"):].split(",")
        paths = [sample_path() if p == "sample" else p for p in paths]
        if not paths[0] or len(paths) > 2:
            raise AssemblyError(f"--data {text!r}: expected criteo:TRAIN.tsv[,EVAL.tsv]",
                                "or criteo:sample for the sample shipped with LoKA", usage=True)
        for p in paths:
            if not os.path.isfile(p):
                raise AssemblyError(f"--data: no Criteo file at {p!r}",
                                    "give the path of a Criteo TSV file, or criteo:sample")
        return DataSpec("criteo", paths[0], paths[1] if len(paths) == 2 else None)
    raise AssemblyError(f"--data {text!r}: expected 'synthetic' or 'criteo:PATH'",
                        "e.g. --data synthetic, --data criteo:day_0.tsv,day_1.tsv, "
                        "--data criteo:sample", usage=True)


def criteo_features(spec: str, preset: str) -> Optional[FeatureSpec]:
    """The Criteo FeatureSpec hashed into the preset's table size (its first table's rows);
    None for a model of the user's own."""
    if ":" in spec:
        return None
    if spec in models.list_models() and preset in models.presets(spec):
        rows = models.presets(spec)[preset].features.tables[0].num_embeddings
        return criteo_feature_spec(rows)
    return None


def make_streams(data: DataSpec, model: nn.Module, batch_size: int, seed: int, device,
                 skip_malformed: bool = False):
    """``(train_stream, eval_stream)``: iterables of Batch with ``state_dict`` support.

    The synthetic stream and its held-out twin never end; a Criteo training file loops, its
    evaluation file (``data.eval_source``: the training file itself when no evaluation file
    is named, see ``DataSpec.held_out``) is read once and ends. ``skip_malformed``: Criteo
    readers count and skip malformed lines instead of raising. An empty file is an
    :class:`AssemblyError`."""
    if data.kind == "synthetic":
        spec = getattr(model, "feature_spec", None)
        if spec is None:
            raise AssemblyError("--data synthetic needs the model's feature_spec (a "
                                "loka.data.FeatureSpec attribute) to generate its features",
                                "give your model a feature_spec, or use --data criteo:PATH")
        stream = SyntheticCTR(spec, batch_size, seed=seed, device=device)
        return stream, stream.held_out()
    sizes = [t.num_embeddings for t in model.feature_spec.tables] if hasattr(
        model, "feature_spec") else 100_000
    train = CriteoReader(data.train_path, batch_size, table_sizes=sizes, loop=True,
                         skip_malformed=skip_malformed)
    # the evaluation file is read once per evaluation: it never loops
    held = CriteoReader(data.eval_source, batch_size, table_sizes=sizes, loop=False,
                        skip_malformed=skip_malformed)
    for reader in (train, held):
        if reader.is_empty():
            raise AssemblyError(f"--data: {reader.path} holds no examples"
                                + (" (every line malformed)" if skip_malformed else ""),
                                "give a Criteo TSV file with at least one line")
    return train, held


def device_batches(stream: Iterable[Batch], device) -> Iterator[Batch]:
    """The stream's batches moved to ``device``."""
    for batch in stream:
        yield batch.to(device)


class Optimizers:
    """Several optimizers stepped as one (dense AdamW + SparseAdam), for ``loka.probe``."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
