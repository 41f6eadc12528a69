"""LoKA beside the libraries recommendation teams already use: torchao (both directions)
and torchrec (models fed ``KeyedJaggedTensor``, tables in an ``EmbeddingBagCollection``).
Each optional library is imported only inside the functions that need it. See
docs/integrations.md.

>>> loka.integrations.from_torchao(model)          # Float8Linear -> nn.Linear, same Parameters
>>> export = loka.integrations.to_torchao(plan)    # per-site Float8LinearConfig, serving configs
>>> loka.integrations.to_torchrec(batch)           # a LoKA Batch as torchrec's Batch (KJT)
"""

from ..data.torchrec import (TorchrecBatches, from_kjt, from_torchrec, to_kjt, to_torchrec,
                             torchrec_available)
from ..models.torchrec_embedding import TorchrecEmbeddingArch, use_torchrec_tables
from .converter import PlanConverter
from .torchao import (TorchaoExport, describe, from_torchao, is_torchao_linear, to_torchao,
                      torchao_sites)
from .torchrec import site_name, unwrap

__all__ = ["TorchaoExport", "describe", "from_torchao", "is_torchao_linear", "to_torchao",
           "torchao_sites", "TorchrecBatches", "from_kjt", "from_torchrec", "to_kjt",
           "to_torchrec", "torchrec_available", "TorchrecEmbeddingArch", "use_torchrec_tables",
           "site_name", "unwrap", "PlanConverter"]
