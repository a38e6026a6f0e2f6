"""Our model directories as ``transformers`` >= 5 models (docs/huggingface.md): importing it registers model_types
``essh``, ``es_ssm``, ``transformer_pp`` and ``matformer`` with ``AutoConfig`` / ``AutoModelForCausalLM``
(``from_pretrained("runs/x/final", tier="T4")`` reads only T4's prefixes)."""

from __future__ import annotations

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("elastic_ssm.hf needs Hugging Face transformers >= 5: pip install 'elastic-ssm[hf]'") from e

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - depends on the installed version
    raise ImportError(f"elastic_ssm.hf needs transformers >= 5, found {transformers.__version__}: "
                      "pip install -U 'transformers>=5'")

from .families import (
    ESSSMForCausalLM,
    ESSSMHFConfig,
    MatFormerForCausalLM,
    MatFormerHFConfig,
    StepCache,
    TransformerPPForCausalLM,
    TransformerPPHFConfig,
)
from .modeling import ESSHForCausalLM, ESSHHFCache, ESSHHFConfig

for _config, _model in ((ESSHHFConfig, ESSHForCausalLM), (ESSSMHFConfig, ESSSMForCausalLM),
                        (TransformerPPHFConfig, TransformerPPForCausalLM), (MatFormerHFConfig, MatFormerForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = ["ESSHForCausalLM", "ESSHHFCache", "ESSHHFConfig", "ESSSMForCausalLM", "ESSSMHFConfig",
           "MatFormerForCausalLM", "MatFormerHFConfig", "StepCache", "TransformerPPForCausalLM",
           "TransformerPPHFConfig"]
