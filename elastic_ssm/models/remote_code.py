"""The remote-code files of a saved model directory: transformers loads it with ``trust_remote_code=True`` alone.

``config.json``'s ``auto_map`` (``hf_keys``) names two thin modules written beside it; each imports its class
from the installed ``elastic_ssm.hf`` (no frozen copy of the model code), so a fresh process needs no ``import
elastic_ssm.hf``. Every language model has its entry in ``FAMILIES`` (an ES-SSM classifier has none)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["FAMILIES", "Family", "auto_map", "hf_keys", "remote_code"]


class Family(NamedTuple):
    """How one architecture appears to transformers: its ``model_type``, the two classes and where they live."""

    model_type: str
    config_class: str
    model_class: str
    module: str          # the module of elastic_ssm that defines both classes


#: arch (``ElasticModel.arch``) -> its transformers family
FAMILIES: dict[str, Family] = {
    "essh": Family("essh", "ESSHHFConfig", "ESSHForCausalLM", "elastic_ssm.hf.modeling"),
    "es_ssm": Family("es_ssm", "ESSSMHFConfig", "ESSSMForCausalLM", "elastic_ssm.hf.families"),
    "transformer": Family("transformer_pp", "TransformerPPHFConfig", "TransformerPPForCausalLM",
                          "elastic_ssm.hf.families"),
    "matformer": Family("matformer", "MatFormerHFConfig", "MatFormerForCausalLM", "elastic_ssm.hf.families"),
}

_HEAD = '''"""Remote code of an elastic_ssm model directory, written by save_pretrained. transformers imports this file
for from_pretrained(dir, trust_remote_code=True); the class comes from the installed elastic_ssm package
(pip install "elastic-ssm[hf]"), so the directory holds no second copy of the model code."""

'''


def auto_map(arch: str) -> dict[str, str]:
    """``config.json``'s ``auto_map`` of ``arch``: the Auto class -> ``module.Class`` in the directory."""
    f = FAMILIES[arch]
    return {"AutoConfig": f"configuration_{f.model_type}.{f.config_class}",
            "AutoModelForCausalLM": f"modeling_{f.model_type}.{f.model_class}"}


def remote_code(arch: str) -> dict[str, str]:
    """File name -> text of the two modules ``auto_map(arch)`` names."""
    f = FAMILIES[arch]
    return {
        f"configuration_{f.model_type}.py": f'{_HEAD}from {f.module} import {f.config_class}\n\n'
                                            f'__all__ = ["{f.config_class}"]\n',
        f"modeling_{f.model_type}.py": f'{_HEAD}from {f.module} import {f.model_class}, {f.config_class}\n\n'
                                       f'__all__ = ["{f.model_class}", "{f.config_class}"]\n',
    }


def hf_keys(model: Any) -> dict[str, Any]:
    """The ``config.json`` keys that let transformers read ``model``'s directory (none for a model without a
    family, such as an ES-SSM classifier)."""
    if model.arch not in FAMILIES or getattr(model.config, "task", "lm") != "lm":
        return {}
    f = FAMILIES[model.arch]
    return {"model_type": f.model_type, "architectures": [f.model_class], "auto_map": auto_map(model.arch)}
