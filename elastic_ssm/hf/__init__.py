"""elastic_ssm.hf: our model directories as Hugging Face ``transformers`` models (extra ``hf``, transformers >= 5).

``import elastic_ssm.hf`` registers model_type ``essh`` (and the other families below) with ``AutoConfig`` and
``AutoModelForCausalLM``, after which our directories (a training run's ``final/``, checkpoints' ``model/``,
exports) load directly:

    import elastic_ssm.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained("runs/x/final", tier="T4")   # only T4's prefixes are read
    tok = AutoTokenizer.from_pretrained("runs/x/final")
    out = model.generate(**tok(["def f(", "class A"], return_tensors="pt", padding=True), max_new_tokens=32)
    pipeline("text-generation", model="runs/x/final")("def main():", max_new_tokens=20)

Modules: ``modeling.py`` (ESSH and the bases), ``cache.py`` (``ESSHHFCache``), ``families.py`` (model_types
``es_ssm``, ``transformer_pp``, ``matformer``).
"""

from __future__ import annotations

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("elastic_ssm.hf needs Hugging Face transformers >= 5: pip install 'elastic-ssm[hf]'") from e

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - depends on the installed version
    raise ImportError(f"elastic_ssm.hf needs transformers >= 5, found {transformers.__version__}: "
                      "pip install -U 'transformers>=5'")

from .cache import ESSHHFCache
from .families import (
    ESSSMForCausalLM,
    ESSSMHFConfig,
    MatFormerForCausalLM,
    MatFormerHFConfig,
    StepCache,
    TransformerPPForCausalLM,
    TransformerPPHFConfig,
)
from .modeling import ESSHForCausalLM, ESSHHFConfig

for _config, _model in ((ESSHHFConfig, ESSHForCausalLM), (ESSSMHFConfig, ESSSMForCausalLM),
                        (TransformerPPHFConfig, TransformerPPForCausalLM), (MatFormerHFConfig, MatFormerForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = ["ESSHForCausalLM", "ESSHHFCache", "ESSHHFConfig", "ESSSMForCausalLM", "ESSSMHFConfig",
           "MatFormerForCausalLM", "MatFormerHFConfig", "StepCache", "TransformerPPForCausalLM",
           "TransformerPPHFConfig"]
