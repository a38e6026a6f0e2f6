"""The remote-code files of a saved ESSH directory: ``transformers`` loads it with ``trust_remote_code=True`` alone.

``save_pretrained`` writes ``config.json`` with an ``auto_map`` (``AUTO_MAP``) and, beside it, the two small
modules it names. transformers' remote-code loader imports them from the directory; each takes its class from
the installed ``elastic_ssm`` package (``elastic_ssm.hf.modeling``), so

    AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)     # no `import elastic_ssm.hf` first

works in a fresh process wherever ``elastic-ssm[hf]`` is installed (transformers names the missing package
otherwise). Why not a self-contained copy of the model code: it would be the whole library (layers, ops, the
tier slicing), frozen at save time and drifting from the package that trained the weights; the hub models
that load this way (Zamba, Mamba-Codestral) ship thin modules too. ``import elastic_ssm.hf`` keeps working
without remote code (it registers model_type ``essh``).
"""

from __future__ import annotations

from pathlib import Path

from ..utils.files import atomic_write_bytes

__all__ = ["AUTO_MAP", "REMOTE_CODE", "write_remote_code"]

#: ``config.json``'s ``auto_map``: the Auto class -> ``module.Class`` in the directory
AUTO_MAP = {"AutoConfig": "configuration_essh.ESSHHFConfig",
            "AutoModelForCausalLM": "modeling_essh.ESSHForCausalLM"}

_HEAD = '''"""Remote code of an elastic_ssm ESSH directory, written by save_pretrained. transformers imports this file
for from_pretrained(dir, trust_remote_code=True); the class comes from the installed elastic_ssm package
(pip install "elastic-ssm[hf]"), so the directory holds no second copy of the model code."""

'''
#: file name -> text of the modules ``AUTO_MAP`` names
REMOTE_CODE = {
    "configuration_essh.py": _HEAD + 'from elastic_ssm.hf.modeling import ESSHHFConfig\n\n__all__ = ["ESSHHFConfig"]\n',
    "modeling_essh.py": _HEAD + 'from elastic_ssm.hf.modeling import ESSHForCausalLM, ESSHHFConfig\n\n'
                                '__all__ = ["ESSHForCausalLM", "ESSHHFConfig"]\n',
}


def write_remote_code(path: str | Path) -> None:
    """Write the ``REMOTE_CODE`` modules into the model directory ``path`` (each atomically)."""
    for name, text in REMOTE_CODE.items():
        atomic_write_bytes(Path(path) / name, text.encode())
