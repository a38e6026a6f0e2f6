"""The chat templates ``serve --chat_template`` can name (``chatml``, ``plain``), and how a name or a file
becomes a template's source (docs/serving.md, "Chat")."""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError

__all__ = ["BUILTIN", "chat_template_source"]

BUILTIN = {
    "chatml": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "plain": ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"),
}
#: the largest template file read (a template is a few hundred bytes; a wrong path should not read a dataset)
MAX_BYTES = 1 << 18


def chat_template_source(spec: str) -> str:
    """The Jinja source ``spec`` names: a built-in name (``BUILTIN``) or a template file (UTF-8 text, or a JSON
    ``tokenizer_config.json`` whose ``chat_template`` is taken); a one-line ``ConfigError`` otherwise."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--chat_template {spec!r} is neither a file nor one of {', '.join(BUILTIN)}; give a Jinja "
                          "template file or a name")
    if path.stat().st_size > MAX_BYTES:
        raise ConfigError(f"--chat_template {spec}: {path.stat().st_size:,} bytes, more than a template holds "
                          f"({MAX_BYTES:,} at most); give the template file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat_template {spec}: cannot read it as UTF-8 text ({e})") from None
    if path.suffix == ".json":
        import json

        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"--chat_template {spec}: a JSON file must hold a string 'chat_template' (as "
                              "tokenizer_config.json does)") from None
        if not isinstance(text, str):
            raise ConfigError(f"--chat_template {spec}: its 'chat_template' is not a string") from None
    if not text.strip():
        raise ConfigError(f"--chat_template {spec} is empty; give a Jinja template")
    return text
